"""MultiProcExecutor on CPU (gloo): tensor-parallel parity with one rank, the
collective_rpc contract, heartbeats, and the failure paths (a worker killed, a
worker failing at load, a fatal step error, the parent killed), with checks that
no process and no shared-memory segment is left behind."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from spindle import LLM, SamplingParams
from spindle.config import EngineArgs, ParallelConfig
from spindle.distributed.shm_broadcast import SHM_PREFIX
from spindle.executor.devices import worker_device_indices
from spindle.executor.errors import ExecutorFailedError
from spindle.executor.multiproc import MultiProcExecutor
from spindle.platforms.cpu import CpuPlatform

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


# ---- helpers ----------------------------------------------------------------------------
def _engine_shm(pid: int | None = None) -> set[str]:
    pid = os.getpid() if pid is None else pid
    return {p.name for p in Path("/dev/shm").glob(f"{SHM_PREFIX}*_{pid}_*")}


def _children() -> set[int]:
    """Live child processes of this test process, except Python's resource tracker."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            if any("resource_tracker" in part for part in child.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        pids.add(child.pid)
    return pids


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive (not zombies) after waiting up to timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


def _executor(llm: LLM) -> MultiProcExecutor:
    return llm.engine.core.executor


def _token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _prompts() -> list[list[int]]:
    """Prompts sharing long prefixes (prefix-cache hits) and longer than the step
    budget used below (chunked prefill)."""
    base = [(7 * i + 3) % 500 + 5 for i in range(70)]
    return [base + [11, 12], base + [13], base[:40] + [99, 98, 97], base[:17],
            [(5 * i + 1) % 500 + 5 for i in range(90)]]


# ---- device selection ---------------------------------------------------------------------
class _FakeGpus(CpuPlatform):
    device_type = "cuda"
    workers_share_device = False

    def device_count(self) -> int:
        return 2


def _parallel(tp: int, device_ids=None) -> ParallelConfig:
    return ParallelConfig.create(EngineArgs(tensor_parallel_size=tp, device_ids=device_ids))


def test_device_selection_rank_to_device():
    assert worker_device_indices(_parallel(2), _FakeGpus()) == [0, 1]
    assert worker_device_indices(_parallel(2, [1, 0]), _FakeGpus()) == [1, 0]
    assert worker_device_indices(_parallel(2), CpuPlatform()) == [0, 0]  # workers share the host
    with pytest.raises(ValueError, match=r"device_ids \[2, 3\]: \[2, 3\] not among the 2 cuda"):
        worker_device_indices(_parallel(2, [2, 3]), _FakeGpus())
    with pytest.raises(ValueError, match="4 workers .* need 4 cuda devices, but this process sees 2"):
        worker_device_indices(_parallel(4), _FakeGpus())


def test_invalid_device_ids_fail_before_any_process_starts(tiny_model):
    path = str(tiny_model(arch="llama"))
    before = _children()
    with pytest.raises(ValueError, match=r"device_ids \[0, 1\]: \[1\] not among the 1 cpu"):
        LLM(path, device="cpu", tensor_parallel_size=2, device_ids=[0, 1])
    assert _children() == before


# ---- acceptance 1: TP=2 == TP=1 -----------------------------------------------------------
@pytest.mark.parametrize("arch,kwargs", [("llama", {}), ("qwen3", {"num_kv_heads": 1})],
                         ids=["llama-kv2-split", "qwen3-kv1-replicated"])
def test_tp2_greedy_matches_tp1(tiny_model, arch, kwargs):
    path = str(tiny_model(arch=arch, **kwargs))
    engine_args = dict(device="cpu", max_model_len=256, max_num_batched_tokens=32,
                       enable_chunked_prefill=True, enable_prefix_caching=True)
    prompts = _prompts()
    with LLM(path, **engine_args) as llm:
        expected = _token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
        # A second pass hits the prefix cache for whole prompts.
        assert _token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        tp1_block_bytes = llm.engine.core.executor.cache_requirements()[0].block_bytes
        tp1_params = llm.engine.core.executor.collective_rpc(_num_params)[0]
    with LLM(path, tensor_parallel_size=2, **engine_args) as llm:
        executor = _executor(llm)
        assert isinstance(executor, MultiProcExecutor)
        assert _token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert _token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        # Each rank holds only its shard of the weights and of the KV cache.
        kv_heads = kwargs.get("num_kv_heads", 2)
        shard = 2 if kv_heads >= 2 else 1  # one KV head is replicated, not split
        assert [r.block_bytes for r in executor.cache_requirements()] == \
            [tp1_block_bytes // shard] * 2
        rank_params = executor.collective_rpc(_num_params)
        assert all(p < 0.6 * tp1_params for p in rank_params)


def _num_params(worker) -> int:
    return sum(p.numel() for p in worker.runner.model.parameters())


# ---- the collective_rpc contract ------------------------------------------------------------
@pytest.fixture(scope="module")
def executor(tiny_model):
    config = EngineArgs(model=str(tiny_model(arch="llama")), device="cpu", max_model_len=128,
                        tensor_parallel_size=2).create_engine_config()
    ex = MultiProcExecutor(config)
    yield ex
    ex.shutdown()


def test_rpc_by_name_by_callable_and_unique_reply(executor):
    assert executor.collective_rpc("check_health") == [True, True]
    assert executor.collective_rpc(lambda w: w.rank * 10) == [0, 10]
    assert executor.collective_rpc(lambda w, x, y=0: w.rank + x + y, args=(5,),
                                   kwargs={"y": 100}) == [105, 106]
    assert executor.collective_rpc(lambda w: w.rank, unique_reply_rank=1) == 1
    # Workers split the host's cores instead of oversubscribing them.
    cores = len(os.sched_getaffinity(0))
    assert executor.collective_rpc(lambda w: torch.get_num_threads()) == [max(1, cores // 2)] * 2


def test_cpu_threads_sets_each_workers_threads(tiny_model):
    config = EngineArgs(model=str(tiny_model(arch="llama")), device="cpu", max_model_len=128,
                        tensor_parallel_size=2, cpu_threads=1).create_engine_config()
    ex = MultiProcExecutor(config)
    try:
        assert ex.collective_rpc(lambda w: torch.get_num_threads()) == [1, 1]
    finally:
        ex.shutdown()


def test_non_block_futures_resolve_in_call_order(executor):
    def slow_on_rank_0(w, i):
        if w.rank == 0 and i == 0:
            time.sleep(0.3)
        return (w.rank, i)

    futures = [executor.collective_rpc(slow_on_rank_0, args=(i,), non_block=True)
               for i in range(4)]
    assert not futures[0].done()
    # Asking for the last one resolves all earlier ones first.
    assert futures[3].result(timeout=10) == [(0, 3), (1, 3)]
    assert all(f.done() for f in futures)
    assert [f.result() for f in futures] == [[(0, i), (1, i)] for i in range(4)]


def test_timeout_names_the_silent_rank_and_where_it_is(executor):
    def stuck_on_rank_1(w):
        if w.rank == 1:
            time.sleep(1.5)
        return w.rank

    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] did not answer within 0.4s") as info:
        executor.collective_rpc(stuck_on_rank_1, timeout=0.4)
    assert time.monotonic() - start < 1.4  # (rank 1 sleeps 1.5 s)
    assert "rank 1 in stuck_on_rank_1" in str(info.value)
    # The heartbeat, read from shared memory while the rank is busy: where and how long.
    beats = executor.heartbeats()
    assert beats[1].busy and beats[1].last_stage == "stuck_on_rank_1"
    assert not beats[0].busy
    time.sleep(0.3)
    assert executor.heartbeats()[1].seconds_since > beats[1].seconds_since
    # The late reply is dropped; the next call gets its own replies.
    assert executor.collective_rpc(lambda w: ("after", w.rank), timeout=10) == [("after", 0),
                                                                               ("after", 1)]
    # A call's timeout holds even while an earlier call is still pending.
    stuck = executor.collective_rpc(stuck_on_rank_1, non_block=True)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] did not answer within 0.2s"):
        executor.check_health(timeout=0.2)
    assert time.monotonic() - start < 1.4
    assert stuck.result(timeout=10) == [0, 1]
    executor.check_health(timeout=10)


def test_a_non_fatal_rpc_error_is_reported_and_serving_goes_on(executor):
    def fails_on_rank_1(w):
        if w.rank == 1:
            raise ValueError("bad input on one rank")
        return "ok"

    with pytest.raises(RuntimeError, match="worker rank 1: .* raised ValueError: bad input on one rank"):
        executor.collective_rpc(fails_on_rank_1)
    with pytest.raises(RuntimeError, match="AttributeError"):
        executor.collective_rpc("no_such_method")
    with pytest.raises(RuntimeError, match="sending the reply"):
        executor.collective_rpc(lambda w: threading.Lock())  # a reply that cannot be pickled
    assert executor.collective_rpc("check_health") == [True, True]
    assert executor.failure is None


# ---- acceptance 2: a worker killed mid-generate ------------------------------------------------
def test_sigkill_of_a_worker_mid_generate_fails_fast_and_leaves_nothing(tiny_model):
    shm_before = _engine_shm()
    llm = LLM(str(tiny_model(arch="llama")), device="cpu", tensor_parallel_size=2,
              max_model_len=512)
    executor = _executor(llm)
    pids = executor.worker_pids
    assert len(_engine_shm() - shm_before) == 2  # the ring and the heartbeat board
    calls = []
    executor.register_failure_callback(lambda: calls.append(time.monotonic()))
    killed_at = {}

    def kill_rank_1_after_a_few_steps():
        while min(b.last_step for b in llm.heartbeats()) < 5:
            time.sleep(0.002)
        killed_at["t"] = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_1_after_a_few_steps, daemon=True)
    killer.start()
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    with pytest.raises(ExecutorFailedError) as info:
        llm.generate([[i + 5] * 8 for i in range(32)], params, use_tqdm=False)
    raised_after = time.monotonic() - killed_at["t"]
    message = str(info.value)
    print(f"raised {raised_after * 1000:.1f} ms after the SIGKILL: {message}")
    assert raised_after < 2.0, raised_after
    assert "worker rank 1" in message and "SIGKILL" in message and "-9" in message
    assert info.value.rank == 1 and info.value.exitcode == -9
    # The rest is shut down without anyone calling shutdown(): no process, no segment.
    assert wait_gone(pids, 5.0) == []
    deadline = time.monotonic() + 5
    while _engine_shm() - shm_before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _engine_shm() - shm_before == set()
    assert len(calls) == 1  # failure callbacks run once
    # Later calls fail at once, with the same cause.
    start = time.monotonic()
    with pytest.raises(ExecutorFailedError, match="worker rank 1 .*SIGKILL"):
        llm.generate("hello", GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 0.1
    assert not llm.engine.has_unfinished_requests()
    llm.shutdown()
    assert wait_gone(pids, 1.0) == []


# ---- a fatal error inside a step ----------------------------------------------------------------
def test_a_fatal_step_error_is_reported_and_the_worker_exits(tiny_model):
    llm = LLM(str(tiny_model(arch="llama")), device="cpu", tensor_parallel_size=2,
              max_model_len=256)
    executor = _executor(llm)
    pids = executor.worker_pids

    def break_rank_1(w):
        if w.rank == 1:
            def fail(sched):
                raise RuntimeError("injected step failure")
            w.execute_model = fail

    executor.collective_rpc(break_rank_1)
    start = time.monotonic()
    with pytest.raises(ExecutorFailedError, match="worker rank 1 .*injected step failure") as info:
        llm.generate("hello", GREEDY, use_tqdm=False)
    print(f"raised after {time.monotonic() - start:.3f}s: {str(info.value)[:300]}")
    assert time.monotonic() - start < 2.0
    assert wait_gone(pids, 5.0) == []
    llm.shutdown()


def test_a_hung_step_times_out_naming_where_every_rank_is(tiny_model):
    llm = LLM(str(tiny_model(arch="llama")), device="cpu", tensor_parallel_size=2,
              max_model_len=256, step_timeout_s=1.0)
    executor = _executor(llm)
    pids = executor.worker_pids

    def hang_rank_1(w):
        if w.rank == 1:
            def hang(sched):
                time.sleep(60)
            w.execute_model = hang

    executor.collective_rpc(hang_rank_1)
    start = time.monotonic()
    with pytest.raises(ExecutorFailedError, match="did not finish within 1s") as info:
        llm.generate("hello", GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 3.0
    assert "rank 1 in execute_model" in str(info.value)
    assert wait_gone(pids, 5.0) == []
    llm.shutdown()


# ---- acceptance 3: a worker failing at load -------------------------------------------------------
def test_a_corrupt_shard_fails_startup_fast_with_the_workers_message(tiny_model, tmp_path):
    src = tiny_model(arch="llama")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64 + b"not a safetensors file")
    before, shm_before = _children(), _engine_shm()
    start = time.monotonic()
    with pytest.raises(ExecutorFailedError, match="worker rank [01] failed during startup") as info:
        LLM(str(tmp_path), device="cpu", tensor_parallel_size=2, max_model_len=128)
    elapsed = time.monotonic() - start
    print(f"startup failed after {elapsed:.2f}s: {str(info.value)[:200]}")
    assert elapsed < 5.0, elapsed
    assert "cannot read checkpoint shard" in str(info.value)
    assert wait_gone(list(_children() - before), 2.0) == []
    assert _engine_shm() - shm_before == set()


# ---- acceptance 4: the parent killed ----------------------------------------------------------------
_PARENT_SCRIPT = """
import json, sys, time
from spindle import LLM

if __name__ == "__main__":
    engines = [LLM(sys.argv[1], device="cpu", tensor_parallel_size=2, max_model_len=128,
                   worker_start_method=sys.argv[2]) for _ in range(int(sys.argv[3]))]
    executors = [llm.engine.core.executor for llm in engines]
    print(json.dumps([sum((e.worker_pids for e in executors), []),
                      [e._run_dir for e in executors]]), flush=True)
    time.sleep(600)
"""


# Forked: two engines, so that a worker of the second, which copies the first one's
# pipe ends, must close them (or the first one's workers would never read EOF).
@pytest.mark.parametrize("start_method,engines", [("fork", 2), ("spawn", 1)])
def test_workers_exit_when_the_parent_is_killed(tiny_model, tmp_path, start_method, engines):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(_PARENT_SCRIPT))
    parent = subprocess.Popen([sys.executable, str(script), str(tiny_model(arch="llama")),
                               start_method, str(engines)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        pids, run_dirs = json.loads(parent.stdout.readline())
        assert len(pids) == 2 * engines and all(psutil.pid_exists(p) for p in pids)
        parent.kill()
        killed_at = time.monotonic()
        parent.wait(5)
        assert wait_gone(pids, 5.0) == []
        print(f"workers gone {time.monotonic() - killed_at:.3f}s after the parent's SIGKILL")
        assert not any(Path(d).exists() for d in run_dirs)  # the rendezvous stores too
        # Python's resource tracker unlinks the segments the dead parent registered.
        deadline = time.monotonic() + 10
        while _engine_shm(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _engine_shm(parent.pid) == set()
    finally:
        if parent.poll() is None:
            parent.kill()


# ---- acceptance 5: two engines at once ----------------------------------------------------------------
def test_two_tp2_engines_run_at_the_same_time(tiny_model):
    path = str(tiny_model(arch="llama"))
    prompts = _prompts()
    with LLM(path, device="cpu", max_model_len=256) as llm:
        expected = _token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    engines = [LLM(path, device="cpu", tensor_parallel_size=2, max_model_len=256)
               for _ in range(2)]
    try:
        a, b = (_executor(e) for e in engines)
        assert not set(a.worker_pids) & set(b.worker_pids)
        assert a.ring.name != b.ring.name and a._run_dir != b._run_dir
        results: dict[int, list] = {}

        def run(i: int) -> None:
            results[i] = [_token_ids(engines[i].generate(prompts, GREEDY, use_tqdm=False))
                          for _ in range(2)]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results == {0: [expected, expected], 1: [expected, expected]}
    finally:
        for e in engines:
            e.shutdown()


def test_an_engine_dropped_without_shutdown_stops_its_workers(tiny_model):
    """The last reference to an LLM going away shuts it down: its workers exit and its
    shared memory is gone, as after shutdown()."""
    before = _engine_shm()  # (other tests' engines may be alive in this process)
    llm = LLM(str(tiny_model(arch="llama")), device="cpu", tensor_parallel_size=2,
              max_model_len=256)
    pids = list(_executor(llm).worker_pids)
    own_shm = _engine_shm() - before
    assert pids and own_shm
    assert len(llm.generate(_prompts(), GREEDY, use_tqdm=False)) == len(_prompts())
    del llm
    gc.collect()
    assert wait_gone(pids, timeout=30) == []
    assert not own_shm & _engine_shm()
