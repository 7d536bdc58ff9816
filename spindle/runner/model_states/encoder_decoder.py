"""EncoderDecoderModelState: encoder-decoder models (Whisper), fed decoder token ids
plus, per request, what its encoder reads (audio features).

A request's encoder runs once, in the step that computes its first decoder token (the
scheduler admits requests within an encoder budget, max_num_encoder_tokens). That
step passes the model the encoder inputs of those requests, stacked in request order,
with their state slots; each decoder layer writes the encoder output's cross-attention
keys and values into the slots, and every step reads them there (spindle/attention/
cross.py). A preempted request returns with nothing computed: its encoder runs again.

Cache groups: the decoder's self-attention is paged as usual; cross-attention is a
state group (one slot per running request, the encoder's positions long), whose
metadata is the state groups' MambaMetadata (has_initial_state False: the request's
encoder runs this step). Decode steps, where every request has its cross keys and
values already, replay CUDA graphs. With mm_ipc_gpu_memory_gb the encoder inputs are
staged in a media buffer of that size (multimodal/buffer_pool.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from spindle.multimodal.buffer_pool import MediaBufferPool
from spindle.runner.input_batch import CachedRequestState, StepBatch
from spindle.runner.model_states.mamba_hybrid import MambaHybridModelState
from spindle.step_messages import NewRequestData

_FEATURES = "encoder_inputs"


class EncoderDecoderModelState(MambaHybridModelState):
    needs_kv_cache = True
    supports_cuda_graphs = True
    # (Its warm-up's mixed steps would run the encoder for every request.)
    may_split_mixed_steps = False

    def __init__(self, model, device, h2d=None) -> None:
        super().__init__(model, device, h2d)
        # Encoder inputs of the profiling forward (set by dummy_attn, used once).
        self._profile_encoder_rows = 0
        self.media_buffer: MediaBufferPool | None = None

    def set_media_buffer(self, capacity_bytes: int) -> None:
        """Stage encoder inputs in one buffer of the reserved size (the scheduler's
        encoder budget keeps a step's inputs within it)."""
        self.media_buffer = MediaBufferPool(capacity_bytes, self.device)

    @classmethod
    def check_config(cls, config: Any) -> None:
        if config.parallel.pipeline_parallel_size > 1:
            raise ValueError("pipeline_parallel_size > 1 is not supported for encoder-decoder "
                             "models")
        if config.model.task != "generate":
            raise ValueError(f"{config.model.architecture} serves task='generate' only")

    def validate_request(self, new: NewRequestData) -> None:
        features = new.encoder_inputs
        if not isinstance(features, torch.Tensor) or features.dim() != 2:
            raise ValueError(f"request {new.req_id!r}: an encoder-decoder request needs its "
                             "encoder's inputs (audio features [mels, frames])")

    def preprocess_state(self, state: CachedRequestState, new: NewRequestData) -> None:
        """Keep the encoder's inputs (on the host) until its encoder has run."""
        if new.num_computed_tokens == 0:
            state.extra[_FEATURES] = new.encoder_inputs

    def warmup_inputs(self) -> dict[str, Any]:
        """What a warm-up request carries besides tokens: the encoder's inputs of silence."""
        return {"encoder_inputs": self.model.dummy_encoder_inputs()}

    def prepare_inputs(self, batch: StepBatch) -> dict[str, Any]:
        inputs = super().prepare_inputs(batch)
        starting = np.flatnonzero(batch.num_computed == 0)
        if starting.size:
            features = [batch.requests[i].extra.pop(_FEATURES) for i in starting]
            inputs["encoder_features"] = self._stage(features)
            inputs["encoder_slots"] = self.h2d.put(batch.state_slots[starting], torch.int64)
        return inputs

    def _stage(self, features: list[torch.Tensor]) -> torch.Tensor:
        """The step's encoder inputs on the device: in the media buffer when one is set
        aside (mm_ipc_gpu_memory_gb), else a fresh tensor."""
        if self.media_buffer is not None:
            return self.media_buffer.stage(features)
        stacked = torch.stack(features)
        if self.device.type == "cuda":
            stacked = stacked.pin_memory()
        return stacked.to(self.device, non_blocking=True)

    def dummy_attn(self, num_reqs: int, tokens_per_req: int) -> Any:
        """The profiling forward's metadata; its forward runs each request's encoder
        too (the activation peak of a step that starts num_reqs requests)."""
        self._profile_encoder_rows = num_reqs
        return super().dummy_attn(num_reqs, tokens_per_req)

    def forward(self, model_inputs: dict[str, Any]) -> torch.Tensor:
        rows, self._profile_encoder_rows = self._profile_encoder_rows, 0
        if rows and "encoder_features" not in model_inputs:
            features = self.warmup_inputs()["encoder_inputs"].to(self.device)
            model_inputs = dict(model_inputs,
                                encoder_features=features.expand(rows, *features.shape))
        return self.model(**model_inputs)
