"""Prompt logprobs: for a request that asks for them (SamplingParams.prompt_logprobs),
the logprob and rank of every prompt token after the first, and the top k, from the
logits at the position before it.

A prefill step computes the hidden states of all its prompt tokens anyway; only the
last one normally reaches the LM head. For these requests the rows of every
scheduled prompt position whose next token is a prompt token go through it too, a
slice of rows at a time (a chunk's full logits would be rows x vocabulary floats),
and are reduced on the device to (ids, logprobs, rank) per row. Chunked prefill
reports each chunk's rows as it goes.
"""

from __future__ import annotations

from typing import Callable

import torch

from spindle.runner.input_batch import CachedRequestState, StepBatch, prompt_logprobs_of
from spindle.runner.sample.logprobs import compute_logprobs, gather_logprobs

# Rows of logits reduced at a time: 1024 x a 152k vocabulary is 0.6 GB in float32.
ROWS_PER_SLICE = 1024


def prompt_rows(batch: StepBatch) -> list[tuple[CachedRequestState, int, int, int, int]]:
    """(request, k, first prompt position p, first hidden row, rows) per request of the
    batch that wants prompt logprobs and computes prompt positions this step whose next
    token is a prompt token; row j is position p + j, scoring the token at p + 1 + j."""
    out = []
    for i, state in enumerate(batch.requests):
        k = prompt_logprobs_of(state)
        if k is None:
            continue
        start = int(batch.num_computed[i])
        end = min(start + int(batch.num_scheduled[i]), state.num_prompt_tokens - 1)
        if start < end:
            out.append((state, k, start, int(batch.query_start_loc[i]), end - start))
    return out


def score_rows(hidden: torch.Tensor, targets: torch.Tensor, k: int,
               compute_logits: Callable[[torch.Tensor], torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For hidden rows [n, H] and the token each row scores (targets [n]): token ids
    [n, k+1] (the target, then the top k), their logprobs [n, k+1] and the targets'
    ranks [n] (1 = best), from the raw logits as the sampler's logprobs are."""
    ids, values, ranks = [], [], []
    for start in range(0, hidden.shape[0], ROWS_PER_SLICE):
        rows = slice(start, start + ROWS_PER_SLICE)
        logprobs = compute_logprobs(compute_logits(hidden[rows]))
        part = gather_logprobs(logprobs, targets[rows], k)
        ids.append(part[0])
        values.append(part[1])
        ranks.append(part[2])
    return torch.cat(ids), torch.cat(values), torch.cat(ranks)
