"""A draft model: a smaller checkpoint with the target's vocabulary, run by the same
worker, proposing k tokens autoregressively.

Its KV cache has its own tensors (its layers' page shapes) but the target's block
ids: every step the draft runs a forward over the same tokens as the target
(after_forward), so the blocks a request holds, prefix-cache hits included, carry
both models' keys and values. Proposing then runs k one-token steps from each
request's last token; the scheduler allocated slots for them (num_lookahead_tokens).
Keys the draft writes for rejected tokens are overwritten when the target computes
those positions again.
"""

from __future__ import annotations

import numpy as np
import torch

from spindle.attention.layer import Attention
from spindle.cache.spec import FULL_ATTENTION, AttentionCacheSpec, CacheGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.forward_context import forward_context
from spindle.models.loader import load_model, reload_checkpoint
from spindle.runner.input_batch import CachedRequestState
from spindle.runner.model_states.default import DefaultModelState
from spindle.runner.sample.sampler import GREEDY_TEMPERATURE_EPS, exponential_race
from spindle.runner.spec_decode.base import Proposal, Proposer


class DraftModelProposer(Proposer):
    def __init__(self, config, runner) -> None:
        super().__init__(config, runner)
        self.model = None
        self.state: DefaultModelState | None = None
        self.layers: list[Attention] = []

    def load_model(self) -> None:
        runner = self.runner
        layout = runner.cache_layout
        if [g.kind for g in layout.groups] != [FULL_ATTENTION]:
            raise ValueError("speculative_config method 'draft_model' needs a target whose "
                             f"layers all use full attention; {runner.config.model.architecture} "
                             f"has {layout.describe()}")
        self.model = load_model(self.config.draft, runner.device, runner.tp_group,
                                PipelineStage.single())
        self.layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        specs = [layer.cache_spec(self.config.draft.dtype) for layer in self.layers]
        if not specs or any(not isinstance(s, AttentionCacheSpec) or s.sliding_window
                            for s in specs):
            raise ValueError(f"the draft model {self.config.draft.model} must use full "
                             "attention in every layer")
        backend = runner.config.device.attention_backend
        for layer in self.layers:
            layer.cache_group = 0
            if layer.backend_name != backend:
                layer.use_backend(backend)
        self.state = DefaultModelState(self.model, runner.device, runner.h2d)
        self.state.cache_groups = [CacheGroup(FULL_ATTENTION, len(self.layers))]

    def block_bytes(self, block_size: int) -> int:
        dtype = self.config.draft.dtype
        return sum(layer.cache_spec(dtype).block_bytes(block_size) for layer in self.layers)

    def allocate_cache(self, num_blocks, allocate) -> list[torch.Tensor]:
        dtype = self.config.draft.dtype
        block_size = self.runner.config.cache.block_size
        pages = []
        for layer in self.layers:
            spec = layer.cache_spec(dtype)
            pages.append(allocate(spec.shape(num_blocks, block_size), dtype))
            layer.kv_cache = spec.layer_view(pages[-1])
        return pages

    def weights(self) -> list[torch.Tensor]:
        return list(self.model.parameters()) + list(self.model.buffers())

    def buffers(self) -> list[torch.Tensor]:
        return list(self.model.buffers())

    def reload_weights(self) -> None:
        reload_checkpoint(self.model, self.config.draft)

    def release(self) -> None:
        for layer in self.layers:
            layer.kv_cache = None
        self.layers, self.model, self.state = [], None, None

    def after_forward(self, batch, feed, hidden) -> None:
        """The draft's keys and values for the step's tokens."""
        inputs = self.state.prepare_inputs(batch)
        if feed is not None:
            feed(inputs["input_ids"])
        with forward_context(self.state.prepare_attn(batch)):
            self.state.forward(inputs)

    def propose(self, req_ids: list[str]) -> dict[str, Proposal]:
        """k one-token steps from each request's last token (fewer near max_model_len);
        greedy requests draft the argmax, the others draw from the draft's
        distribution at their temperature, which rejection sampling then weighs."""
        batch = self.runner.input_batch
        states = [batch.requests[r] for r in req_ids]
        lengths = np.array([min(self.num_speculative_tokens, batch.max_model_len - s.num_tokens)
                            for s in states], dtype=np.int64)
        keep = lengths > 0
        states, lengths = [s for s, k in zip(states, keep) if k], lengths[keep]
        if not states:
            return {}
        h2d, device = self.runner.h2d, self.runner.device
        first = np.array([s.num_tokens - 1 for s in states], dtype=np.int64)
        tokens = h2d.put(batch.token_ids[[s.row for s in states], first], torch.int64)
        drafts = torch.full((len(states), int(lengths.max())), -1, dtype=torch.int64,
                            device=device)
        probs: list[list[torch.Tensor]] = [[] for _ in states]
        for j in range(int(lengths.max())):
            active = np.flatnonzero(lengths > j)
            step_states = [states[i] for i in active]
            rows = h2d.put(active, torch.int64)
            step_tokens, step_probs = self._step(step_states, first[active] + j, tokens[rows])
            tokens[rows] = step_tokens
            drafts[rows, j] = step_tokens
            if step_probs is not None:
                for i, row_probs in zip(active.tolist(), step_probs):
                    if row_probs is not None:
                        probs[i].append(row_probs)
        out = drafts.tolist()
        return {s.req_id: Proposal(out[i][:lengths[i]],
                                   torch.stack(probs[i]) if probs[i] else None)
                for i, s in enumerate(states)}

    def _step(self, states: list[CachedRequestState], positions: np.ndarray,
              input_ids: torch.Tensor) -> tuple[torch.Tensor, list | None]:
        """One draft token per request after input_ids at positions; with the
        distribution it was drawn from for requests that sample (None for greedy)."""
        batch = self.runner.input_batch.decode_batch(states, positions)
        inputs = {"input_ids": input_ids,
                  "positions": self.runner.h2d.put(positions, torch.int64)}
        with forward_context(self.state.prepare_attn(batch)):
            hidden = self.state.forward(inputs)
        logits = self.state.compute_logits(hidden).float()
        greedy = [s.sampling_params.is_greedy for s in states]
        tokens = logits.argmax(dim=-1)
        row_probs = None
        if not all(greedy):
            temperature = torch.tensor([1.0 if g else s.sampling_params.temperature
                                        for g, s in zip(greedy, states)],
                                       device=logits.device).clamp(min=GREEDY_TEMPERATURE_EPS)
            q = (logits / temperature.unsqueeze(1)).softmax(dim=-1)
            generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
            drawn = exponential_race(q, generators)
            is_greedy = torch.tensor(greedy, device=logits.device)
            tokens = torch.where(is_greedy, tokens, drawn)
            row_probs = [None if g else q[i] for i, g in enumerate(greedy)]
        # Tensor-parallel ranks continue from rank 0's drafts (their draws may differ).
        return self.runner.tp_group.broadcast(tokens.contiguous()), row_probs
