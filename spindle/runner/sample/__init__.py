"""Token sampling: penalties, temperature, min-p / top-k / top-p, seeded draws, logprobs."""

from spindle.runner.sample.metadata import SamplingMetadata
from spindle.runner.sample.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata"]
