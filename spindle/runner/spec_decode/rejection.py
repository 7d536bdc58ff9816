"""Exact verification of draft tokens (speculative sampling, Leviathan et al. 2023).

The rows of one step: for a request verifying d drafts, d + 1 consecutive rows;
row j holds the target's distribution p_j after its j-th draft prefix, its draft
d_j (row d holds -1: it is the bonus position). Going along a request's rows:

  * a greedy row accepts d_j iff d_j is the argmax of p_j, and emits the argmax;
  * a draft drawn from q_j is accepted with probability min(1, p_j(d_j) / q_j(d_j));
    on rejection the row emits a draw from the normalised residual max(p_j - q_j, 0);
  * a draft without q (a lookup, or a greedy draft: q is one-hot on it) is accepted
    iff a draw s_j ~ p_j equals it, and the row emits s_j. This is the rule above
    with q one-hot: acceptance has probability p_j(d_j), and given rejection s_j is
    distributed as p_j without d_j, renormalised: the residual.
  * a request's rows emit until the first rejection, which still emits its token;
    when every draft is accepted the bonus row emits its draw from p_d.

So the tokens emitted are distributed exactly as tokens drawn one by one from the
target. Everything stays on the device: no host sync.
"""

from __future__ import annotations

import torch

from spindle.runner.sample.metadata import SamplingMetadata
from spindle.runner.sample.sampler import GREEDY_TEMPERATURE_EPS, exponential_race


def verify_drafts(sampled: torch.Tensor, drawn_from: torch.Tensor, metadata: SamplingMetadata,
                  draft_token_ids: torch.Tensor, first_row: torch.Tensor,
                  draft_probs: torch.Tensor | None = None,
                  has_draft_probs: torch.Tensor | None = None) -> torch.Tensor:
    """[R] tokens each row emits, -1 for rows after a request's first rejection.

    sampled [R]: the sampler's draw per row from drawn_from [R, V] (the argmax for a
    greedy row); draft_token_ids [R] int64 (-1 on bonus rows); first_row [R]: the
    index of the first row of the row's request; draft_probs [R, V]: q of the rows
    where has_draft_probs [R] (bool) is set.
    """
    is_draft = draft_token_ids >= 0
    accepted = is_draft & (sampled == draft_token_ids)
    emitted = sampled
    if draft_probs is not None:
        greedy = metadata.temperature < GREEDY_TEMPERATURE_EPS
        weighed = has_draft_probs & is_draft & ~greedy
        accepted_q, residual_token = _weigh_drafts(drawn_from, draft_token_ids.clamp(min=0),
                                                   draft_probs, metadata.generators)
        accepted = torch.where(weighed, accepted_q, accepted)
        emitted = torch.where(weighed, torch.where(accepted_q, draft_token_ids, residual_token),
                              emitted)
    return torch.where(_before_first_rejection(~accepted, first_row), emitted, -1)


def _weigh_drafts(drawn_from: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor,
                  generators: dict[int, torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: whether u * q(d) < p(d) for u ~ U[0, 1) (acceptance with probability
    min(1, p/q)), and a draw from the normalised max(p - q, 0)."""
    p = drawn_from.softmax(dim=-1)
    p_draft = p.gather(1, drafts.unsqueeze(1)).squeeze(1)
    q_draft = draft_probs.gather(1, drafts.unsqueeze(1)).squeeze(1)
    uniform = torch.empty_like(p_draft)
    if len(generators) < uniform.shape[0]:
        uniform.uniform_()
    for row, generator in generators.items():
        uniform[row:row + 1].uniform_(generator=generator)
    accepted = uniform * q_draft < p_draft
    residual = (p - draft_probs).clamp(min=0)
    # A residual of all zeros (p == q on a row) is never reached by a rejection; p
    # keeps the draw well defined there.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    return accepted, exponential_race(residual, generators)


def _before_first_rejection(rejected: torch.Tensor, first_row: torch.Tensor) -> torch.Tensor:
    """[R] bool: no row of the same request before this one rejected."""
    counts = rejected.to(torch.int64).cumsum(0)
    before = counts - rejected.to(torch.int64)  # rejections strictly before each row
    return before == before[first_row]
