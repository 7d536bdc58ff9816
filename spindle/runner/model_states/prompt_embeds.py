"""PromptEmbedsState: causal decoders whose requests may bring prompt embeddings.

Chosen by config (enable_prompt_embeds) for decoder models. A request may carry
`prompt_embeds` [num_prompt_tokens, hidden] instead of prompt token ids; the
engine gives such a request out-of-vocabulary placeholder ids, which nothing
embeds (and the penalties ignore, as padding). The embeddings go to the device
once, when the runner first sees the request (preprocess_state). Each step,
prepare_inputs finds the rows of the scheduled prompt positions (a loop over
requests, never over tokens) and forward copies them into the step's input
embeddings with one indexed copy.
Generated tokens (and requests without embeddings) are embedded from their ids.

Prefix caching is refused at config time: the cache hashes token ids, and
placeholder ids would make different prompts look identical.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from spindle.runner.input_batch import CachedRequestState, StepBatch
from spindle.runner.model_states.default import DefaultModelState
from spindle.runner.staging import HostToDevice
from spindle.step_messages import NewRequestData

EXTRA_KEY = "prompt_embeds"  # CachedRequestState.extra: the request's rows on the device
PLACEMENT_KEY = "_prompt_embeds_placement"  # step inputs: (token indices, rows) to place


class PromptEmbedsState(DefaultModelState):
    # A decode step may still be at a prompt position (the last token of a chunked
    # prompt), which the CUDA graphs, fed with token ids, would embed wrongly.
    supports_cuda_graphs = False

    def __init__(self, model: torch.nn.Module, device: torch.device,
                 h2d: HostToDevice | None = None) -> None:
        super().__init__(model, device, h2d)
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.config.vocab_size

    @classmethod
    def check_config(cls, config: Any) -> None:
        if config.cache.enable_prefix_caching:
            raise ValueError("enable_prompt_embeds needs enable_prefix_caching=False: the "
                             "prefix cache hashes token ids, and prompt embeddings have none")
        if config.model.task != "generate":
            raise ValueError(f"enable_prompt_embeds works with task='generate' only, got "
                             f"{config.model.task!r}")

    def validate_request(self, new: NewRequestData) -> None:
        embeds = new.prompt_embeds
        if embeds is not None and tuple(embeds.shape[:1]) != (new.num_prompt_tokens,):
            raise ValueError(f"request {new.req_id!r}: prompt_embeds has shape "
                             f"{tuple(embeds.shape)}, expected {new.num_prompt_tokens} rows")

    def preprocess_state(self, state: CachedRequestState, new: NewRequestData) -> None:
        if new.prompt_embeds is not None:
            state.extra[EXTRA_KEY] = new.prompt_embeds.to(self.device, self.dtype)

    def prepare_inputs(self, batch: StepBatch) -> dict[str, Any]:
        inputs = super().prepare_inputs(batch)
        placement = _prompt_rows(batch)
        if placement is not None:
            token_index, rows = placement
            inputs[PLACEMENT_KEY] = (self.h2d.put(token_index, torch.int64), rows)
        return inputs

    def forward(self, model_inputs: dict[str, Any]) -> torch.Tensor:
        """Embed the step's ids, then copy the prompt rows over their positions. This
        happens here, not in prepare_inputs, because the runner may write on the
        device, in between, the ids of tokens a step still in flight is sampling."""
        inputs = dict(model_inputs)
        placement = inputs.pop(PLACEMENT_KEY, None)
        if placement is None:
            return self.model(**inputs)
        ids = inputs.pop("input_ids")
        embeds = self.model.embed_tokens(torch.where(ids < self.vocab_size, ids, 0))
        token_index, rows = placement
        embeds[token_index] = rows
        return self.model(input_ids=None, inputs_embeds=embeds, **inputs)


def _prompt_rows(batch: StepBatch) -> tuple[np.ndarray, torch.Tensor] | None:
    """Step token indices at prompt positions of requests with embeddings, and
    the embedding rows that go there (in the same order); None if there are none."""
    index_parts, row_parts = [], []
    for i, request in enumerate(batch.requests):
        table = request.extra.get(EXTRA_KEY)
        if table is None:
            continue
        start = int(batch.num_computed[i])
        end = min(int(batch.seq_lens[i]), request.num_prompt_tokens)
        if start >= end:
            continue  # decoding past the prompt: ids only
        first = int(batch.query_start_loc[i])
        index_parts.append(np.arange(first, first + end - start))
        row_parts.append(table[start:end])
    if not row_parts:
        return None
    return np.concatenate(index_parts), torch.cat(row_parts)
