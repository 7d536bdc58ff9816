"""From a request's StructuredOutputsParams to the byte automaton its decoding follows.

The engine compiles when a request is added, so a bad schema or regex fails that
request alone, with a message naming the problem, before anything reaches a worker.
Compiled automata are kept by what was asked (GrammarCompiler's LRU): a server sees
the same schema many times.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

from spindle.sampling_params import StructuredOutputsParams
from spindle.structured.json_schema import any_json_object_regex, choice_regex, schema_to_regex
from spindle.structured.regex_dfa import ByteDFA, compile_regex


def grammar_regex(params: StructuredOutputsParams) -> str:
    """The regular expression the output must match in full."""
    if params.regex is not None:
        return params.regex
    if params.choice is not None:
        return choice_regex(params.choice)
    if params.json_object:
        return any_json_object_regex()
    schema = json.loads(params.json) if isinstance(params.json, str) else params.json
    return schema_to_regex(schema)


class GrammarCompiler:
    """Compiles StructuredOutputsParams into ByteDFAs, keeping the last `capacity`.
    Thread-safe: AsyncLLM compiles in its tokenizer threads, off the engine's."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._compiled: OrderedDict[str, ByteDFA] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> ByteDFA:
        """The automaton of params; ValueError naming what cannot be compiled."""
        key = params.key
        with self._lock:
            dfa = self._compiled.get(key)
            if dfa is not None:
                self._compiled.move_to_end(key)
                return dfa
        try:
            dfa = compile_regex(grammar_regex(params))
        except ValueError as e:
            raise ValueError(f"structured_outputs: {e}") from e
        with self._lock:
            self._compiled[key] = dfa
            if len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return dfa
