"""Turns the core's per-step token outputs into user-facing RequestOutputs.

It owns detokenization (incremental), stop strings (which the core cannot see,
since it never handles text), logprob formatting and the folding of n > 1
samples back into one RequestOutput per user request. A request fails alone
(RequestOutput.error) when one of its samples failed in the core, or here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from spindle.engine.detokenizer import IncrementalDetokenizer
from spindle.engine.pooling_output import PoolingOutputs
from spindle.outputs import CompletionOutput, Logprob, RequestFailure, RequestOutput
from spindle.sampling_params import SamplingParams
from spindle.step_messages import EngineCoreOutput, SampledLogprobs

logger = logging.getLogger(__name__)


@dataclass
class _SampleState:
    """One of the n samples of a user request (one core request)."""

    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def completion(self) -> CompletionOutput:
        return CompletionOutput(index=self.index, text=self.detokenizer.output_text,
                                token_ids=list(self.token_ids),
                                cumulative_logprob=self.cumulative_logprob,
                                logprobs=self.logprobs, finish_reason=self.finish_reason,
                                stop_reason=self.stop_reason)


@dataclass
class _UserRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: dict[str, _SampleState]  # core request id -> sample
    final_only: bool = False  # report only the finished output (offline batches)
    error: RequestFailure | None = None  # set when one of its samples failed
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int | None = None  # (its first sample's)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples.values())

    def output(self) -> RequestOutput:
        ordered = sorted(self.samples.values(), key=lambda s: s.index)
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids,
                             outputs=[s.completion() for s in ordered], finished=self.finished,
                             error=self.error, prompt_logprobs=self.prompt_logprobs,
                             num_cached_tokens=self.num_cached_tokens)

    def fail(self, core_id: str, failure: RequestFailure) -> None:
        """The sample core_id failed: so does the request; its other samples end too."""
        self.error = failure
        for sample_id, sample in self.samples.items():
            if sample.finish_reason is None:
                sample.finish_reason = "error" if sample_id == core_id else "abort"


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._users: dict[str, _UserRequest] = {}
        self._core_to_user: dict[str, str] = {}
        self.pooling = PoolingOutputs()  # embedding requests (engine/pooling_output.py)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    core_params: dict[str, SamplingParams], final_only: bool = False) -> None:
        """Track a user request whose n samples run as core requests core_params.keys()."""
        samples = {}
        for index, (core_id, params) in enumerate(core_params.items()):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params,
                                           text_at_end=final_only)
            samples[core_id] = _SampleState(
                index=index, params=params, detokenizer=detok,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None)
            self._core_to_user[core_id] = request_id
        self._users[request_id] = _UserRequest(request_id, prompt, list(prompt_token_ids), samples,
                                               final_only)

    def add_pooling_request(self, request_id: str, prompt: str | None,
                            prompt_token_ids: list[int]) -> None:
        """Track an embedding request (one core request with the same id)."""
        self.pooling.add(request_id, prompt, prompt_token_ids)

    def has_unfinished(self) -> bool:
        return bool(self._users) or bool(self.pooling)

    def core_request_ids(self, request_id: str) -> list[str]:
        if request_id in self.pooling:
            return [request_id]
        user = self._users.get(request_id)
        return list(user.samples) if user else []

    def process(self, outputs: list[EngineCoreOutput]
                ) -> tuple[list[RequestOutput], list[str], list[str]]:
        """Apply one step's outputs. Returns the updated user requests' outputs (an
        EmbeddingRequestOutput for each finished pooling request), the core request
        ids that hit a stop string (the core must finish them), and the core request
        ids of requests that failed (the core must abort those still running)."""
        touched: dict[str, _UserRequest] = {}
        ended: set[str] = set()  # users with a sample that ended this step
        stopped_by_string: list[str] = []
        failed: list[str] = []
        pooled = []
        pooling = bool(self.pooling)
        for out in outputs:
            if pooling and out.req_id in self.pooling:
                pooled.append(self.pooling.finish(out))
                continue
            user_id = self._core_to_user.get(out.req_id)
            if user_id is None:
                continue  # aborted by the user meanwhile
            user = self._users[user_id]
            sample = user.samples[out.req_id]
            if sample.finish_reason is not None:
                continue
            failure = out.error if out.finish_reason == "error" else None
            if out.num_cached_tokens is not None and sample.index == 0:
                user.num_cached_tokens = out.num_cached_tokens
            if failure is None:
                try:
                    if out.prompt_logprobs is not None:
                        user.prompt_logprobs = [None] + [self._logprob_entry(lp)
                                                         for lp in out.prompt_logprobs]
                    if self._apply(sample, out):
                        stopped_by_string.append(out.req_id)
                except Exception as e:  # this sample's text, stop strings or logprobs
                    logger.exception("request %r failed alone in its output processing",
                                     user_id)
                    failure = RequestFailure(f"{type(e).__name__}: {e}", bad_request=False)
            if failure is not None:
                user.fail(out.req_id, failure)
                failed.extend(user.samples)
            touched[user_id] = user
            if sample.finish_reason is not None:
                ended.add(user_id)
        results: list = [p for p in pooled if p is not None]
        for user_id, user in touched.items():
            if user_id in ended and user.finished:
                results.append(user.output())
                self._forget(user)
            elif not user.final_only:
                results.append(user.output())
        return results, stopped_by_string, failed

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a user request with reason 'abort'; returns its final output."""
        if request_id in self.pooling:
            return self.pooling.abort(request_id)
        user = self._users.get(request_id)
        if user is None:
            return None
        for sample in user.samples.values():
            if sample.finish_reason is None:
                sample.finish_reason = "abort"
        result = user.output()
        self._forget(user)
        return result

    def _apply(self, sample: _SampleState, out: EngineCoreOutput) -> bool:
        for i, token in enumerate(out.new_token_ids):
            sample.token_ids.append(token)
            if i < len(out.new_logprobs) and sample.logprobs is not None:
                self._add_logprobs(sample, out.new_logprobs[i])
            stop = sample.detokenizer.add_token(token)
            if stop is not None:
                sample.finish_reason, sample.stop_reason = "stop", stop
                return True
        if out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            sample.detokenizer.finish()
        return False

    def _add_logprobs(self, sample: _SampleState, lp: SampledLogprobs) -> None:
        sample.logprobs.append(self._logprob_entry(lp))
        sample.cumulative_logprob += lp.logprobs[0]

    def _logprob_entry(self, lp: SampledLogprobs) -> dict[int, Logprob]:
        """{token: Logprob} for one position: its token first, then the top k."""
        entry: dict[int, Logprob] = {}
        for j, (tok, value) in enumerate(zip(lp.token_ids, lp.logprobs)):
            rank = lp.sampled_rank if j == 0 else j
            if tok not in entry:
                entry[tok] = Logprob(logprob=value, rank=rank,
                                     decoded_token=self.tokenizer.decode([tok]))
        return entry

    def _forget(self, user: _UserRequest) -> None:
        self._users.pop(user.request_id, None)
        for core_id in user.samples:
            self._core_to_user.pop(core_id, None)
