"""Beam search over the engine, as transformers' generate(num_beams=k) searches.

Each step asks the engine for the next-token log-probs of every running beam (one
token each, the top K; the prefix cache serves what the beams share, so a step
computes little more than one token a beam), then keeps transformers' books per
prompt: of the K = max(2, 1 + number of EOS ids) * k best continuations over all
beams, those ending in EOS (or at max_tokens) among the first k join the finished
hypotheses, scored cum_logprob / length ** length_penalty; the k best others run on;
the search ends when no running beam can beat the finished ones (early_stopping:
transformers' False, True or "never" heuristics), no continuation is left, or every
candidate ends. Greedy only: beam search here draws nothing."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

NEG = -1.0e9  # transformers' score of a beam that may not be chosen


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # transformers': False, True or "never"

    def validate(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BeamSearchParams.{name} must be an integer >= 1, "
                                 f"got {value!r}")
        if isinstance(self.length_penalty, bool) \
                or not isinstance(self.length_penalty, (int, float)) \
                or not math.isfinite(self.length_penalty):
            raise ValueError(f"BeamSearchParams.length_penalty must be a finite number, got "
                             f"{self.length_penalty!r}")
        if self.early_stopping not in (False, True, "never"):
            raise ValueError(f"BeamSearchParams.early_stopping must be False, True or "
                             f"'never', got {self.early_stopping!r}")


@dataclass
class BeamSearchSequence:
    token_ids: list[int]  # the generated tokens (an EOS that ended it included)
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty (transformers' score)
    text: str
    finish_reason: str  # "stop" (EOS) or "length" (max_tokens)


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence] = field(default_factory=list)  # best first


@dataclass
class _Finished:
    tokens: list[int]
    score: float
    cum_logprob: float
    real: bool  # (transformers' is_sent_finished: not a placeholder)


class _PromptSearch:
    """One prompt's beams, transformers' bookkeeping (generation/utils.py, _beam_search)."""

    def __init__(self, prompt: list[int], params: BeamSearchParams, eos: frozenset[int]) -> None:
        k = params.beam_width
        self.prompt_len = len(prompt)
        self.params, self.eos = params, eos
        self.keep = max(2, 1 + len(eos)) * k  # (transformers' beams_to_keep)
        self.running: list[tuple[list[int], float]] = \
            [(list(prompt), 0.0)] + [(list(prompt), NEG)] * (k - 1)
        self.finished = [_Finished([], NEG, NEG, False) for _ in range(k)]
        self.unsatisfied = True  # (the early-stop heuristic: improvement still possible)
        self.cur_len = len(prompt)
        self.done = False

    def step(self, next_logprobs: list[dict[int, float]]) -> None:
        """next_logprobs: per running beam, its top next tokens' log-probs."""
        params, k = self.params, self.params.beam_width
        candidates = sorted(((score + lp, b, token) for b, ((_, score), top) in
                             enumerate(zip(self.running, next_logprobs))
                             for token, lp in top.items()), key=lambda c: -c[0])[:self.keep]
        gen_len = self.cur_len + 1 - self.prompt_len
        sequences = [self.running[b][0] + [token] for _, b, token in candidates]
        hits = [token in self.eos or gen_len >= params.max_tokens for _, _, token in candidates]
        running = sorted(((acc + (NEG if hit else 0.0), i) for i, ((acc, _, _), hit)
                          in enumerate(zip(candidates, hits))), key=lambda r: -r[0])[:k]
        self.running = [(sequences[i], score) for score, i in running]
        self._update_finished(candidates, sequences, hits, gen_len)
        self.cur_len += 1
        self._check_early_stop()
        exists_open = not (all(f.real for f in self.finished) and params.early_stopping is True)
        self.done = not (self.unsatisfied and exists_open and not all(hits))

    def _update_finished(self, candidates, sequences, hits, gen_len: int) -> None:
        params, k = self.params, self.params.beam_width
        full = all(f.real for f in self.finished) and params.early_stopping is True
        new = []
        for i, ((acc, _, _), hit) in enumerate(zip(candidates, hits)):
            just_finished = hit and i < k
            score = acc / gen_len ** params.length_penalty
            score += (NEG if full else 0.0) + (0.0 if self.unsatisfied else NEG) \
                + (0.0 if just_finished else NEG)
            new.append(_Finished(sequences[i], score, acc, just_finished))
        self.finished = sorted(self.finished + new, key=lambda f: -f.score)[:k]

    def _check_early_stop(self) -> None:
        params = self.params
        if params.early_stopping == "never" and params.length_penalty > 0.0:
            best_length = params.max_tokens
        else:
            best_length = self.cur_len - self.prompt_len
        best_possible = self.running[0][1] / best_length ** params.length_penalty
        worst = min(f.score for f in self.finished)
        beatable = any(best_possible > (worst if f.real else NEG) for f in self.finished)
        self.unsatisfied = self.unsatisfied and beatable

    def output(self, prompt: list[int], decode) -> BeamSearchOutput:
        sequences = []
        for f in self.finished:
            tokens = f.tokens[self.prompt_len:]
            ended = bool(tokens) and tokens[-1] in self.eos
            sequences.append(BeamSearchSequence(tokens, f.cum_logprob, f.score,
                                                decode(tokens), "stop" if ended else "length"))
        return BeamSearchOutput(list(prompt), sequences)


def check_fits(prompts: list[list[int]], params: BeamSearchParams, max_model_len: int
               ) -> None:
    """ValueError unless every prompt (token ids) and max_tokens fit max_model_len."""
    longest = max(len(t) for t in prompts) + params.max_tokens
    if longest > max_model_len:
        raise ValueError(f"a prompt and max_tokens ({params.max_tokens}) take {longest} "
                         f"tokens, more than max_model_len ({max_model_len})")


def beam_search(llm: Any, prompts: list[list[int]], params: BeamSearchParams,
                eos_token_ids: frozenset[int]) -> list[BeamSearchOutput]:
    """The search for every prompt (token ids), stepping all of them together (params
    validated by the caller, LLM.beam_search)."""
    searches = start_searches(prompts, params, eos_token_ids)
    while beams := running_beams(searches):
        outputs = llm.generate([{"prompt_token_ids": b} for b in beams],
                               step_params(searches), use_tqdm=False)
        advance(searches, [top_logprobs(o) for o in outputs])
    tokenizer = llm.engine.tokenizer
    return outputs_of(searches, prompts,
                      lambda t: tokenizer.decode(t, skip_special_tokens=True))


async def beam_search_async(step, prompts: list[list[int]], params: BeamSearchParams,
                            eos_token_ids: frozenset[int]) -> list[BeamSearchOutput]:
    """The same search over an asynchronous engine (the server's use_beam_search): await
    step(beams, step_params(...)) gives, per beam (token ids), its RequestOutput of one
    token. The sequences' text is left empty, for the caller to decode."""
    searches = start_searches(prompts, params, eos_token_ids)
    while beams := running_beams(searches):
        outputs = await step(beams, step_params(searches))
        advance(searches, [top_logprobs(o) for o in outputs])
    return outputs_of(searches, prompts, lambda tokens: "")


def start_searches(prompts: list[list[int]], params: BeamSearchParams,
                   eos_token_ids: frozenset[int]) -> list[_PromptSearch]:
    eos = frozenset() if params.ignore_eos else eos_token_ids
    return [_PromptSearch(p, params, eos) for p in prompts]


def running_beams(searches: list[_PromptSearch]) -> list[list[int]]:
    """The token ids of every running beam of the searches not done, in order."""
    return [tokens for s in searches if not s.done for tokens, _ in s.running]


def step_params(searches: list[_PromptSearch]):
    """One greedy token with the top-K log-probs (K: the searches' beams_to_keep)."""
    from spindle.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                          logprobs=searches[0].keep)


def top_logprobs(output: Any) -> dict[int, float]:
    """A one-token RequestOutput's top next tokens and their log-probs."""
    return {token: entry.logprob for token, entry in output.outputs[0].logprobs[0].items()}


def advance(searches: list[_PromptSearch], tops: list[dict[int, float]]) -> None:
    """Step every search not done with its beams' share of tops (running_beams' order)."""
    start = 0
    for search in [s for s in searches if not s.done]:
        count = len(search.running)
        search.step(tops[start:start + count])
        start += count


def outputs_of(searches: list[_PromptSearch], prompts: list[list[int]], decode
               ) -> list[BeamSearchOutput]:
    return [s.output(p, decode) for s, p in zip(searches, prompts)]
