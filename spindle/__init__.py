"""spindle: a readable, fast LLM inference engine for Hugging Face checkpoints."""

__version__ = "0.1.0"

from spindle.entrypoints.beam_search import BeamSearchParams  # noqa: E402
from spindle.lora import LoRARequest  # noqa: E402
from spindle.outputs import (CompletionOutput, EmbeddingOutput,  # noqa: E402
                             EmbeddingRequestOutput, RequestOutput)
from spindle.pooling_params import PoolingParams  # noqa: E402
from spindle.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402


def __getattr__(name: str):
    # LLM pulls in torch model code; import it lazily so `import spindle` stays cheap.
    if name == "LLM":
        from spindle.entrypoints.llm import LLM

        return LLM
    if name == "ModelPool":
        from spindle.engine.model_pool import ModelPool

        return ModelPool
    raise AttributeError(f"module 'spindle' has no attribute {name!r}")


__all__ = ["LLM", "ModelPool", "LoRARequest", "BeamSearchParams", "SamplingParams",
           "StructuredOutputsParams",
           "PoolingParams",
           "RequestOutput",
           "CompletionOutput",
           "EmbeddingRequestOutput", "EmbeddingOutput", "__version__"]
