"""Several models on one device (spindle/engine/model_pool.py, `spindle serve A B ...`):
requests routed by model, each model's greedy output equal to its own engine's,
swaps by sleep mode with at most one model awake, queued and frozen requests that
all complete, the time-slice fairness bound, a killed engine that fails only its
model and restarts, states / health / metrics, and the errors."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest

from spindle import LLM, SamplingParams
from spindle.config import EngineArgs, PoolArgs
from spindle.engine.model_pool import ModelPool, ModelState, ModelUnavailableError, PoolModel
from spindle.entrypoints.openai.api_server import build_pool_app
from server_utils import RemoteServer, ThreadedServer, metric_value, sse_events, wait_for

ARCHS = {"qwen": "qwen3", "llama": "llama", "llama2": "llama"}
PROMPTS = ["The quick brown fox", "def f(x):", "1 2 3 4 5"]
MAX_TOKENS = 10


def _args(path, **kw) -> EngineArgs:
    return EngineArgs(model=str(path), device="cpu", kv_cache_memory_bytes=4 * 2**20, **kw)


@pytest.fixture(scope="module")
def paths(tiny_model):
    # Two llamas of different seeds: same shapes, different weights, so a misrouted
    # request shows in its tokens.
    return {"qwen": tiny_model("qwen3"), "llama": tiny_model("llama"),
            "llama2": tiny_model("llama", seed=7)}


@pytest.fixture(scope="module")
def reference(paths):
    """Each model's own greedy tokens and text (its own engine, no pool)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = {}
    for name, path in paths.items():
        llm = LLM(str(path), device="cpu", kv_cache_memory_bytes=4 * 2**20)
        out[name] = {p: (o.outputs[0].token_ids, o.outputs[0].text)
                     for p, o in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False))}
        llm.shutdown()
    return out


def _pool(paths, names=("qwen", "llama", "llama2"), **kw) -> ModelPool:
    return ModelPool([PoolModel(n, _args(paths[n])) for n in names], **kw)


@pytest.fixture(scope="module")
def server(paths):
    """A pool server of three models, at most one awake, a short time slice."""
    pool = _pool(paths, time_slice_s=0.2).start()
    srv = ThreadedServer(build_pool_app(pool, dev_mode=True))
    yield srv, pool
    srv.stop()
    pool.shutdown()


def _complete(url: str, model: str, prompt: str, stream: bool, max_tokens: int = MAX_TOKENS):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    with httpx.Client(timeout=120) as c:
        if not stream:
            r = c.post(f"{url}/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["choices"][0]["text"]
        text = []
        with c.stream("POST", f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            for event in sse_events(r):
                if event == "[DONE]":
                    break
                if "error" in event:
                    raise RuntimeError(event["error"])
                text.append(event["choices"][0]["text"])
        return "".join(text)


def _states(url: str) -> dict[str, str]:
    cards = httpx.get(f"{url}/v1/models").json()["data"]
    return {c["id"]: c["state"] for c in cards}


# ---- routing and swaps ---------------------------------------------------------------
def test_interleaved_requests_each_equal_their_models_own_output(server, reference):
    srv, pool = server
    jobs = [(name, prompt, i % 2 == 0) for i, (name, prompt) in enumerate(
        (n, p) for p in PROMPTS for n in ("qwen", "llama", "llama2"))] * 2
    results: dict[int, str] = {}

    def run(i, name, prompt, stream):
        results[i] = _complete(srv.url, name, prompt, stream)

    threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join(120)
    assert len(results) == len(jobs)
    for i, (name, prompt, _) in enumerate(jobs):
        assert results[i] == reference[name][prompt][1], (name, prompt)
    states = _states(srv.url)
    assert sorted(states.values()).count("awake") <= 1
    assert sum(s["stats"]["wakes"] for s in pool.status()) >= 2  # it really swapped


def test_at_most_one_model_holds_memory_and_the_others_sleep(server, reference):
    srv, pool = server
    for name in ("llama2", "qwen"):
        assert _complete(srv.url, name, PROMPTS[0], False) == reference[name][PROMPTS[0]][1]
        status = {s["name"]: s for s in pool.status()}
        assert status[name]["state"] == "awake"
        asleep = [s for s in status.values() if s["name"] != name]
        assert all(s["state"] == "asleep" and s["sleep_level"] in (1, 2) for s in asleep)
        for other in asleep:  # its workers hold no weights or KV cache
            state = asyncio.run(_sleep_state(pool, other["name"]))
            assert all(sum(w["device_bytes"].values()) == 0 for w in state["workers"])


async def _sleep_state(pool: ModelPool, name: str) -> dict:
    return await pool.engine(name).call(lambda engine: engine.core.sleep_state())


def test_requests_queued_during_a_swap_all_complete(paths, reference):
    """Many requests for a sleeping model arrive while another streams: they wait in
    its queue, all complete with the right tokens, and the streaming one, frozen by
    the swap when its time slice ends, completes with its own tokens too."""
    pool = _pool(paths, names=("qwen", "llama"), time_slice_s=0.05).start()
    long_params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(str(paths["llama"]), device="cpu", kv_cache_memory_bytes=4 * 2**20)
    long_ref = llm.generate(PROMPTS[1], long_params, use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()

    async def last(name, prompt, params):
        out = None
        async for out in pool.generate(name, prompt, params):
            pass
        return out.outputs[0].token_ids

    async def scenario():
        long_task = asyncio.create_task(last("llama", PROMPTS[1], long_params))
        await asyncio.sleep(0.1)  # it streams; then a burst for the sleeping model
        burst = asyncio.gather(*[last("qwen", p, short) for p in PROMPTS for _ in range(3)])
        return await long_task, await burst

    try:
        long_tokens, burst_tokens = asyncio.run(scenario())
        stats = {s["name"]: s["stats"] for s in pool.status()}
    finally:
        pool.shutdown()
    assert long_tokens == long_ref
    assert burst_tokens == [reference["qwen"][p][0] for p in PROMPTS for _ in range(3)]
    assert stats["qwen"]["queued_requests"] >= 1 and stats["qwen"]["wakes"] >= 1
    assert stats["llama"]["sleeps"] >= 1 and stats["llama"]["wakes"] >= 1  # frozen, resumed


def test_a_busy_model_gives_way_after_its_time_slice(paths):
    """Fairness: a model that keeps the device busy is put to sleep once its time slice
    is over while another model waits, so the waiting request is served long before
    the busy model's work ends."""
    slice_s = 0.3
    pool = _pool(paths, names=("qwen", "llama"), time_slice_s=slice_s).start()
    busy = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def timed(name, prompt, params, start):
        async for out in pool.generate(name, prompt, params):
            pass
        return time.monotonic() - start

    async def scenario():
        start = time.monotonic()
        hog = [asyncio.create_task(timed("llama", p, busy, start)) for p in PROMPTS]
        await asyncio.sleep(slice_s + 0.2)  # llama has used its slice
        waited = await timed("qwen", "hello", short, time.monotonic())
        return waited, await asyncio.gather(*hog)

    try:
        waited, hog_times = asyncio.run(scenario())
    finally:
        pool.shutdown()
    # Served after at most about a swap, not after llama's 3 x 1500 tokens.
    assert waited < min(hog_times) - slice_s
    assert waited < 5.0


def test_a_request_for_the_awake_model_does_not_swap(server, reference):
    srv, pool = server
    _complete(srv.url, "llama", PROMPTS[0], False)
    before = [s["stats"]["wakes"] for s in pool.status()]
    for prompt in PROMPTS:
        assert _complete(srv.url, "llama", prompt, True) == reference["llama"][prompt][1]
    assert [s["stats"]["wakes"] for s in pool.status()] == before


# ---- states, metrics, dev routes -----------------------------------------------------
def test_models_route_metrics_and_dev_routes(server):
    srv, pool = server
    _complete(srv.url, "qwen", PROMPTS[0], False)
    assert _states(srv.url) == {"qwen": "awake", "llama": "asleep", "llama2": "asleep"}
    card = httpx.get(f"{srv.url}/v1/models/llama").json()
    assert card["state"] == "asleep" and card["sleep_level"] in (1, 2)
    r = httpx.post(f"{srv.url}/models/llama/wake_up", json={})
    assert r.status_code == 200 and r.json()["state"] == "awake"
    assert _states(srv.url)["qwen"] == "asleep"
    r = httpx.post(f"{srv.url}/models/llama/sleep", json={"level": 2})
    assert r.json()["state"] == "asleep" and r.json()["sleep_level"] == 2
    assert httpx.post(f"{srv.url}/models/llama/sleep", json={}).status_code == 400  # not awake
    assert httpx.post(f"{srv.url}/models/nope/sleep", json={}).status_code == 404
    assert httpx.post(f"{srv.url}/models/qwen/sleep", json={"level": 3}).status_code == 400
    text = httpx.get(f"{srv.url}/metrics").text
    assert metric_value(text, "spindle:model_swaps_total", model_name="llama",
                        direction="wake") >= 1
    assert metric_value(text, "spindle:model_wake_seconds_count", model_name="llama",
                        level="1") >= 1
    assert metric_value(text, "spindle:model_queue_seconds_count", model_name="qwen") >= 1
    assert metric_value(text, "spindle:model_state", model_name="llama", state="asleep") == 1
    assert metric_value(text, "spindle:generation_tokens_total", model_name="qwen") > 0
    health = httpx.get(f"{srv.url}/health")
    assert health.status_code == 200 and set(health.json()["models"]) == set(ARCHS)


def test_bad_requests_are_refused_without_a_swap(server):
    srv, pool = server
    _complete(srv.url, "qwen", PROMPTS[0], False)
    wakes = [s["stats"]["wakes"] for s in pool.status()]
    base = {"prompt": "hi", "max_tokens": 4}
    r = httpx.post(f"{srv.url}/v1/completions", json=base)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_required"
    r = httpx.post(f"{srv.url}/v1/completions", json={**base, "model": "gpt-5"})
    assert r.status_code == 404 and "'qwen'" in r.json()["error"]["message"]
    r = httpx.post(f"{srv.url}/v1/completions",
                   json={**base, "model": "llama", "prompt": "x " * 5000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(f"{srv.url}/v1/completions", json={**base, "model": "llama", "top_p": 7})
    assert r.status_code == 400
    assert [s["stats"]["wakes"] for s in pool.status()] == wakes
    assert _states(srv.url)["llama"] == "asleep"


# ---- faults ---------------------------------------------------------------------------
def test_a_killed_engine_fails_only_its_model_and_restarts(paths, reference):
    pool = _pool(paths, names=("qwen", "llama"), time_slice_s=0.2).start()
    srv = ThreadedServer(build_pool_app(pool, dev_mode=True))
    try:
        assert _complete(srv.url, "llama", PROMPTS[0], False) == reference["llama"][PROMPTS[0]][1]
        pids = asyncio.run(pool.engine("llama").call(
            lambda engine: engine.core.executor.worker_pids))
        os.kill(pids[0], signal.SIGKILL)
        assert wait_for(lambda: _states(srv.url)["llama"] == "failed", timeout=30)
        r = httpx.post(f"{srv.url}/v1/completions",
                       json={"model": "llama", "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 503 and "restart" in r.json()["error"]["message"]
        # The other model serves on (it wakes: the failed one holds nothing).
        for stream in (False, True):
            expected = reference["qwen"][PROMPTS[1]][1]
            assert _complete(srv.url, "qwen", PROMPTS[1], stream) == expected
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503
        assert health.json()["models"]["llama"]["healthy"] is False
        assert health.json()["models"]["qwen"]["healthy"] is True
        assert httpx.get(f"{srv.url}/health/qwen").status_code == 200
        assert httpx.get(f"{srv.url}/health/llama").status_code == 503
        text = httpx.get(f"{srv.url}/metrics").text
        assert metric_value(text, "spindle:model_failures_total", model_name="llama") == 1
        assert metric_value(text, "spindle:model_failures_total", model_name="qwen") == 0
        # Restarted without restarting the server: it serves its own output again.
        r = httpx.post(f"{srv.url}/models/llama/restart", json={}, timeout=120)
        assert r.status_code == 200 and r.json()["state"] == "awake"
        for prompt in PROMPTS:
            assert _complete(srv.url, "llama", prompt, True) == reference["llama"][prompt][1]
        assert httpx.get(f"{srv.url}/health").status_code == 200
        metrics = httpx.get(f"{srv.url}/metrics").text
        assert metric_value(metrics, "spindle:model_restarts_total", model_name="llama") == 1
    finally:
        srv.stop()
        pool.shutdown()


def test_a_request_in_flight_on_a_killed_engine_fails_alone(paths, reference):
    pool = _pool(paths, names=("qwen", "llama"), time_slice_s=0.2).start()
    long_params = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)

    async def scenario():
        async def run(name, params):
            async for out in pool.generate(name, PROMPTS[0], params):
                pass
            return out.outputs[0].token_ids

        doomed = asyncio.create_task(run("llama", long_params))
        await asyncio.sleep(0.3)
        pids = await pool.engine("llama").call(lambda e: e.core.executor.worker_pids)
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(Exception) as failed:
            await doomed
        short = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        return failed.value, await run("qwen", short)

    try:
        error, tokens = asyncio.run(scenario())
    finally:
        pool.shutdown()
    assert "fail" in str(error) or "died" in str(error)
    assert tokens == reference["qwen"][PROMPTS[0]][0]


# ---- sleep level, limits, errors ----------------------------------------------------
def test_auto_sleep_level_is_2_when_the_host_has_no_room(paths, reference):
    pool = ModelPool([PoolModel("qwen", _args(paths["qwen"])),
                      PoolModel("llama", _args(paths["llama"]), sleep_level=1)],
                     host_memory_reserve_bytes=2**60).start()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def run(name):
        async for out in pool.generate(name, PROMPTS[2], params):
            pass
        return out.outputs[0].token_ids

    try:
        assert pool.model_status("qwen")["sleep_level"] == 2  # put to sleep at start
        assert asyncio.run(run("qwen")) == reference["qwen"][PROMPTS[2]][0]  # reloaded
        assert pool.model_status("llama")["sleep_level"] == 1  # fixed by its config
        assert asyncio.run(run("llama")) == reference["llama"][PROMPTS[2]][0]
    finally:
        pool.shutdown()


def test_the_memory_budget_decides_how_many_stay_awake(paths):
    pool = ModelPool([PoolModel(n, _args(paths[n])) for n in ("qwen", "llama")],
                     max_awake_models=2).start()
    both = sum(s["device_bytes"] for s in pool.status())
    params = SamplingParams(temperature=0.0, max_tokens=2)

    async def touch(pool, names):
        for name in names:
            async for _ in pool.generate(name, "hi", params):
                pass
        return {s["name"]: s["state"] for s in pool.status()}

    try:
        assert asyncio.run(touch(pool, ["qwen", "llama"])) == {"qwen": "awake", "llama": "awake"}
    finally:
        pool.shutdown()
    tight = ModelPool([PoolModel(n, _args(paths[n])) for n in ("qwen", "llama")],
                      max_awake_models=2, device_memory_budget_bytes=both - 1).start()
    try:
        assert asyncio.run(touch(tight, ["qwen", "llama"])) == {"qwen": "asleep",
                                                                 "llama": "awake"}
        assert asyncio.run(touch(tight, ["qwen"])) == {"qwen": "awake", "llama": "asleep"}
    finally:
        tight.shutdown()
    with pytest.raises(ValueError, match="more than the whole device_memory_budget"):
        ModelPool([PoolModel("qwen", _args(paths["qwen"]))],
                  device_memory_budget_bytes=1024).start()


@pytest.mark.parametrize("kwargs, match", [
    (dict(models=[]), "at least one model"),
    (dict(names=("a", "a")), "unique; repeated: a"),
    (dict(max_awake_models=0), "max_awake_models must be an integer >= 1"),
    (dict(time_slice_s=-1), "time_slice_s must be >= 0"),
    (dict(device_memory_budget_bytes=0), "device_memory_budget_bytes must be a positive"),
    (dict(sleep_level=3), "sleep_level must be one of auto, 1, 2"),
])
def test_bad_pool_arguments_are_refused(paths, kwargs, match):
    names = kwargs.pop("names", ("a", "b"))
    level = kwargs.pop("sleep_level", "auto")
    models = kwargs.pop("models", [PoolModel(n, _args(paths["qwen"]), level) for n in names])
    with pytest.raises(ValueError, match=match):
        ModelPool(models, **kwargs)


def test_pool_args_from_the_command_line_are_checked(paths):
    base = _args(paths["qwen"])
    two = [str(paths["qwen"]), str(paths["llama"])]
    with pytest.raises(ValueError, match="one served model name per model: 2 models, 1"):
        ModelPool.from_args(two, ["a"], base)
    with pytest.raises(ValueError, match="model_overrides names models the pool does not"):
        ModelPool.from_args(two, ["a", "b"], base, PoolArgs(model_overrides='{"c": {}}'))
    with pytest.raises(ValueError, match="model_overrides must be engine options"):
        PoolArgs(model_overrides={"a": {"gpu_memory_utilisation": 0.5}})
    with pytest.raises(ValueError, match="sleep_level must be one value, or one per model"):
        ModelPool.from_args(two, None, base, PoolArgs(sleep_level="1,2,1"))
    with pytest.raises(ValueError, match="sleep_level must be auto, 1 or 2"):
        PoolArgs(sleep_level="3")
    pool = ModelPool.from_args(two, ["a", "b"], base, PoolArgs(
        sleep_level="2,auto", model_overrides={"b": {"max_model_len": 64}},
        device_memory_budget=1.5))
    specs = {m.name: m.spec for m in pool._members.values()}
    assert specs["a"].sleep_level == 2 and specs["b"].sleep_level == "auto"
    assert specs["b"].engine_args.max_model_len == 64
    assert specs["a"].engine_args.max_model_len is None
    assert specs["a"].engine_args.enable_sleep_mode
    assert specs["a"].engine_args.distributed_executor_backend == "mp"
    assert pool.device_memory_budget_bytes == int(1.5 * 2**30)


def test_a_shut_down_pool_refuses_requests(paths):
    pool = _pool(paths, names=("qwen",)).start()
    pool.shutdown()

    async def use():
        async for _ in pool.generate("qwen", "hi"):
            pass

    with pytest.raises(ModelUnavailableError, match="shut down"):
        asyncio.run(use())
    assert pool.model_status("qwen")["state"] == ModelState.STOPPED.value


def test_spindle_serve_with_several_paths(paths, reference, tmp_path):
    """The command: `spindle serve A B --served-model-name a b`, a request to each."""
    srv = RemoteServer([str(paths["qwen"]), str(paths["llama"])], "--served-model-name", "q", "l",
                       "--device", "cpu", "--kv-cache-memory-bytes", str(4 * 2**20),
                       "--swap-time-slice", "0.5", log_path=tmp_path / "serve.log")
    try:
        assert _complete(srv.url, "l", PROMPTS[0], True) == reference["llama"][PROMPTS[0]][1]
        assert _complete(srv.url, "q", PROMPTS[0], False) == reference["qwen"][PROMPTS[0]][1]
        assert _states(srv.url) == {"q": "awake", "l": "asleep"}
    finally:
        assert srv.stop() == 0


def test_a_model_that_fails_to_load_stops_the_start_naming_it(paths):
    pool = ModelPool([PoolModel("qwen", _args(paths["qwen"])),
                      PoolModel("broken", _args("/nonexistent/model"))])
    with pytest.raises(ValueError, match="model 'broken' failed to load: model path"):
        pool.start()
    assert pool.model_status("qwen")["state"] == "stopped"  # loaded, then shut down again
