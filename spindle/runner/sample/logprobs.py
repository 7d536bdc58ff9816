"""Logprobs of the sampled token and of the top-k tokens.

By default they describe the model, not the sampling: they are taken from the raw
logits, before penalties, temperature and filters, so they do not change with a
request's sampling knobs. With logprobs_mode="processed_logprobs" the sampler takes
them from the logits the token was drawn from instead (see sampler.py).
"""

from __future__ import annotations

import torch


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] float32 log-softmax of the raw logits."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_ranks(logprobs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[B] int64 rank of token_ids[b] in row b, 1 = best.

    Rank is 1 + the number of tokens with a strictly higher logprob, so tokens tied
    with each other share the best of their ranks (a greedy pick is always rank 1).
    """
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1))
    return (logprobs > token_logprobs).sum(dim=-1) + 1


def gather_logprobs(
    logprobs: torch.Tensor, sampled_token_ids: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids [B, k+1], their logprobs [B, k+1] and the sampled tokens' ranks [B].

    Column 0 is the sampled token, columns 1..k the k most likely tokens, best first
    (order among exact ties is unspecified). k is capped at the vocabulary size.
    """
    if num_logprobs < 0:
        raise ValueError(f"num_logprobs must be >= 0, got {num_logprobs}")
    sampled = sampled_token_ids.to(torch.int64).unsqueeze(1)
    sampled_logprobs = logprobs.gather(1, sampled)
    ranks = token_ranks(logprobs, sampled_token_ids.to(torch.int64))
    k = min(num_logprobs, logprobs.shape[-1])
    if k == 0:
        return sampled, sampled_logprobs, ranks
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    token_ids = torch.cat([sampled, top_ids], dim=1)
    values = torch.cat([sampled_logprobs, top_logprobs], dim=1)
    return token_ids, values, ranks
