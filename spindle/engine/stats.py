"""What the engine reports for monitoring: a snapshot of its state after each loop
iteration, and the request timings that iteration produced.

Pure data and bookkeeping, filled on the engine thread; exporters (Prometheus in
entrypoints/openai/metrics.py) implement StatLogger and never touch the engine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from spindle.engine.llm_engine import LLMEngine
    from spindle.outputs import RequestOutput


logger = logging.getLogger(__name__)


@dataclass
class SpecDecodeStats:
    """Speculative decoding since start: steps that verified drafts, the drafts they
    verified, and how many were accepted (in total and by position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_by_position) < num_draft_tokens:
            self.accepted_by_position += [0] * (num_draft_tokens - len(self.accepted_by_position))
        for position in range(num_accepted):
            self.accepted_by_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / verified drafts (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying step yields on average: its accepted drafts and one more."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self) -> "SpecDecodeStats":
        return replace(self, accepted_by_position=list(self.accepted_by_position))

    def summary(self) -> str:
        return (f"speculative decoding: {self.acceptance_rate:.1%} of {self.num_draft_tokens} "
                f"drafts accepted, {self.mean_accepted_length:.2f} tokens per verifying step")


@dataclass(frozen=True)
class LoRAStats:
    """The adapters of the scheduler's requests (vLLM's lora_requests_info)."""
    running: tuple[str, ...]  # the running requests' adapters, by name, sorted
    waiting: tuple[str, ...]  # the waiting requests' ones
    max_loras: int

    @classmethod
    def of(cls, scheduler) -> "LoRAStats":
        def names(requests) -> tuple[str, ...]:
            return tuple(sorted({r.lora_request.lora_name for r in requests
                                 if r.lora_request is not None}))

        return cls(names(scheduler.running), names(scheduler.waiting),
                   scheduler.scheduler_config.max_loras)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int  # in the scheduler's waiting queue
    num_held: int  # accepted while paused; they reach the scheduler on resume
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    pause_mode: str | None = None
    sleep_level: int | None = None
    spec_decode: SpecDecodeStats | None = None  # None without speculative decoding
    lora: LoRAStats | None = None  # None where no adapters are served

    @property
    def num_in_flight(self) -> int:
        """Requests the scheduler owns (what a pause in mode "wait" waits for)."""
        return self.num_running + self.num_waiting

    @classmethod
    def collect(cls, engine: "LLMEngine") -> "EngineStats":
        core = engine.core
        gate = core.gate
        return cls(num_running=core.scheduler.num_running, num_waiting=core.scheduler.num_waiting,
                   num_held=len(gate.held), kv_cache_usage=core.scheduler.kv_cache_usage,
                   pause_mode=gate.pause_mode.value if gate.pause_mode else None,
                   sleep_level=gate.sleep_level,
                   spec_decode=(core.scheduler.spec_decode_stats.copy()
                                if core.scheduler.speculative_config is not None else None),
                   lora=(LoRAStats.of(core.scheduler)
                         if core.scheduler.scheduler_config.max_loras else None))


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float  # seconds from arrival to the last output
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """Everything one engine-loop iteration produced (a step and/or commands)."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.num_prompt_tokens or self.num_generation_tokens or self.finished)


class RequestTimer:
    """Times one request from its arrival through the cumulative outputs it gets."""

    def __init__(self, arrival_time: float) -> None:
        self.arrival_time = arrival_time
        self.last_token_time: float | None = None
        self.num_tokens = 0

    def observe(self, output: "RequestOutput", now: float, stats: IterationStats) -> None:
        # An EmbeddingRequestOutput has no completions (and one final output).
        completions = output.outputs if isinstance(output.outputs, list) else []
        num_tokens = sum(len(c.token_ids) for c in completions)
        new_tokens = num_tokens - self.num_tokens
        if new_tokens > 0:
            if self.last_token_time is None:
                stats.time_to_first_tokens.append(now - self.arrival_time)
                # Counted once the prefill is done: an aborted prompt was never computed.
                stats.num_prompt_tokens += len(output.prompt_token_ids)
            else:
                stats.inter_token_latencies.append(now - self.last_token_time)
            stats.num_generation_tokens += new_tokens
            self.num_tokens, self.last_token_time = num_tokens, now
        if output.finished:
            # n > 1 samples may end differently: an abort marks the whole request.
            reasons = ([c.finish_reason or "abort" for c in completions]
                       or [getattr(output, "finish_reason", None) or "abort"])
            reason = "abort" if "abort" in reasons else reasons[0]
            stats.finished.append(FinishedRequestStats(
                finish_reason=reason, e2e_latency=now - self.arrival_time,
                num_prompt_tokens=len(output.prompt_token_ids), num_generation_tokens=num_tokens))


class StatLogger(Protocol):
    def record(self, stats: EngineStats, iteration: IterationStats) -> None:
        """Called on the engine thread after every loop iteration; must be quick."""


class LoggingStatLogger:
    """Logs a line of engine state every interval_s seconds while tokens flow: load,
    throughput since the last line, and speculative decoding's acceptance."""

    def __init__(self, interval_s: float = 10.0, model_name: str | None = None) -> None:
        self.interval_s = interval_s
        self._prefix = f"{model_name}: " if model_name else ""  # (a server of several models)
        self._last = time.monotonic()
        self._prompt_tokens = self._generation_tokens = 0

    def record(self, stats: EngineStats, iteration: IterationStats) -> None:
        self._prompt_tokens += iteration.num_prompt_tokens
        self._generation_tokens += iteration.num_generation_tokens
        now = time.monotonic()
        if now - self._last < self.interval_s or not (self._prompt_tokens
                                                       or self._generation_tokens):
            return
        elapsed, self._last = now - self._last, now
        waiting = stats.num_waiting + stats.num_held
        line = (f"{self._prefix}{stats.num_running} running, {waiting} waiting, "
                f"KV cache {stats.kv_cache_usage:.1%}; prompt {self._prompt_tokens / elapsed:.1f} "
                f"tok/s, generation {self._generation_tokens / elapsed:.1f} tok/s")
        if stats.spec_decode is not None:
            line += "; " + stats.spec_decode.summary()
        logger.info(line)
        self._prompt_tokens = self._generation_tokens = 0
