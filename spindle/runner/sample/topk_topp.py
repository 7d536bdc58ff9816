"""Batched min-p, top-k and top-p filters with per-row values.

Each filter masks the tokens it drops with -inf and returns a new tensor. Rows
whose value means "off" (min_p 0, top_k 0, top_p 1) are left as they are. No
Python loop over rows or the vocabulary and no host synchronisation.

Top-k and top-p each reduce to a per-row cutoff logit (keep logits >= cutoff),
found on one descending sort of the row. A consequence: tokens tied with the last
kept token are kept too, so ties never make the result depend on sort order.
"""

from __future__ import annotations

import torch


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p * (probability of the best token).

    Done in logit space, where the test is logit < max_logit + log(min_p); this
    needs no softmax, and min_p = 0 gives log(0) = -inf, which drops nothing.
    """
    max_logits = logits.amax(dim=-1, keepdim=True)
    threshold = max_logits + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep the top_k best tokens of each row, then the smallest set of those whose
    cumulative probability (renormalised over what top-k kept) reaches top_p.

    top_k: [B] int64, 0 = off (values above V act as V). top_p: [B] float32, 1.0 = off.
    Either may be None (off for every row).
    """
    if top_k is None and top_p is None:
        return logits
    sorted_logits = logits.sort(dim=-1, descending=True).values
    cutoff = None
    if top_k is not None:
        cutoff = _top_k_cutoff(sorted_logits, top_k)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < cutoff, float("-inf"))
    if top_p is not None:
        top_p_cutoff = _top_p_cutoff(sorted_logits, top_p)
        cutoff = top_p_cutoff if cutoff is None else torch.maximum(cutoff, top_p_cutoff)
    return logits.masked_fill(logits < cutoff, float("-inf"))


def _top_k_cutoff(sorted_logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """[B, 1] logit of the k-th best token (-inf where top-k is off)."""
    vocab = sorted_logits.shape[-1]
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab)).to(torch.int64)
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    return torch.where((top_k <= 0).unsqueeze(1), float("-inf"), kth)


def _top_p_cutoff(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B, 1] logit of the last token of the smallest prefix of the sorted row whose
    probability mass reaches top_p (-inf where top-p is off).

    Token i of the sorted row is kept iff the mass strictly before it is < top_p: the
    first token always is, and the prefix stops right after the mass reaches top_p.
    """
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    num_kept = (mass_before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp(min=1)
    last_kept = sorted_logits.gather(1, num_kept - 1)
    # top_p = 1 must keep everything, even tail tokens that float32 rounding would
    # push past a cumulative mass of 1.
    return torch.where((top_p >= 1.0).unsqueeze(1), float("-inf"), last_kept)
