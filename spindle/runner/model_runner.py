"""ModelRunner: turns a SchedulerOutput into sampled tokens on one device.

It owns the request rows (InputBatch), the KV cache tensors and the sampler, and
delegates everything architecture-specific to a ModelState. It never branches on
the architecture.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from torch import nn

from spindle.attention.layer import Attention
from spindle.config import EngineConfig
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.engine.scheduler_output import (ModelRunnerOutput, SampledLogprobs,
                                             SchedulerOutput)
from spindle.forward_context import forward_context
from spindle.models.loader import load_model
from spindle.platforms.interface import Platform
from spindle.runner.input_batch import InputBatch, StepBatch
from spindle.runner.model_states import model_state_class
from spindle.runner.model_states.base import ModelState
from spindle.runner.sample import Sampler, SamplerOutput
from spindle.runner.sample.metadata import SamplingMetadata

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, platform: Platform,
                 tp_group: TensorParallelGroup) -> None:
        self.config = config
        self.device = device
        self.platform = platform
        self.tp_group = tp_group
        self.model: nn.Module | None = None
        self.state: ModelState | None = None
        self.sampler = Sampler()
        self.attn_layers: list[Attention] = []
        self.kv_caches: list[torch.Tensor] = []
        self.num_kv_blocks = 0
        self.input_batch = InputBatch(
            max_num_reqs=config.scheduler.max_num_seqs,
            max_model_len=config.model.max_model_len,
            block_size=config.cache.block_size,
            vocab_size=config.model.vocab_size,
            device=device)

    # ---- lifecycle ------------------------------------------------------------
    def load_model(self) -> None:
        self.model = load_model(self.config.model, self.device, self.tp_group)
        self.state = model_state_class(self.model)(self.model, self.device)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]

    @property
    def needs_kv_cache(self) -> bool:
        return self._require_state().needs_kv_cache and bool(self.attn_layers)

    def kv_cache_block_bytes(self) -> int:
        """Bytes one KV block takes across all of this rank's attention layers."""
        if not self.needs_kv_cache:
            return 0
        block_size = self.config.cache.block_size
        elem = torch.empty((), dtype=self.config.model.dtype).element_size()
        return sum(2 * block_size * layer.num_kv_heads * layer.head_dim * elem
                   for layer in self.attn_layers)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A cache-less forward at the step token budget plus the sampler over
        max_num_seqs rows: the activation peak the KV budget must leave room for."""
        state = self._require_state()
        sched = self.config.scheduler
        num_reqs = -(-sched.max_num_batched_tokens // sched.max_model_len)
        tokens_per_req = max(1, sched.max_num_batched_tokens // num_reqs)
        num_tokens = num_reqs * tokens_per_req
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(tokens_per_req, device=self.device).repeat(num_reqs)
        with forward_context(state.dummy_attn(num_reqs, tokens_per_req)):
            hidden = state.forward({"input_ids": input_ids, "positions": positions})
        rows = torch.arange(sched.max_num_seqs, device=self.device) % num_tokens
        logits = state.compute_logits(hidden[rows]).float()
        self.sampler(logits, _dummy_sampling_metadata(sched.max_num_seqs, self.device))
        self.platform.synchronize(self.device)

    def allocate_kv_cache(self, num_blocks: int) -> int:
        """Allocate num_blocks KV blocks per attention layer; returns bytes allocated."""
        self.num_kv_blocks = num_blocks
        if not self.needs_kv_cache:
            return 0
        block_size = self.config.cache.block_size
        self.kv_caches = []
        for layer in self.attn_layers:
            cache = torch.zeros((2, num_blocks, block_size, layer.num_kv_heads, layer.head_dim),
                                dtype=self.config.model.dtype, device=self.device)
            layer.kv_cache = cache
            self.kv_caches.append(cache)
        return sum(c.numel() * c.element_size() for c in self.kv_caches)

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run one small real step through the cache path so first requests are not slow."""
        if self.num_kv_blocks < 1:
            return
        from spindle.engine.scheduler_output import NewRequestData
        from spindle.sampling_params import SamplingParams

        n = min(self.config.cache.block_size, self.config.model.max_model_len)
        sched = SchedulerOutput(
            new_requests=[NewRequestData("__warmup__", [0] * n, n, SamplingParams(temperature=0.0),
                                         [0], 0)],
            num_scheduled_tokens={"__warmup__": n}, total_num_scheduled_tokens=n)
        self.execute_model(sched)
        self.input_batch.remove_request("__warmup__")

    # ---- one step ---------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        if sched.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput()
        state = self._require_state()
        batch = self.input_batch.prepare(sched)
        inputs = state.prepare_inputs(batch)
        with forward_context(state.prepare_attn(batch)):
            hidden = state.forward(inputs)
        sampled = self._sample(batch, hidden)
        return self._record_and_report(batch, sampled)

    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self.input_batch.remove_request(req_id)
        state = self._require_state()
        for new in sched.new_requests:
            state.validate_request(new)
            cached = self.input_batch.add_request(new)
            state.preprocess_state(cached, new)
        for cached_req in sched.cached_requests:
            self.input_batch.append_blocks(cached_req.req_id, cached_req.new_block_ids)
            self.input_batch.requests[cached_req.req_id].num_computed_tokens = \
                cached_req.num_computed_tokens

    def _sample(self, batch: StepBatch, hidden: torch.Tensor) -> SamplerOutput | None:
        if len(batch.logits_indices) == 0:
            return None
        indices = torch.from_numpy(batch.logits_indices).to(self.device)
        logits = self._require_state().compute_logits(hidden[indices]).float()
        metadata = self.input_batch.sampling_metadata(batch.sampling_req_ids)
        return self.sampler(logits, metadata)

    def _record_and_report(self, batch: StepBatch, sampled: SamplerOutput | None) -> ModelRunnerOutput:
        """Advance each request's progress, append sampled tokens, build the reply."""
        requests = self.input_batch.requests
        for req_id, n in zip(batch.req_ids, batch.num_scheduled):
            requests[req_id].num_computed_tokens += int(n)
        token_ids = sampled.sampled_token_ids.tolist() if sampled is not None else []
        logprobs = _logprobs_rows(sampled, len(token_ids))
        out = ModelRunnerOutput(req_ids=batch.req_ids)
        sample_row = 0
        for req_id, samples in zip(batch.req_ids, batch.sampling_mask):
            if not samples:
                out.sampled_token_ids.append([])
                out.logprobs.append(None)
                continue
            state = requests[req_id]
            token = token_ids[sample_row]
            self.input_batch.append_token(state, token)
            out.sampled_token_ids.append([token])
            out.logprobs.append(_logprobs_for(logprobs, sample_row, state.sampling_params.logprobs))
            sample_row += 1
        return out

    def _require_state(self) -> ModelState:
        if self.state is None:
            raise RuntimeError("the model is not loaded: call load_model() first")
        return self.state


def _logprobs_rows(sampled: SamplerOutput | None, n: int):
    if sampled is None or sampled.logprobs is None:
        return None
    return (sampled.logprob_token_ids.tolist(), sampled.logprobs.tolist(),
            sampled.sampled_ranks.tolist())


def _logprobs_for(rows, i: int, wanted: int | None) -> SampledLogprobs | None:
    if rows is None or wanted is None:
        return None
    ids, lps, ranks = rows
    return SampledLogprobs(token_ids=ids[i][:wanted + 1], logprobs=lps[i][:wanted + 1],
                           sampled_rank=ranks[i])


def _dummy_sampling_metadata(num_rows: int, device: torch.device) -> SamplingMetadata:
    """Random sampling with top-k/top-p over every row: the sampler's heaviest path."""
    return SamplingMetadata(
        temperature=torch.ones(num_rows, device=device), all_greedy=False, all_random=True,
        top_k=torch.full((num_rows,), 50, dtype=torch.int64, device=device),
        top_p=torch.full((num_rows,), 0.9, device=device), min_p=None)
