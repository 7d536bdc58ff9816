"""ModelState: the one place where a family of architectures differs in the runner.

The runner is architecture-agnostic: it keeps request rows, prepares the flat step
batch, runs the sampler and reports tokens. How that batch becomes model inputs
(token ids or embeddings), which attention metadata the model needs (a causal
paged-KV decoder, a bidirectional encoder without cache), and how the forward is
called, belong to a ModelState. Adding a family is one new state class plus a
registration line in model_states/__init__.py.

Invariants every state keeps:
- prepare_inputs / prepare_attn are pure functions of the StepBatch and the state's
  per-request data; they do not mutate the batch.
- forward() runs inside the runner's forward context holding prepare_attn's result.
- Per-request data a state needs (e.g. prompt embeddings on the device) is created
  in preprocess_state() when the runner first sees the request, stored in
  CachedRequestState.extra, and dropped with the request.
"""

from __future__ import annotations

import abc
from typing import Any

import torch
from torch import nn

from spindle.cache.spec import FULL_ATTENTION, CacheGroup
from spindle.runner.input_batch import CachedRequestState, StepBatch
from spindle.runner.staging import HostToDevice
from spindle.step_messages import NewRequestData


class ModelState(abc.ABC):
    #: Whether the runner must allocate a paged KV cache for this model.
    needs_kv_cache: bool = True
    #: Whether decode steps may be replayed from CUDA graphs fed with token ids
    #: (runner/cuda_graph.py); states with other inputs run eagerly.
    supports_cuda_graphs: bool = False
    #: Whether mixed steps' attention metadata names their single-token requests
    #: (AttentionMetadata.single_token_reqs): the warm-up then runs such steps too.
    splits_mixed_steps: bool = False

    def graph_can_take(self, batch: Any) -> bool:
        """Whether a decode graph may run this step (shape permitting): a state may keep
        some steps eager."""
        return True

    def __init__(self, model: nn.Module, device: torch.device,
                 h2d: HostToDevice | None = None) -> None:
        self.model = model
        self.device = device
        # Stage step inputs through h2d.put(array, dtype): pinned, non-blocking copies.
        self.h2d = h2d or HostToDevice(device)
        # The model's cache groups (spindle/cache/spec.py), set by the runner once it
        # has grouped the caching layers.
        self.cache_groups: list[CacheGroup] = []

    def groups(self) -> list[CacheGroup]:
        """The cache groups whose metadata prepare_attn builds (one full-attention
        group until the runner says otherwise)."""
        return self.cache_groups or [CacheGroup(FULL_ATTENTION, 1)]

    @classmethod
    def check_config(cls, config: Any) -> None:
        """Raise ValueError, at config time, for an EngineConfig feature this state
        cannot serve (the runner never falls back silently)."""
        return None

    def validate_request(self, new: NewRequestData) -> None:
        """Raise ValueError for a request this state cannot serve (called before it is added)."""
        return None

    def preprocess_state(self, state: CachedRequestState, new: NewRequestData) -> None:
        """Set up per-request data when the runner first sees a request."""
        return None

    @abc.abstractmethod
    def prepare_inputs(self, batch: StepBatch) -> dict[str, Any]:
        """Keyword arguments of the model's forward for this step."""

    @abc.abstractmethod
    def prepare_attn(self, batch: StepBatch) -> Any:
        """The attention metadata this step's forward context carries."""

    def forward(self, model_inputs: dict[str, Any]) -> torch.Tensor:
        return self.model(**model_inputs)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_states)

    def set_media_buffer(self, capacity_bytes: int) -> None:
        """The bytes set aside for decoded media (mm_ipc_gpu_memory_gb): states whose
        requests carry media stage them there."""
        return None

    def warmup_inputs(self) -> dict[str, Any]:
        """NewRequestData fields a warm-up request needs besides its tokens (an
        encoder-decoder's encoder inputs)."""
        return {}

    def dummy_attn(self, num_reqs: int, tokens_per_req: int) -> Any:
        """Metadata for a cache-less profiling forward of num_reqs equal requests."""
        raise NotImplementedError(f"{type(self).__name__} has no profiling path")
