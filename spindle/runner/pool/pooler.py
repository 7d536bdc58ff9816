"""The pooler: a step's hidden states -> one embedding per pooling request.

Each request that pools this step has its whole prompt in the step (the scheduler
never chunks a pooling request), packed at query_start_loc[i]:query_start_loc[i+1].
Mean, CLS (first token) and last-token pooling are segment operations over that
packed layout: no padding, no per-token Python loop. Pooled vectors are computed in
float32 and come back as Python lists, cheap to pickle across a process boundary.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from spindle.pooler_config import PoolerConfig
from spindle.runner.input_batch import CachedRequestState, StepBatch


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.config = config

    def __call__(self, hidden: torch.Tensor, batch: StepBatch) -> list[list[float] | None]:
        """Per request of batch, in order: its embedding, or None if it does not pool
        this step (it has not reached the end of its prompt)."""
        pooling = np.flatnonzero(batch.sampling_mask)
        if len(pooling) == 0:
            return [None] * batch.num_reqs
        _check_whole_prompts(batch, pooling)
        starts = batch.query_start_loc[:-1][pooling]
        lens = batch.num_scheduled[pooling]
        normalize = [self._normalize(batch.requests[i]) for i in pooling]
        pooled = pool_hidden_states(hidden, starts, lens, self.config.pooling_type, normalize)
        rows = pooled.cpu().tolist()
        out: list[list[float] | None] = [None] * batch.num_reqs
        for i, row in zip(pooling.tolist(), rows):
            out[i] = row
        return out

    def dummy_run(self, hidden: torch.Tensor, num_reqs: int) -> None:
        """Pool num_reqs equal slices of hidden (the profiling run's peak)."""
        per_req = max(1, hidden.shape[0] // num_reqs)
        starts = np.arange(num_reqs) * per_req
        pool_hidden_states(hidden, starts, np.full(num_reqs, per_req), self.config.pooling_type,
                           [self.config.normalize] * num_reqs)

    def _normalize(self, request: CachedRequestState) -> bool:
        params = request.pooling_params
        if params is not None and params.normalize is not None:
            return params.normalize
        return self.config.normalize


def pool_hidden_states(hidden: torch.Tensor, starts: Any, lens: Any, pooling_type: str,
                       normalize: list[bool]) -> torch.Tensor:
    """[T, H] packed states, segment starts/lengths ([N] each) -> [N, H] float32."""
    device = hidden.device
    starts_t = torch.as_tensor(np.asarray(starts), dtype=torch.int64, device=device)
    lens_t = torch.as_tensor(np.asarray(lens), dtype=torch.int64, device=device)
    if pooling_type == "cls":
        pooled = hidden[starts_t].float()
    elif pooling_type == "last":
        pooled = hidden[starts_t + lens_t - 1].float()
    elif pooling_type == "mean":
        pooled = _segment_mean(hidden, starts_t, lens_t)
    else:
        raise ValueError(f"unknown pooling type {pooling_type!r}")
    if any(normalize):
        mask = torch.tensor(normalize, device=device)[:, None]
        pooled = torch.where(mask, F.normalize(pooled, p=2, dim=-1), pooled)
    return pooled


def _segment_mean(hidden: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Mean of each segment of rows, accumulated in float32."""
    segment = torch.repeat_interleave(torch.arange(len(starts), device=hidden.device), lens)
    rows = torch.repeat_interleave(starts, lens) + _offsets_within(lens)
    sums = torch.zeros(len(starts), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, segment, hidden[rows].float())
    return sums / lens[:, None].to(torch.float32)


def _offsets_within(lens: torch.Tensor) -> torch.Tensor:
    """[0, 1, .., lens[0]-1, 0, 1, .., lens[1]-1, ...]"""
    ends = torch.cumsum(lens, 0)
    total = int(ends[-1]) if len(ends) else 0
    return torch.arange(total, device=lens.device) - torch.repeat_interleave(ends - lens, lens)


def _check_whole_prompts(batch: StepBatch, pooling: np.ndarray) -> None:
    partial = batch.num_computed[pooling] != 0
    if np.any(partial):
        req = batch.req_ids[int(pooling[int(np.argmax(partial))])]
        raise RuntimeError(f"pooling request {req!r} was not scheduled as one whole prompt "
                           "(the scheduler must never chunk or prefix-cache pooling requests)")
