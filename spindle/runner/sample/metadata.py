"""Everything the sampler needs about the rows it samples, as batched tensors.

Built by the runner each step for the requests that sample (one row each, in the
order of the logits). Optional tensors are None when no row uses the feature, so
the common case (all greedy, no penalties) costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; rows with 0 are greedy
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int64, 0 = disabled
    top_p: torch.Tensor | None  # [B] float32, 1.0 = disabled
    min_p: torch.Tensor | None  # [B] float32, 0.0 = disabled
    # Row index -> generator of a request with its own seed. Rows without one draw
    # from the default generator of the logits' device.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # None: no row wants logprobs; k: return the sampled token plus the top k.
    max_num_logprobs: int | None = None
    # Penalties (None when every row has neutral penalties).
    prompt_token_ids: torch.Tensor | None = None  # [B, P] int64, padded with vocab_size
    output_token_ids: list[list[int]] = field(default_factory=list)  # per row, tokens so far
    frequency_penalties: torch.Tensor | None = None  # [B] float32
    presence_penalties: torch.Tensor | None = None  # [B] float32
    repetition_penalties: torch.Tensor | None = None  # [B] float32
    # Row index -> token ids to forbid because the row has fewer than min_tokens outputs.
    min_tokens_blocked: dict[int, set[int]] = field(default_factory=dict)
    # Row index -> the only token ids the row may sample (SamplingParams.allowed_token_ids,
    # or where a structured output stands: a numpy array then).
    allowed_token_ids: dict[int, Any] = field(default_factory=dict)
    # SamplingParams.logit_bias of the rows that have one, as (rows, token ids, biases):
    # three [N] tensors on the logits' device, added with index_put_ (None: no row).
    logit_bias: tuple | None = None

    @property
    def no_penalties(self) -> bool:
        return self.prompt_token_ids is None
