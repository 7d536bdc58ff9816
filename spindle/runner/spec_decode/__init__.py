"""Speculative decoding inside the runner.

A Proposer guesses the next tokens of each request after a step samples; the
scheduler schedules them as extra tokens of that request's next step, whose one
forward computes the target's distribution at every draft position, and
verify_drafts (rejection.py) keeps the longest prefix that exact rejection
sampling accepts, plus one token drawn from the target. The scheduler sees
speculation only as "k extra slots for this request".

Proposers: ngram (prompt lookup in the request's own tokens) and draft_model (a
smaller checkpoint with its own KV cache, indexed by the target's block tables).
An EAGLE or MTP head is one more Proposer: after_forward sees the target's hidden
states, propose returns the drafts.
"""

from __future__ import annotations

from spindle.runner.spec_decode.base import Proposal, Proposer
from spindle.runner.spec_decode.rejection import verify_drafts


def make_proposer(config, runner) -> Proposer:
    """The proposer of config.speculative (a SpeculativeConfig) for runner."""
    method = config.speculative.method
    if method == "ngram":
        from spindle.runner.spec_decode.ngram import NgramProposer

        return NgramProposer(config.speculative, runner)
    if method == "draft_model":
        from spindle.runner.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config.speculative, runner)
    raise ValueError(f"unknown speculative decoding method {method!r}")


__all__ = ["Proposal", "Proposer", "make_proposer", "verify_drafts"]
