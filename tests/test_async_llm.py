"""AsyncLLM: streaming and concurrency against the offline engine, aborts, the
three pause modes, sleep level 0, engine failures and shutdown (mostly without HTTP)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from spindle import LLM, SamplingParams
from spindle.config import EngineArgs
from spindle.engine.async_llm import AsyncLLM, EngineDeadError
from spindle.engine.llm_engine import LLMEngine
from spindle.engine.pause import (EngineUnavailableError, PauseMode, SchedulingGate,
                                  SleepModeUnavailableError)
from spindle.entrypoints.openai.api_server import build_app

ENGINE = dict(device="cpu", dtype="float32", max_model_len=1024)
LONG = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
PROMPTS = ["Hello, my name is", "The capital of", [3, 4, 5, 6], "def f(x):"]


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model(arch="llama"))


@pytest.fixture(scope="module")
def engine(model):
    eng = AsyncLLM.from_engine_args(EngineArgs(model=model, **ENGINE))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def offline(model):
    llm = LLM(model, **ENGINE)
    yield llm
    llm.shutdown()


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def greedy(max_tokens: int = 20) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def last_output(engine: AsyncLLM, prompt, params, request_id=None):
    outputs = [o async for o in engine.generate(prompt, params, request_id)]
    return outputs[-1]


async def first_tokens(stream) -> None:
    """Wait until the stream's request has produced a token."""
    async for output in stream:
        if output.outputs[0].token_ids:
            return


async def in_flight(engine: AsyncLLM) -> bool:
    return await engine.call(lambda e: e.has_unfinished_requests())


# ---- generation -------------------------------------------------------------------------
def test_concurrent_requests_equal_offline_generate(engine, offline):
    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    expected = offline.generate(PROMPTS, greedy(), use_tqdm=False)
    expected_sampled = offline.generate(PROMPTS[0], sampled, use_tqdm=False)[0]

    async def main():
        return await asyncio.gather(*[last_output(engine, p, greedy()) for p in PROMPTS],
                                    last_output(engine, PROMPTS[0], sampled))

    *outputs, got_sampled = run(main())
    for got, want in zip(outputs, expected):
        assert got.finished and got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].text == want.outputs[0].text
    assert [c.token_ids for c in got_sampled.outputs] == \
        [c.token_ids for c in expected_sampled.outputs]


def test_outputs_stream_step_by_step(engine):
    async def main():
        return [o async for o in engine.generate("Hello", greedy(30))]

    outputs = run(main())
    counts = [len(o.outputs[0].token_ids) for o in outputs]
    assert len(outputs) > 1 and counts == sorted(counts) and counts[-1] == 30
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]


def test_bad_requests_raise_and_the_engine_keeps_serving(engine):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request([1] * 2000, greedy())
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request("", greedy())
        stream = await engine.add_request("Hi", LONG, request_id="dup")
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("Hi", greedy(), request_id="dup")
        stream.close()
        return await last_output(engine, "Hi", greedy(3))

    assert run(main()).outputs[0].finish_reason == "length"


def test_leaving_a_stream_aborts_the_request(engine):
    async def main():
        agen = engine.generate("Hello", LONG)
        await agen.__anext__()
        assert await in_flight(engine)
        await agen.aclose()
        for _ in range(100):
            if not await in_flight(engine):
                return engine.stats
            await asyncio.sleep(0.02)
        raise AssertionError("the request is still in the engine")

    assert run(main()).num_in_flight == 0


def test_cancelling_the_consumer_aborts_the_request(engine):
    async def main():
        stream = await engine.add_request("Hello", LONG)
        consumer = asyncio.create_task(first_tokens(stream))
        await consumer
        consumer = asyncio.create_task(stream.__anext__())
        await asyncio.sleep(0)
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        await asyncio.sleep(0.2)
        return await in_flight(engine)

    assert run(main()) is False


def test_abort_delivers_a_final_output(engine):
    async def main():
        stream = await engine.add_request("Hello", LONG, request_id="to-abort")
        await first_tokens(stream)
        await engine.abort("to-abort")
        return [o async for o in stream][-1]

    final = run(main())
    assert final.finished and final.outputs[0].finish_reason == "abort"


# ---- pause ----------------------------------------------------------------------------------
def test_pause_abort(engine):
    async def main():
        streams = [await engine.add_request(p, LONG) for p in PROMPTS[:2]]
        for stream in streams:
            await first_tokens(stream)
        await engine.pause("abort")
        finals = [[o async for o in s][-1] for s in streams]
        assert await engine.is_paused() is PauseMode.ABORT
        with pytest.raises(EngineUnavailableError, match="paused"):
            await engine.add_request("Hi", greedy())
        await engine.resume()
        assert await engine.is_paused() is None
        return finals, await last_output(engine, "Hi", greedy(2))

    finals, after = run(main())
    assert all(f.finished and f.outputs[0].finish_reason == "abort" for f in finals)
    assert after.outputs[0].finish_reason == "length"


def test_pause_wait_finishes_in_flight_and_holds_new(engine):
    async def main():
        running = await engine.add_request("Hello", greedy(50))
        await first_tokens(running)
        await engine.pause("wait")  # returns once `running` is done
        assert engine.stats.num_in_flight == 0
        final = [o async for o in running][-1]
        held = asyncio.create_task(last_output(engine, "Hi", greedy(4)))
        await asyncio.sleep(0.3)
        assert not held.done() and engine.stats.num_held == 1
        await engine.resume()
        return final, await held

    final, held = run(main())
    assert final.outputs[0].finish_reason == "length" and len(final.outputs[0].token_ids) == 50
    assert len(held.outputs[0].token_ids) == 4


def test_pause_keep_freezes_and_resumes_with_identical_output(engine, offline):
    expected = offline.generate("Hello", greedy(120), use_tqdm=False)[0].outputs[0]

    async def main():
        stream = await engine.add_request("Hello", greedy(120))
        await first_tokens(stream)
        await engine.pause("keep")
        def num_output_tokens(e: LLMEngine) -> int:
            return e.core.scheduler.requests[stream.request_id].num_output_tokens

        frozen = await engine.call(num_output_tokens)
        held = asyncio.create_task(last_output(engine, "Hi", greedy(4)))
        await asyncio.sleep(0.3)
        assert await engine.call(num_output_tokens) == frozen and 0 < frozen < 120
        assert not held.done() and engine.stats.num_held == 1
        assert engine.stats.num_running == 1  # frozen, not preempted or dropped
        await engine.resume()
        return [o async for o in stream][-1], await held

    final, held = run(main())
    assert final.outputs[0].token_ids == expected.token_ids
    assert final.outputs[0].text == expected.text
    assert len(held.outputs[0].token_ids) == 4


def test_pause_modes_have_one_definition():
    assert [m.value for m in PauseMode] == ["abort", "wait", "keep"]
    with pytest.raises(ValueError, match="abort, wait, keep"):
        PauseMode.parse("stop")
    gate = SchedulingGate()
    assert gate.may_schedule and not gate.is_paused
    for mode, schedules, holds in [("abort", False, False), ("wait", True, True),
                                   ("keep", False, True)]:
        gate.pause(mode)
        assert gate.may_schedule is schedules
        if holds:
            gate.check_accepting()
        else:
            with pytest.raises(EngineUnavailableError):
                gate.check_accepting()
    gate.resume()
    gate.sleep(0, ["scheduling"])
    assert not gate.may_schedule
    with pytest.raises(EngineUnavailableError, match="sleeping"):
        gate.check_accepting()
    gate.wake(["scheduling"])
    assert gate.may_schedule and not gate.is_sleeping


# ---- sleep and control --------------------------------------------------------------------
def test_sleep(engine):
    async def main():
        with pytest.raises(SleepModeUnavailableError, match="sleep mode is not available"):
            await engine.sleep(1)
        assert not await engine.is_sleeping()
        stream = await engine.add_request("Hello", greedy(40))
        await first_tokens(stream)
        await engine.sleep(0)
        assert await engine.is_sleeping()
        with pytest.raises(EngineUnavailableError, match="sleeping"):
            await engine.add_request("Hi", greedy())
        with pytest.raises(ValueError, match="tags"):
            await engine.wake_up(["everything"])
        await engine.wake_up()
        assert not await engine.is_sleeping()
        return [o async for o in stream][-1]

    assert run(main()).outputs[0].finish_reason == "length"


def test_collective_rpc(engine):
    (beat,) = run(engine.collective_rpc("heartbeat"))
    assert beat.rank == 0
    with pytest.raises(AttributeError):
        run(engine.collective_rpc("no_such_method"))


# ---- failures and shutdown ------------------------------------------------------------------
def test_a_failing_step_fails_requests_and_is_surfaced(model, monkeypatch):
    llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **ENGINE))
    real_step, calls = llm_engine.step, []

    def flaky_step():
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("device on fire")
        return real_step()

    monkeypatch.setattr(llm_engine, "step", flaky_step)
    engine = AsyncLLM(llm_engine)
    try:
        async def main():
            with pytest.raises(EngineDeadError, match="device on fire"):
                await last_output(engine, "Hello", LONG)
            assert engine.is_dead
            with pytest.raises(EngineDeadError):
                await engine.add_request("Hi", greedy())
            with pytest.raises(EngineDeadError):
                await engine.check_health()
            # Over HTTP: unhealthy, and requests fail with a 500 in the OpenAI shape.
            transport = httpx.ASGITransport(app=build_app(engine, ["tiny"]))
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
                assert (await http.get("/health")).status_code == 503
                response = await http.post("/v1/completions", json={"prompt": "Hi"})
                assert response.status_code == 500
                assert response.json()["error"]["type"] == "server_error"
                assert "device on fire" in response.json()["error"]["message"]

        run(main())
    finally:
        engine.shutdown()


def test_shutdown_aborts_in_flight_and_refuses_new(model):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=model, **ENGINE))

    async def main():
        stream = await engine.add_request("Hello", LONG)
        await first_tokens(stream)
        engine.shutdown()
        final = [o async for o in stream][-1]
        with pytest.raises(EngineDeadError, match="shut down"):
            await engine.add_request("Hi", greedy())
        return final

    try:
        assert run(main()).outputs[0].finish_reason == "abort"
    finally:
        engine.shutdown()
