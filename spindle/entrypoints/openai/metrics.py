"""Prometheus metrics for GET /metrics, fed by the engine loop (a StatLogger).

Each server gets its own CollectorRegistry, never the process-wide default, so
two servers (or tests) in one process do not collide on metric names.
"""

from __future__ import annotations

import time

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

from spindle.engine.stats import EngineStats, IterationStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0)
_SWAP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 120.0, 240.0, 480.0)


class EngineMetricFamilies:
    """The engine metrics of one registry, labelled by model name: every model of a
    server shares them (a registry takes each metric name once)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        labels = ["model_name"]

        def make(kind, name: str, doc: str, extra: tuple[str, ...] = (), **kwargs):
            return kind(name, doc, [*labels, *extra], registry=registry, **kwargs)

        self.num_running = make(Gauge, "spindle:num_requests_running",
                                "Requests the scheduler is running.")
        self.num_waiting = make(Gauge, "spindle:num_requests_waiting",
                                "Requests waiting to run (queued, or held while paused).")
        self.kv_cache_usage = make(Gauge, "spindle:kv_cache_usage_perc",
                                   "Fraction of KV cache blocks in use (0 to 1).")
        self.lora_info = make(Gauge, "spindle:lora_requests_info",
                              "LoRA adapters of the running and waiting requests (comma-"
                              "separated names) and max_loras; the value is when it was "
                              "recorded (Unix time), as vLLM's lora_requests_info.",
                              ("running_lora_adapters", "waiting_lora_adapters", "max_lora"))
        self.is_paused = make(Gauge, "spindle:engine_paused", "1 while the engine is paused.")
        self.is_sleeping = make(Gauge, "spindle:engine_sleeping", "1 while the engine sleeps.")
        self.prompt_tokens = make(Counter, "spindle:prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = make(Counter, "spindle:generation_tokens",
                                      "Tokens generated.")
        self.ttft = make(Histogram, "spindle:time_to_first_token_seconds",
                         "Seconds from arrival to the first generated token.",
                         buckets=_TTFT_BUCKETS)
        self.itl = make(Histogram, "spindle:inter_token_latency_seconds",
                        "Seconds between two outputs of a request that carry new tokens.",
                        buckets=_ITL_BUCKETS)
        self.e2e = make(Histogram, "spindle:e2e_request_latency_seconds",
                        "Seconds from arrival to the final output.", buckets=_E2E_BUCKETS)
        self.finished = make(Counter, "spindle:request_success", "Requests finished, by reason.",
                             extra=("finished_reason",))
        self.spec_drafts = make(Counter, "spindle:spec_decode_num_drafts",
                                "Steps of a request that verified speculative drafts.")
        self.spec_draft_tokens = make(Counter, "spindle:spec_decode_num_draft_tokens",
                                      "Draft tokens verified.")
        self.spec_accepted_tokens = make(Counter, "spindle:spec_decode_num_accepted_tokens",
                                         "Draft tokens accepted.")
        self.spec_acceptance_rate = make(Gauge, "spindle:spec_decode_acceptance_rate",
                                         "Accepted / verified draft tokens since start.")
        self.spec_mean_accepted_length = make(
            Gauge, "spindle:spec_decode_mean_accepted_length",
            "Tokens per verifying step since start (accepted drafts plus one).")


class PrometheusStatLogger:
    """One model's engine gauges, token counters and latency histograms (its series
    of families, by default families of a registry of its own)."""

    def __init__(self, model_name: str, families: EngineMetricFamilies | None = None) -> None:
        families = families or EngineMetricFamilies(CollectorRegistry())
        self.registry = families.registry
        self._model_name = model_name
        for name, family in vars(families).items():
            if name not in ("registry", "finished", "lora_info"):
                setattr(self, name, family.labels(model_name=model_name))
        self._finished = families.finished
        self._lora_info = families.lora_info
        self._lora_labels: tuple[str, ...] | None = None  # (the series last set)
        self._spec_seen = (0, 0, 0)

    def record(self, stats: EngineStats, iteration: IterationStats) -> None:
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting + stats.num_held)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.is_paused.set(stats.pause_mode is not None)
        self.is_sleeping.set(stats.sleep_level is not None)
        if stats.spec_decode is not None:
            self._record_spec_decode(stats.spec_decode)
        if stats.lora is not None:
            self._record_lora(stats.lora)
        if iteration.is_empty:
            return
        self.prompt_tokens.inc(iteration.num_prompt_tokens)
        self.generation_tokens.inc(iteration.num_generation_tokens)
        for seconds in iteration.time_to_first_tokens:
            self.ttft.observe(seconds)
        for seconds in iteration.inter_token_latencies:
            self.itl.observe(seconds)
        for finished in iteration.finished:
            self.e2e.observe(finished.e2e_latency)
            self._finished.labels(model_name=self._model_name,
                                  finished_reason=finished.finish_reason).inc()

    def _record_lora(self, lora) -> None:
        """One series, its labels the adapters now (the previous series removed)."""
        labels = (self._model_name, ",".join(lora.running), ",".join(lora.waiting),
                  str(lora.max_loras))
        if labels != self._lora_labels:
            if self._lora_labels is not None:
                self._lora_info.remove(*self._lora_labels)
            self._lora_labels = labels
        self._lora_info.labels(*labels).set(time.time())

    def _record_spec_decode(self, spec) -> None:
        totals = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
        if any(now < seen for now, seen in zip(totals, self._spec_seen)):
            self._spec_seen = (0, 0, 0)  # a new engine (a pool restart) counts from zero
        for counter, now, seen in zip((self.spec_drafts, self.spec_draft_tokens,
                                       self.spec_accepted_tokens), totals, self._spec_seen):
            if now > seen:
                counter.inc(now - seen)
        self._spec_seen = totals
        self.spec_acceptance_rate.set(spec.acceptance_rate)
        self.spec_mean_accepted_length.set(spec.mean_accepted_length)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PoolMetrics:
    """A model pool's swaps, wake and queue times, and model states, labelled by model
    (a pool listener, see spindle/engine/model_pool.py)."""

    def __init__(self, registry: CollectorRegistry, model_names: list[str]) -> None:
        from spindle.engine.model_pool import ModelState

        labels = ["model_name"]
        self._states = [s.value for s in ModelState]
        self.state = Gauge("spindle:model_state", "1 for the state the model is in.",
                           [*labels, "state"], registry=registry)
        self.swaps = Counter("spindle:model_swaps", "Times the model went to sleep or woke.",
                             [*labels, "direction"], registry=registry)
        self.wake_seconds = Histogram("spindle:model_wake_seconds",
                                      "Seconds a wake took (or a load, level 0).",
                                      [*labels, "level"], buckets=_SWAP_BUCKETS,
                                      registry=registry)
        self.sleep_seconds = Histogram("spindle:model_sleep_seconds",
                                       "Seconds putting the model to sleep took.",
                                       [*labels, "level"], buckets=_SWAP_BUCKETS,
                                       registry=registry)
        self.queue_seconds = Histogram("spindle:model_queue_seconds",
                                       "Seconds a request waited for its model to wake.",
                                       labels, buckets=_TTFT_BUCKETS, registry=registry)
        self.failures = Counter("spindle:model_failures", "Times the model's engine failed.",
                                labels, registry=registry)
        self.restarts = Counter("spindle:model_restarts", "Times the model was restarted.",
                                labels, registry=registry)
        for name in model_names:
            self.failures.labels(model_name=name)
            self.restarts.labels(model_name=name)

    def set_state(self, model: str, state: str) -> None:
        for s in self._states:
            self.state.labels(model_name=model, state=s).set(1 if s == state else 0)

    def __call__(self, event) -> None:
        self.set_state(event.model, event.state.value)
        level = str(event.level or 0)
        if event.kind in ("wake", "load"):
            self.swaps.labels(model_name=event.model, direction="wake").inc()
            self.wake_seconds.labels(model_name=event.model, level=level).observe(event.seconds)
        elif event.kind == "sleep":
            self.swaps.labels(model_name=event.model, direction="sleep").inc()
            self.sleep_seconds.labels(model_name=event.model, level=level).observe(event.seconds)
        elif event.kind == "queued":
            self.queue_seconds.labels(model_name=event.model).observe(event.seconds)
        elif event.kind == "failed":
            self.failures.labels(model_name=event.model).inc()
        elif event.kind == "restart":
            self.restarts.labels(model_name=event.model).inc()
