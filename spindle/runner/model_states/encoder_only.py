"""EncoderOnlyModelState: bidirectional encoders (BERT, RoBERTa, XLM-R) that embed.

No KV cache: the runner allocates none and the engine gives the scheduler zero
blocks. Every request is a pooling request scheduled as one whole prompt, so a
step is a set of complete sequences packed without padding; attention among them
is planned once per step (EncoderAttentionMetadata) and shared by all layers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from spindle.attention.encoder import EncoderAttentionMetadata
from spindle.runner.input_batch import StepBatch
from spindle.runner.model_states.base import ModelState
from spindle.step_messages import NewRequestData


class EncoderOnlyModelState(ModelState):
    needs_kv_cache = False

    @classmethod
    def check_config(cls, config: Any) -> None:
        if config.model.task != "embed":
            raise ValueError(f"task must be 'embed' for the encoder-only model "
                             f"{config.model.architecture}, got {config.model.task!r} "
                             "(it has no language-model head to generate with)")

    def validate_request(self, new: NewRequestData) -> None:
        if new.pooling_params is None:
            raise ValueError(f"request {new.req_id!r}: encoder-only models serve pooling "
                             "(embedding) requests only")
        if new.num_computed_tokens != 0 or len(new.token_ids) != new.num_prompt_tokens:
            raise ValueError(f"request {new.req_id!r}: an encoder request must start from "
                             "its whole prompt, with nothing computed")

    def prepare_inputs(self, batch: StepBatch) -> dict[str, Any]:
        if np.any(batch.num_computed != 0) or not np.all(batch.sampling_mask):
            raise RuntimeError("an encoder step must hold whole prompts only")
        return {"input_ids": self.h2d.put(batch.input_ids, torch.int64),
                "positions": self.h2d.put(batch.positions, torch.int64)}

    def prepare_attn(self, batch: StepBatch) -> EncoderAttentionMetadata:
        return EncoderAttentionMetadata.from_seq_lens(batch.num_scheduled.tolist(), self.device,
                                                      stage=self.h2d.put)

    def dummy_attn(self, num_reqs: int, tokens_per_req: int) -> EncoderAttentionMetadata:
        return EncoderAttentionMetadata.from_seq_lens([tokens_per_req] * num_reqs, self.device)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise ValueError("encoder-only models have no language-model head: they pool, not sample")

