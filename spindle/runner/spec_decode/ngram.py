"""Prompt lookup: the drafts continue the latest earlier occurrence of the request's
last n tokens in its own tokens (prompt and outputs), trying the longest n first."""

from __future__ import annotations

import numpy as np

from spindle.runner.spec_decode.base import Proposal, Proposer


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the last n tokens of
    tokens, for the largest n in [min_n, max_n] that has one; [] when none does.

    Every match ends at an earlier occurrence of the last token, so only those
    places are compared further back (one pass over the tokens, then a few)."""
    length = len(tokens)
    max_n = min(max_n, length - 1)
    if max_n < min_n:
        return []
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
    if not ends.size:
        return []
    # How many tokens before and at each end agree with the suffix, up to max_n.
    matched = np.ones(ends.size, dtype=np.int64)
    agreeing = np.ones(ends.size, dtype=bool)
    for back in range(1, max_n):
        before = ends - back
        agreeing &= before >= 0
        agreeing &= tokens[np.maximum(before, 0)] == tokens[length - 1 - back]
        if not agreeing.any():
            break
        matched += agreeing
    for n in range(max_n, min_n - 1, -1):
        found = np.flatnonzero(matched >= n)
        if found.size:
            start = int(ends[found[-1]]) + 1
            return tokens[start:start + k].tolist()
    return []


def extended_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """ngram_lookup, repeated on the tokens followed by the drafts found so far while
    a match ends before k drafts (a match near the end has a short continuation)."""
    drafts: list[int] = []
    while len(drafts) < k:
        more = ngram_lookup(tokens, min_n, max_n, k - len(drafts))
        if not more:
            break
        drafts += more
        tokens = np.concatenate([tokens, np.asarray(more, dtype=tokens.dtype)])
    return drafts


class NgramProposer(Proposer):
    def propose(self, req_ids: list[str]) -> dict[str, Proposal]:
        batch = self.runner.input_batch
        cfg = self.config
        proposals = {}
        for req_id in req_ids:
            state = batch.requests[req_id]
            room = min(self.num_speculative_tokens, batch.max_model_len - state.num_tokens)
            if room <= 0:
                continue
            drafts = extended_lookup(batch.token_ids[state.row, :state.num_tokens],
                                     cfg.prompt_lookup_min, cfg.prompt_lookup_max, room)
            if drafts:
                proposals[req_id] = Proposal(drafts)
        return proposals
