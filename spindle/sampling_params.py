"""Per-request sampling parameters, validated once when a request is made.

The field names and defaults follow vLLM's SamplingParams so users can switch
engines without relearning; every bad value raises ValueError naming the field.
"""

from __future__ import annotations

import copy
import json
import numbers
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5

# The seeds torch.Generator.manual_seed takes: a negative seed s stands for s + 2**64.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


@dataclass
class StructuredOutputsParams:
    """What a request's output must be (structured outputs): exactly one of

    json: a JSON schema (a dict, or its JSON text): the output is a JSON document
        that satisfies it;
    regex: the whole output matches this regular expression;
    choice: the output is one of these strings;
    json_object: True: the output is a JSON object (any keys; containers nested at most
        structured/json_schema.py's DEFAULT_MAX_DEPTH deep).

    The names follow vLLM's. Decoding forbids, at every step, each token that cannot
    continue a match, and allows the end-of-sequence token only where the output is
    complete."""

    json: dict | str | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        self.validate()

    def validate(self) -> None:
        given = [name for name in ("json", "regex", "choice") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams takes exactly one of json, regex, "
                             f"choice, json_object; got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from e
        elif self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("StructuredOutputsParams.json must be a JSON schema (a dict or "
                             f"its JSON text), got {type(self.json).__name__}")
        elif isinstance(self.json, dict):
            try:
                json.dumps(self.json)
            except (TypeError, ValueError) as e:
                raise ValueError(f"StructuredOutputsParams.json is no JSON data: {e}") from e
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"StructuredOutputsParams.regex must be a string, got "
                             f"{type(self.regex).__name__}")
        if self.choice is not None and not (
                isinstance(self.choice, list) and self.choice
                and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("StructuredOutputsParams.choice must be a non-empty list of "
                             f"non-empty strings, got {self.choice!r}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"StructuredOutputsParams.json_object must be a bool, got "
                             f"{self.json_object!r}")

    @property
    def key(self) -> str:
        """A canonical text of what is asked (the compiled automata's cache key)."""
        schema = json.loads(self.json) if isinstance(self.json, str) else self.json
        return json.dumps([schema, self.regex, self.choice, bool(self.json_object)],
                          sort_keys=True)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token; k: plus the top k
    # Per prompt token after the first: None: none; 0: its logprob; k: plus the top k
    # (RequestOutput.prompt_logprobs). Such a request computes its whole prompt: it
    # takes no prefix-cache hits.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Only these token ids may be sampled (None: any); logprobs stay the raw model's.
    allowed_token_ids: list[int] | None = None
    # Added to these token ids' logits before penalties and sampling, in [-100, 100]
    # (OpenAI's logit_bias); logprobs stay the raw model's unless the engine's
    # logprobs_mode says otherwise.
    logit_bias: dict[int, float] | None = None
    # The output must be a JSON document of a schema, match a regex, or be one of a few
    # strings (StructuredOutputsParams); None: free text.
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine, not the user: every id that ends generation, and the byte
    # automaton of structured_outputs (spindle/structured/).
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    _grammar: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None and isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self.validate()
        self._all_stop_token_ids = set(self.stop_token_ids)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field. Run at construction, and again
        by the engine when a request is added (the fields may change in between)."""
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(_is_real(self.temperature) and self.temperature >= 0.0, "temperature",
               self.temperature, "a number >= 0")
        _check(_is_real(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", self.top_p,
               "a number in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k,
               "0 or -1 (disabled) or a positive integer")
        _check(_is_real(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", self.min_p,
               "a number in [0, 1]")
        _check(_is_real(self.repetition_penalty) and self.repetition_penalty > 0.0,
               "repetition_penalty", self.repetition_penalty, "a number > 0")
        _check(_is_real(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
               "frequency_penalty", self.frequency_penalty, "a number in [-2, 2]")
        _check(_is_real(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
               "presence_penalty", self.presence_penalty, "a number in [-2, 2]")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "None or an integer >= 1")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
               self.min_tokens, "an integer >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        _check(self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
               "logprobs", self.logprobs, "None or an integer >= 0")
        _check(self.prompt_logprobs is None
               or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
               "prompt_logprobs", self.prompt_logprobs, "None or an integer >= 0")
        _check(isinstance(self.stop, (list, tuple))
               and all(isinstance(s, str) and s for s in self.stop),
               "stop", self.stop, "a list of non-empty strings")
        _check(isinstance(self.stop_token_ids, (list, tuple))
               and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
        _check(self.allowed_token_ids is None or (
            isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
            and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)),
            "allowed_token_ids", self.allowed_token_ids,
            "None or a non-empty list of non-negative token ids")
        _check(self.logit_bias is None or (
            isinstance(self.logit_bias, dict)
            and all(_is_int(t) and t >= 0 for t in self.logit_bias)
            and all(_is_real(b) and -100.0 <= b <= 100.0 for b in self.logit_bias.values())),
            "logit_bias", self.logit_bias,
            "None or a dict of non-negative token ids to numbers in [-100, 100]")
        _check(self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
               "seed", self.seed, "None or an integer in [-2**63, 2**64 - 1] (the seeds "
               "torch.Generator takes)")
        if self.structured_outputs is not None:
            self._validate_structured_outputs()

    def _validate_structured_outputs(self) -> None:
        """Structured outputs end where their automaton completes, with an end token:
        nothing may forbid or ignore that token, nor restrict the ids another way."""
        _check(isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs, "a StructuredOutputsParams")
        self.structured_outputs.validate()
        for name, value, neutral in (("ignore_eos", self.ignore_eos, False),
                                     ("min_tokens", self.min_tokens, 0),
                                     ("allowed_token_ids", self.allowed_token_ids, None)):
            if value != neutral:
                raise ValueError(f"SamplingParams.{name} cannot be combined with "
                                 f"structured_outputs (got {name}={value!r})")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_holdback(self) -> int:
        """How many trailing characters of a running sample's text could still be the
        start of a stop string: what streaming holds back until the sample moves on."""
        return max((len(s) for s in self.stop), default=1) - 1

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    def with_eos(self, eos_token_ids: set[int]) -> "SamplingParams":
        """A copy whose stop set also holds the model's EOS ids (unless ignore_eos)."""
        params = copy.copy(self)
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids |= set(eos_token_ids)
        params._all_stop_token_ids = ids
        return params

    def for_child(self, index: int) -> "SamplingParams":
        """Parameters of the index-th of n samples: n=1, and a distinct seed if one was
        set (seed + index, wrapping around past SEED_MAX, so it stays a seed torch takes).
        The samples share their prompt: only the first computes its prompt logprobs."""
        params = copy.copy(self)
        params.n = 1
        if index > 0:
            params.prompt_logprobs = None
        if self.seed is not None:
            params.seed = _wrap_seed(int(self.seed) + index)
        return params


def _wrap_seed(seed: int) -> int:
    return seed - 2**64 if seed > SEED_MAX else seed


def _is_int(value: object) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """A real number (numpy's too), not a bool. NaN passes here and fails every range
    check after."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {allowed}, got {value!r}")
