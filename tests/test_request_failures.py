"""No single request may kill the engine: seeds over the whole range torch takes, and
a request whose preparation (in the model runner) or output processing fails is
failed alone, with a clear error, through LLM (uni; mp with TP=2 or PP=2) and
AsyncLLM; the engine serves the next requests unchanged.

Failures are injected into a worker's model state through collective_rpc, so the
same injection reaches in-process and multi-process workers."""

from __future__ import annotations

import asyncio

import pytest

from spindle import LLM, SamplingParams
from spindle.config import EngineArgs
from spindle.engine.async_llm import AsyncLLM
from spindle.engine.detokenizer import IncrementalDetokenizer
from spindle.outputs import RequestFailedError
from spindle.sampling_params import SEED_MAX, SEED_MIN

ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=2)
GOOD = [[3, 4, 5, 6, 7], [11, 12, 13]]
BAD = [7, 7, 7, 7, 9]  # the injected failure strikes prompts that start with 7, 7, 7, 7
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def install_fault(error: type[Exception], only_req_suffix: str | None = None):
    """A collective_rpc function: the worker's model state fails to prepare requests
    whose prompt starts with BAD[:4] (and whose id ends with only_req_suffix)."""
    marker = BAD[:4]

    def install(worker) -> None:
        state = worker.runner.state
        original = state.preprocess_state

        def preprocess_state(cached, new):
            if (list(new.token_ids[:len(marker)]) == marker
                    and (only_req_suffix is None or new.req_id.endswith(only_req_suffix))):
                raise error(f"injected failure of {new.req_id}")
            return original(cached, new)

        state.preprocess_state = preprocess_state

    return install


def remove_fault(worker) -> None:
    vars(worker.runner.state).pop("preprocess_state", None)


def token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


# ---- seeds -------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [SEED_MAX + 1, SEED_MIN - 1, True, 1.5, "7"])
def test_a_seed_torch_cannot_take_is_refused_naming_seed(seed):
    with pytest.raises(ValueError, match="SamplingParams.seed"):
        SamplingParams(seed=seed)


def test_child_seeds_wrap_within_the_range_torch_takes():
    params = SamplingParams(seed=SEED_MAX, n=3)
    assert [params.for_child(i).seed for i in range(3)] == [SEED_MAX, 0, 1]
    assert SamplingParams(seed=SEED_MIN).for_child(0).seed == SEED_MIN


def test_fields_changed_after_creation_are_validated_again():
    params = SamplingParams()
    params.seed = 2**64
    with pytest.raises(ValueError, match="seed"):
        params.validate()


# ---- through LLM: uni (async scheduling on and off) and mp TP=2 ----------------------------
@pytest.fixture(scope="module", params=[
    pytest.param({}, id="uni-async"),
    pytest.param({"async_scheduling": False}, id="uni-sync"),
    pytest.param({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
                 id="mp-tp2"),
    pytest.param({"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"},
                 id="mp-pp2"),
])
def llm(request, tiny_model):
    engine = LLM(str(tiny_model(arch="llama")), **ENGINE, **request.param)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def expected(llm):
    return token_ids(llm.generate(GOOD, GREEDY, use_tqdm=False))


def test_extreme_seeds_with_n_2_generate(llm):
    for seed in (SEED_MAX, SEED_MIN):
        params = SamplingParams(seed=seed, n=2, max_tokens=8, ignore_eos=True)
        first = llm.generate("hello", params, use_tqdm=False)[0]
        again = llm.generate("hello", params, use_tqdm=False)[0]
        assert len(first.outputs) == 2
        assert token_ids([first]) == token_ids([again])  # seeded: reproducible
    with pytest.raises(ValueError, match="seed"):
        llm.generate("hello", SamplingParams(seed=SEED_MAX + 1), use_tqdm=False)


@pytest.mark.parametrize("error,bad_request", [(ValueError, True), (RuntimeError, False)])
def test_a_request_failing_in_preparation_fails_alone(llm, expected, error, bad_request):
    executor = llm.engine.core.executor
    executor.collective_rpc(install_fault(error))
    try:
        with pytest.raises(RequestFailedError, match="injected failure") as info:
            llm.generate([GOOD[0], BAD, GOOD[1]], GREEDY, use_tqdm=False)
        assert info.value.prompt_index == 1 and info.value.bad_request is bad_request
        assert bad_request or "RuntimeError" in str(info.value)
        assert not llm.engine.has_unfinished_requests()
        # Failures leave no runner row behind (this engine holds 2 requests at most).
        for _ in range(3):
            with pytest.raises(RequestFailedError):
                llm.generate(BAD, GREEDY, use_tqdm=False)
        assert token_ids(llm.generate(GOOD, GREEDY, use_tqdm=False)) == expected
    finally:
        executor.collective_rpc(remove_fault)
    assert token_ids(llm.generate([BAD], GREEDY, use_tqdm=False))  # no fault: it runs


def test_one_failing_sample_of_n_fails_the_request_and_frees_its_siblings(llm, expected):
    executor = llm.engine.core.executor
    executor.collective_rpc(install_fault(ValueError, only_req_suffix="#1"))
    try:
        params = SamplingParams(temperature=0.8, n=3, seed=5, max_tokens=30, ignore_eos=True)
        with pytest.raises(RequestFailedError, match="#1"):
            llm.generate(BAD, params, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.core.scheduler.get_num_unfinished_requests() == 0
        assert token_ids(llm.generate(GOOD, GREEDY, use_tqdm=False)) == expected
    finally:
        executor.collective_rpc(remove_fault)


# ---- through AsyncLLM -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def async_engine(tiny_model):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_model(arch="llama")), **ENGINE))
    yield engine
    engine.shutdown()


def run(coro, timeout: float = 120.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def final(engine: AsyncLLM, prompt, params):
    return [o async for o in engine.generate(prompt, params)][-1]


def test_a_failing_stream_raises_and_the_others_finish(async_engine):
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    async def main():
        expected = await final(async_engine, GOOD[0], long)
        await async_engine.call(
            lambda e: e.core.executor.collective_rpc(install_fault(ValueError)))
        try:
            good = asyncio.create_task(final(async_engine, GOOD[0], long))
            with pytest.raises(RequestFailedError, match="injected failure") as info:
                await final(async_engine, BAD, long)
            assert info.value.bad_request
            assert (await good).outputs[0].token_ids == expected.outputs[0].token_ids
        finally:
            await async_engine.call(lambda e: e.core.executor.collective_rpc(remove_fault))
        assert not async_engine.is_dead
        await async_engine.check_health()
        assert (await final(async_engine, GOOD[1], long)).outputs[0].finish_reason == "length"

    run(main())


def test_a_failure_in_output_processing_fails_that_request_alone(async_engine, monkeypatch):
    real_add_token = IncrementalDetokenizer.add_token

    def add_token(self, token_id):
        if "BOOM" in (self.params.stop or []):
            raise KeyError(f"no text for token {token_id}")
        return real_add_token(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add_token", add_token)
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    async def main():
        good = asyncio.create_task(final(async_engine, GOOD[0], long))
        with pytest.raises(RequestFailedError, match="KeyError: .*no text for token") as info:
            await final(async_engine, GOOD[1], SamplingParams(max_tokens=60, stop=["BOOM"]))
        assert not info.value.bad_request
        assert (await good).outputs[0].finish_reason == "length"
        # The failed request was aborted in the core: nothing is left running.
        assert await async_engine.call(
            lambda e: e.core.scheduler.get_num_unfinished_requests()) == 0

    run(main())
    assert not async_engine.is_dead
