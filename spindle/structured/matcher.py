"""A byte automaton lifted to a vocabulary's tokens, and one request's place in it.

The runner holds a GrammarMatcher per structured request: before each sampling it
asks which token ids may come next (allowed_ids), and it feeds every sampled token
back (advance). A token is allowed when its bytes lead the automaton to a live state
(one from which a match can still complete: the automata are trimmed); the request's
stop ids are allowed exactly where the output so far is a complete match.

The token-level table is computed a state at a time, when decoding first reaches
that state (one vectorised walk of the whole vocabulary, TokenVocab.walk), and kept.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np

from spindle.structured.regex_dfa import ByteDFA
from spindle.structured.vocab import TokenVocab

logger = logging.getLogger(__name__)

# States whose token table a TokenAutomaton keeps (a string's inside allows most of a
# vocabulary: up to about 1 MB a state for 150k tokens).
MAX_CACHED_STATES = 1024
_NO_IDS = np.zeros(0, dtype=np.int64)


class TokenAutomaton:
    """The tokens that continue a match from each state of a byte automaton."""

    def __init__(self, dfa: ByteDFA, vocab: TokenVocab) -> None:
        self.dfa = dfa
        self.vocab = vocab
        self._tables: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def table(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        """(token ids allowed from state, ascending; the state each leads to)."""
        table = self._tables.get(state)
        if table is not None:
            self._tables.move_to_end(state)
            return table
        ends = self.vocab.walk(self.dfa.transitions, self.dfa.byte_classes, state)
        live = ends >= 0
        ids, ends = self.vocab.token_ids[live], ends[live]
        order = np.argsort(ids)
        table = (ids[order], ends[order])
        self._tables[state] = table
        if len(self._tables) > MAX_CACHED_STATES:
            self._tables.popitem(last=False)
        return table

    def next_state(self, state: int, token_id: int) -> int:
        """The state token_id leads to from state (-1: not allowed there)."""
        ids, ends = self.table(state)
        i = int(np.searchsorted(ids, token_id))
        return int(ends[i]) if i < len(ids) and ids[i] == token_id else -1


class GrammarMatcher:
    """One request's state in a TokenAutomaton."""

    def __init__(self, automaton: TokenAutomaton, stop_ids: set[int], req_id: str) -> None:
        self.automaton = automaton
        self.stop_ids = np.array(sorted(stop_ids), dtype=np.int64)
        self.req_id = req_id
        self.state = automaton.dfa.start
        self.finished = False  # a stop token was sampled

    def advance(self, token_id: int) -> None:
        if self.finished:
            return
        if token_id in self.stop_ids:
            self.finished = True
        elif self.state >= 0:
            self.state = self.automaton.next_state(self.state, token_id)
            if self.state < 0:
                logger.warning("request %s: token %d does not continue its structured "
                               "output; only its stop tokens are allowed from here",
                               self.req_id, token_id)

    def state_after(self, token_ids: list[int]) -> int:
        """The state after token_ids from the current one (-1 once one is not allowed):
        where a draft token's row of a verifying step stands."""
        state = self.state
        for token_id in token_ids:
            if state < 0:
                break
            state = self.automaton.next_state(state, token_id)
        return state

    def allowed_ids(self, state: int | None = None) -> np.ndarray:
        """The token ids that may be sampled from state (the current one by default)."""
        state = self.state if state is None else state
        if state < 0:
            return self.stop_ids
        ids, _ = self.automaton.table(state)
        if self.automaton.dfa.is_accepting(state):
            ids = np.union1d(ids, self.stop_ids)
        if len(ids) == 0:
            logger.warning("request %s: no token of the vocabulary continues its structured "
                           "output; only its stop tokens are allowed", self.req_id)
            return self.stop_ids
        return ids
