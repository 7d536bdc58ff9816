"""Prompt lookup: the drafts continue the latest earlier occurrence of the request's
last n tokens in its own tokens (prompt and outputs), trying the longest n first."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from spindle.runner.spec_decode.base import Proposal, Proposer


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the last n tokens of
    tokens, for the largest n in [min_n, max_n] that has one; [] when none does."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # Windows starting at 0 .. length - n - 1: every occurrence before the suffix
        # itself, each with at least one token after it.
        windows = sliding_window_view(tokens[:length - 1], n)
        matches = np.flatnonzero((windows == suffix).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n
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
