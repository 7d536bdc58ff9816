"""Sleep mode on the CPU: the portable backend end to end (levels 0/1/2, staged wake,
pause modes with requests in flight, TP=2 through the mp executor), the state
machine's errors, a third-party backend found through the entry point group, the
cumem bookkeeping against a fake virtual-memory driver, and the device lock."""

from __future__ import annotations

import ctypes
import gc
import sys
import textwrap
import threading
from typing import Callable

import pytest
import torch

from spindle import LLM, SamplingParams
from spindle.engine.pause import EngineUnavailableError, SleepModeUnavailableError
from spindle.memory.cumem import TaggedSegments
from spindle.memory.device_lock import device_lock
from spindle.memory.portable import PortableSleepBackend
from spindle.memory.sleep_backend import (ENTRY_POINT_GROUP, KV_CACHE, WEIGHTS,
                                          get_backend_class, register_backend)
from spindle.platforms.cpu import CpuPlatform
from spindle.runner.model_runner import flatten_cache_entries

PROMPTS = ["The quick brown fox", "def f(x):", "1 2 3 4 5 6 7 8", "hello hello"]


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def texts(llm: LLM, params: SamplingParams | None = None) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params or greedy(),
                                                         use_tqdm=False)]


def runner_of(llm: LLM):
    return llm.engine.core.executor.worker.runner


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = LLM(str(tiny_model("qwen3")), device="cpu", enable_sleep_mode=True,
                 kv_cache_memory_bytes=8 * 2**20)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def baseline(llm):
    return texts(llm)


# ---- levels ------------------------------------------------------------------------------
@pytest.mark.parametrize("level", [1, 2, 0])
def test_round_trip_gives_the_same_greedy_output(llm, baseline, level):
    llm.sleep(level)
    assert llm.is_sleeping()
    with pytest.raises(EngineUnavailableError, match="sleeping"):
        llm.generate("refused while asleep", greedy(), use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert texts(llm) == baseline


def test_level_1_keeps_weights_on_host_and_frees_the_device_tensors(llm, baseline):
    runner = runner_of(llm)
    weight_bytes = sum(t.numel() * t.element_size() for t in runner.tagged_tensors(WEIGHTS))
    llm.sleep(1)
    state = llm.sleep_state()
    assert state["level"] == 1 and set(state["asleep"]) == {"weights", "kv_cache", "scheduling"}
    worker = state["workers"][0]
    assert worker["device_bytes"] == {"weights": 0, "kv_cache": 0}
    assert worker["host_bytes"] == weight_bytes
    assert all(t.numel() == 0 for t in runner.tagged_tensors(KV_CACHE))
    llm.wake_up()
    assert llm.sleep_state()["workers"][0]["host_bytes"] == 0
    assert texts(llm) == baseline


def test_level_2_drops_weights_and_reloads_them_from_the_checkpoint(llm, baseline):
    runner = runner_of(llm)
    buffers = runner.buffers_outside_checkpoint()
    assert buffers, "the rotary tables are buffers outside the checkpoint"
    buffer_bytes = sum(b.numel() * b.element_size() for b in buffers)
    before = {id(t): t.clone() for t in runner.tagged_tensors(WEIGHTS)}
    llm.sleep(2)
    worker = llm.sleep_state()["workers"][0]
    assert worker["device_bytes"]["weights"] == 0
    assert worker["host_bytes"] == buffer_bytes  # only what the checkpoint cannot give back
    llm.wake_up(["weights"])
    after = runner.tagged_tensors(WEIGHTS)
    assert all(torch.equal(before[id(t)], t) for t in after)
    llm.wake_up()
    assert texts(llm) == baseline


# ---- tags --------------------------------------------------------------------------------
def test_tags_wake_in_stages(llm, baseline):
    llm.sleep(1)
    llm.wake_up(["weights"])
    assert llm.sleep_state()["asleep"] == ["kv_cache", "scheduling"]
    with pytest.raises(ValueError, match="cannot wake weights: not asleep"):
        llm.wake_up(["weights"])
    with pytest.raises(ValueError, match="cannot wake scheduling while kv_cache still sleeps"):
        llm.wake_up(["scheduling"])
    llm.wake_up(["kv_cache"])
    assert llm.is_sleeping()  # scheduling wakes only when named
    assert all(torch.count_nonzero(c) == 0 for c in runner_of(llm).tagged_tensors(KV_CACHE))
    llm.wake_up(["scheduling"])
    assert not llm.is_sleeping()
    assert texts(llm) == baseline


def test_wrong_calls_are_clear_errors(llm):
    with pytest.raises(ValueError, match="not asleep"):
        llm.wake_up()
    with pytest.raises(ValueError, match="sleep level must be 0, 1 or 2"):
        llm.sleep(3)
    with pytest.raises(ValueError, match="pause mode must be one of"):
        llm.sleep(1, mode="later")
    llm.sleep(0)
    with pytest.raises(ValueError, match="already asleep"):
        llm.sleep(1)
    with pytest.raises(ValueError, match="cannot wake weights: not asleep"):
        llm.wake_up(["weights"])  # level 0 releases no memory
    with pytest.raises(ValueError, match="tags must be among"):
        llm.wake_up(["everything"])
    llm.wake_up()


def test_sleep_needs_sleep_mode(tiny_model):
    with LLM(str(tiny_model("llama")), device="cpu", kv_cache_memory_bytes=2**22) as plain:
        with pytest.raises(SleepModeUnavailableError, match="enable_sleep_mode"):
            plain.sleep(1)
        assert not plain.is_sleeping()
        plain.sleep(0)  # scheduling only: always available
        plain.wake_up()


def test_config_errors(tiny_model):
    path = str(tiny_model("llama"))
    with pytest.raises(ValueError, match="enable_sleep_mode is off"):
        LLM(path, device="cpu", sleep_mode_backend="portable")
    with pytest.raises(ValueError, match="unknown sleep_mode_backend 'nope'.*portable"):
        LLM(path, device="cpu", enable_sleep_mode=True, sleep_mode_backend="nope")
    with pytest.raises(ValueError, match="cumem' needs CUDA"):
        LLM(path, device="cpu", enable_sleep_mode=True, sleep_mode_backend="cumem")
    with pytest.raises(ValueError, match="enable_cumem_allocator needs CUDA"):
        LLM(path, device="cpu", enable_cumem_allocator=True)


# ---- pause modes with requests in flight ---------------------------------------------------
def _start(llm: LLM, n: int) -> list[str]:
    ids = [llm.engine.add_request(p, greedy(n), final_only=True) for p in PROMPTS]
    for _ in range(4):  # prefills and a few decode steps
        llm.engine.step()
    return ids


def _finish(llm: LLM, ids: list[str]) -> dict:
    done = {}
    while len(done) < len(ids):
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = out
    return {r: done[r] for r in ids}


@pytest.mark.parametrize("level", [0, 1, 2])
def test_keep_freezes_requests_and_continues_them_after_wake(llm, level):
    expected = texts(llm, greedy(30))
    ids = _start(llm, 30)
    llm.engine.sleep(level, "keep")
    assert not llm.engine.can_step()  # frozen: nothing runs while asleep
    llm.wake_up()
    outs = _finish(llm, ids)
    assert [outs[r].outputs[0].token_ids for r in ids] == expected
    assert all(outs[r].outputs[0].finish_reason == "length" for r in ids)


def test_abort_finishes_requests_in_flight(llm, baseline):
    ids = _start(llm, 30)
    outs = llm.engine.sleep(1, "abort")
    assert sorted(o.request_id for o in outs) == sorted(ids)
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    llm.wake_up()
    assert not llm.engine.has_unfinished_requests()
    assert texts(llm) == baseline


def test_wait_runs_requests_to_completion_before_sleeping(llm):
    expected = texts(llm, greedy(30))
    ids = _start(llm, 30)
    outs = llm.engine.sleep(1, "wait")
    assert llm.is_sleeping()
    finished = {o.request_id: o for o in outs if o.finished}
    assert sorted(finished) == sorted(ids)
    assert [finished[r].outputs[0].token_ids for r in ids] == expected
    llm.wake_up()


def test_wait_while_paused_is_a_clear_error(llm):
    expected = texts(llm, greedy(30))
    ids = _start(llm, 30)
    llm.engine.pause("keep")
    with pytest.raises(ValueError, match="cannot finish requests while the engine is paused"):
        llm.engine.sleep(1, "wait")
    assert not llm.is_sleeping()
    llm.engine.resume()
    outs = _finish(llm, ids)
    assert [outs[r].outputs[0].token_ids for r in ids] == expected


# ---- tensor parallel (collective_rpc to every worker) ----------------------------------------
def test_tp2_mp_executor_sleeps_and_wakes_every_worker(tiny_model):
    path = str(tiny_model("llama"))
    with LLM(path, device="cpu", tensor_parallel_size=2, enable_sleep_mode=True,
             kv_cache_memory_bytes=2**22) as llm:
        expected = texts(llm)
        llm.sleep(1)
        workers = llm.sleep_state()["workers"]
        assert [w["rank"] for w in workers] == [0, 1]
        assert all(w["device_bytes"] == {"weights": 0, "kv_cache": 0} for w in workers)
        assert all(w["host_bytes"] > 0 for w in workers)
        llm.wake_up()
        assert texts(llm) == expected


# ---- hybrid cache entries (a list of tensors per layer) --------------------------------------
class FakeTarget:
    """A SleepTarget whose second layer keeps its state as a list of tensors."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.weights = [torch.randn(4, 4), torch.randn(8)]
        self.buffer = torch.arange(6.0)
        self.kv_caches = [torch.randn(2, 3), [torch.randn(5), torch.randn(2, 2)]]
        self.reloads = 0
        self.woken: list[tuple[list[str], bool]] = []

    def tagged_tensors(self, tag):
        return self.weights + [self.buffer] if tag == WEIGHTS else flatten_cache_entries(self.kv_caches)

    def buffers_outside_checkpoint(self):
        return [self.buffer]

    def reload_weights(self):
        self.reloads += 1
        for w in self.weights:
            w.fill_(1.0)

    def before_sleep(self, addresses_will_change):
        pass

    def after_wake(self, woken, all_awake):
        self.woken.append((list(woken), all_awake))
        if KV_CACHE in woken:
            for c in flatten_cache_entries(self.kv_caches):
                c.zero_()


def test_portable_backend_handles_list_cache_entries():
    target = FakeTarget()
    shapes = [t.shape for t in flatten_cache_entries(target.kv_caches)]
    weights = [w.clone() for w in target.weights]
    backend = PortableSleepBackend(target, CpuPlatform())
    backend.suspend(1)
    assert all(t.numel() == 0 for t in flatten_cache_entries(target.kv_caches))
    assert backend.state().device_bytes == {"weights": 0, "kv_cache": 0}
    backend.resume(["kv_cache"])
    assert [t.shape for t in flatten_cache_entries(target.kv_caches)] == shapes
    assert target.woken == [(["kv_cache"], False)]
    backend.resume()
    assert all(torch.equal(a, b) for a, b in zip(weights, target.weights))
    assert target.woken[-1] == (["weights"], True) and target.reloads == 0
    backend.suspend(2)
    backend.resume()
    assert target.reloads == 1 and torch.equal(target.buffer, torch.arange(6.0))
    with pytest.raises(ValueError, match="not asleep"):
        backend.resume(["weights"])


# ---- third-party backends ------------------------------------------------------------------
RECORDING_BACKEND = '''
from spindle.memory.portable import PortableSleepBackend

CALLS = []


class RecordingBackend(PortableSleepBackend):
    name = "recording"

    def _release(self, level):
        CALLS.append(("release", level))
        super()._release(level)

    def _restore(self, tags):
        CALLS.append(("restore", list(tags)))
        super()._restore(tags)
'''


@pytest.fixture
def entry_point_plugin(tmp_path, monkeypatch):
    """An installed-looking distribution declaring a backend in the entry point group."""
    (tmp_path / "spindle_test_sleep_plugin.py").write_text(textwrap.dedent(RECORDING_BACKEND))
    dist = tmp_path / "spindle_test_sleep_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: spindle-test-sleep-plugin\n"
                                   "Version: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nrecording = spindle_test_sleep_plugin:RecordingBackend\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("spindle_test_sleep_plugin", None)


def test_third_party_backend_from_entry_point_is_found_and_used(entry_point_plugin, tiny_model):
    backend = get_backend_class("recording")
    assert backend.__name__ == "RecordingBackend"
    import spindle_test_sleep_plugin as plugin

    with LLM(str(tiny_model("llama")), device="cpu", enable_sleep_mode=True,
             sleep_mode_backend="recording", kv_cache_memory_bytes=2**22) as llm:
        expected = texts(llm)
        llm.sleep(2)
        llm.wake_up()
        assert texts(llm) == expected
    assert plugin.CALLS == [("release", 2), ("restore", ["weights", "kv_cache"])]


def test_register_backend_in_process():
    class Mine(PortableSleepBackend):
        name = "mine"

    register_backend("mine-test", Mine)
    try:
        assert get_backend_class("mine-test") is Mine
        with pytest.raises(ValueError, match="already registered"):
            register_backend("mine-test", Mine)
    finally:
        from spindle.memory.sleep_backend import REGISTRY

        REGISTRY.unregister("mine-test")
    register_backend("not-a-backend", dict)
    try:
        with pytest.raises(ValueError, match="not a SleepModeBackend subclass"):
            get_backend_class("not-a-backend")
    finally:
        REGISTRY.unregister("not-a-backend")


# ---- cumem bookkeeping without a GPU ----------------------------------------------------------
class FakeVirtualMemory:
    """Host bytes standing in for device memory: 'physical' buffers mapped at
    reserved addresses, so unmapping really loses the content. Copies run only at
    synchronize(), as the driver's asynchronous ones may: unmapping a segment whose
    copy has not run is caught."""

    granularity = 4096

    def __init__(self) -> None:
        self.next_address = 1 << 20
        self.reserved: dict[int, int] = {}
        self.mapped: dict[int, ctypes.Array] = {}
        self.pending: list[tuple[int, Callable[[], None]]] = []

    def reserve(self, size):
        ptr, self.next_address = self.next_address, self.next_address + size
        self.reserved[ptr] = size
        return ptr

    def map_new(self, ptr, size):
        assert ptr in self.reserved and ptr not in self.mapped
        self.mapped[ptr] = (ctypes.c_uint8 * size)()  # new memory is not the old content
        ctypes.memset(self.mapped[ptr], 0xAB, size)
        return object()

    def unmap(self, ptr, size, handle):
        assert all(p != ptr for p, _ in self.pending), "unmapped before its copy ran"
        del self.mapped[ptr]

    def free_address(self, ptr, size):
        assert ptr not in self.mapped
        del self.reserved[ptr]

    def copy_to_host(self, host_ptr, ptr, size):
        self.pending.append((ptr, lambda: ctypes.memmove(host_ptr, self.mapped[ptr], size)))

    def copy_from_host(self, ptr, host_ptr, size):
        self.pending.append((ptr, lambda: ctypes.memmove(self.mapped[ptr], host_ptr, size)))

    def synchronize(self):
        pending, self.pending = self.pending, []
        for _, copy in pending:
            copy()

    def content(self, ptr, size):
        return bytes(self.mapped[ptr])[:size]


def test_tagged_segments_release_and_restore():
    vm = FakeVirtualMemory()
    segments = TaggedSegments(vm, pin_host_copies=False)
    w = segments.allocate(5000, "weights")  # rounded up to the granularity
    k = segments.allocate(4096, "kv_cache")
    assert segments.mapped_bytes("weights") == 8192 and segments.reserved_bytes() == 12288
    ctypes.memmove(vm.mapped[w], b"weights!" * 10, 80)
    freed = segments.release(["weights", "kv_cache"], keep_on_host=lambda s: s.tag == "weights")
    assert freed == 12288 and not vm.mapped and len(vm.reserved) == 2  # addresses kept
    assert segments.mapped_bytes("weights") == 0 and segments.host_bytes() == 8192
    assert segments.release(["weights"], keep_on_host=lambda s: True) == 0  # nothing mapped
    segments.restore(["kv_cache"])
    assert set(vm.mapped) == {k}
    segments.restore(["weights"])
    assert vm.content(w, 80) == b"weights!" * 10  # the same bytes at the same address
    assert segments.host_bytes() == 0
    segments.release(["kv_cache"], keep_on_host=lambda s: False)
    segments.free(k)  # freeing a released segment gives only the address back
    segments.free(w)
    assert not vm.reserved and not vm.mapped and not segments.segments
    with pytest.raises(ValueError, match="did not give out"):
        segments.free(w)
    with pytest.raises(ValueError, match="memory tags must be among"):
        segments.allocate(10, "activations")


# ---- the per-device lock -----------------------------------------------------------------------
def test_device_lock_serialises_holders():
    key = f"test-{id(object())}"
    inside = threading.Event()
    release = threading.Event()

    def hold():
        with device_lock(key):
            inside.set()
            release.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(5)
    with pytest.raises(TimeoutError, match="still held"):
        with device_lock(key, timeout=0.1):
            pass
    release.set()
    holder.join()
    with device_lock(key, timeout=1) as waited:
        assert waited < 1


def test_mm_ipc_memory_is_set_aside_before_sizing_the_kv_cache(tiny_model):
    path = str(tiny_model("llama"))
    with LLM(path, device="cpu", max_model_len=256) as plain:
        blocks = plain.engine.core.num_kv_blocks
    with LLM(path, device="cpu", max_model_len=256, mm_ipc_gpu_memory_gb=0.0001) as reserving:
        assert reserving.engine.core.num_kv_blocks < blocks
        assert "set aside by mm_ipc_gpu_memory_gb" in reserving.engine.core.startup_table


# ---- the async engine: modes with streams open -----------------------------------------------
def test_async_engine_sleep_modes_with_streams_open(tiny_model):
    import asyncio

    from spindle.config import EngineArgs
    from spindle.engine.async_llm import AsyncLLM

    path = str(tiny_model("llama"))
    with LLM(path, device="cpu", kv_cache_memory_bytes=2**22) as offline:
        expected = offline.generate(PROMPTS[0], greedy(60), use_tqdm=False)[0].outputs[0].token_ids
    engine = AsyncLLM.from_engine_args(EngineArgs(model=path, device="cpu",
                                                  enable_sleep_mode=True,
                                                  kv_cache_memory_bytes=2**22))

    async def started(prompt):
        stream = await engine.add_request(prompt, greedy(60))
        async for output in stream:
            if output.outputs[0].token_ids:
                return stream

    async def final(stream):
        return [o async for o in stream][-1].outputs[0]

    async def main():
        # wait: the request streams to its end before the engine sleeps.
        stream = await started(PROMPTS[0])
        await engine.sleep(1, "wait")
        assert await engine.is_sleeping()
        out = await asyncio.wait_for(final(stream), 5)
        assert out.token_ids == expected and out.finish_reason == "length"
        await engine.wake_up()
        # keep: frozen while asleep, finished after wake_up, same tokens.
        stream = await started(PROMPTS[0])
        await engine.sleep(2, "keep")
        kept = asyncio.ensure_future(final(stream))
        done, _ = await asyncio.wait([kept], timeout=0.3)
        assert not done  # frozen while asleep
        await engine.wake_up()
        out = await asyncio.wait_for(kept, 5)
        assert out.token_ids == expected and out.finish_reason == "length"
        # abort: the stream ends with finish reason abort.
        stream = await started(PROMPTS[1])
        await engine.sleep(1, "abort")
        assert (await final(stream)).finish_reason == "abort"
        await engine.wake_up()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown()


def test_cumem_callbacks_outlive_an_allocator_dropped_with_segments_out(monkeypatch):
    """torch may free a pool's segment after the allocator that made it is gone (an
    engine dropped without shutdown, a tensor kept past it): the C callback it calls
    then must still be alive, and still free the segment. Once every segment is back,
    the next allocator drops the retired callbacks."""
    from spindle.memory import cumem

    # (torch hands the two function addresses to its caching allocator; here, to us.)
    monkeypatch.setattr(torch._C, "_cuda_customAllocator", lambda m, f: (m, f), raising=False)
    vm = FakeVirtualMemory()
    allocator = cumem.CuMemAllocator(torch.device("cuda", 0), vm=vm)
    malloc_address, free_address = allocator._torch_allocator
    server = allocator._server
    server.tag = "weights"  # (what use_pool("weights") sets)
    ptr = cumem._MALLOC_FN(malloc_address)(5000, 0, None)  # as torch calls it
    server.tag = None
    assert ptr in vm.reserved
    del allocator
    gc.collect()
    assert server in cumem._SERVING and not server.retired  # a segment is still out
    cumem._FREE_FN(free_address)(ptr, 8192, 0, None)  # torch frees it, later
    assert not vm.reserved and server.retired
    cumem.CuMemAllocator(torch.device("cuda", 0), vm=FakeVirtualMemory())
    assert server not in cumem._SERVING
