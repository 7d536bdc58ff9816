"""RayExecutor on a Ray instance started on loopback: PP=2 (and PP=2 x TP=2) greedy
parity with the uni executor, a killed actor failing fast, a stage that stops
answering failing within the step timeout, shutdown releasing the placement group
(and stopping a Ray instance the executor started itself).
Skipped where Ray is not installed (pip install 'spindle-llm[ray]')."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

# Before Ray is imported: no token auth for the test instance, and a node address of
# 127.0.0.1 kept as such (Ray otherwise swaps loopback for the host's address).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from spindle import LLM, SamplingParams  # noqa: E402
from spindle.executor.errors import ExecutorFailedError  # noqa: E402
from test_pipeline_parallel import (ENGINE_ARGS, GREEDY, generate_errors_in_thread,  # noqa: E402
                                    hang_rank_on_step, prompts, token_ids, uni_reference)

try:
    import ray
except ImportError:
    ray = None

needs_ray = pytest.mark.skipif(ray is None, reason="Ray is not installed "
                               "(pip install 'spindle-llm[ray]')")


def _eventually(check, timeout: float = 10.0) -> bool:
    """Whether check() holds within timeout: callbacks and the release of the actors
    run on the executor's failure thread, after the caller has its error."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _removed(group) -> bool:
    return ray.util.placement_group_table(group)["state"] == "REMOVED"


@pytest.fixture(scope="module")
def ray_local():
    """One loopback Ray instance (4 logical CPUs: a PP=2 x TP=2 placement) for the module."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=4,
             object_store_memory=80 * 2**20, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_choosing_ray_without_ray_says_how_to_install(tiny_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'spindle-llm\[ray\]'"):
        LLM(str(tiny_model(arch="llama")), device="cpu", pipeline_parallel_size=2,
            distributed_executor_backend="ray", max_model_len=128)


@needs_ray
@pytest.mark.parametrize("arch,tp", [("llama", 1), ("qwen3", 1), ("llama", 2), ("qwen3", 2)],
                         ids=["llama-pp2", "qwen3-pp2", "llama-pp2-tp2", "qwen3-pp2-tp2"])
def test_ray_pp2_greedy_matches_uni(tiny_model, ray_local, arch, tp):
    path = str(tiny_model(arch=arch, num_layers=4))
    expected = uni_reference(path)
    with LLM(path, pipeline_parallel_size=2, tensor_parallel_size=tp,
             distributed_executor_backend="ray", **ENGINE_ARGS) as llm:
        executor = llm.engine.core.executor
        assert type(executor).__name__ == "RayExecutor" and not executor.owns_ray
        assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == expected
        assert [n["ip"] for n in executor.nodes] == ["127.0.0.1"] * 2 * tp
        group = executor.placement_group
        assert ray.util.placement_group_table(group)["strategy"] == "PACK"
        assert executor.collective_rpc("check_health") == [True] * 2 * tp
    # Shutdown removed the actors and the placement group.
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"
    assert executor.actors == []


@needs_ray
def test_killed_actor_mid_generate_fails_fast_and_releases_the_group(tiny_model, ray_local):
    llm = LLM(str(tiny_model(arch="llama", num_layers=4)), device="cpu",
              pipeline_parallel_size=2, distributed_executor_backend="ray", max_model_len=1024)
    executor = llm.engine.core.executor
    group = executor.placement_group
    pid = executor.nodes[1]["pid"]
    calls, killed_at = [], {}
    executor.register_failure_callback(lambda: calls.append(1))

    def kill_rank_1_soon():
        time.sleep(1.0)
        killed_at["t"] = time.monotonic()
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill_rank_1_soon, daemon=True).start()
    params = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
    with pytest.raises(ExecutorFailedError, match="worker rank 1 .*died") as info:
        llm.generate([[i + 5] * 8 for i in range(16)], params, use_tqdm=False)
    raised_after = time.monotonic() - killed_at["t"]
    print(f"raised {raised_after:.2f}s after the SIGKILL: {info.value}")
    assert raised_after < 5.0
    assert info.value.rank == 1
    assert _eventually(lambda: calls == [1] and _removed(group))
    start = time.monotonic()
    with pytest.raises(ExecutorFailedError, match="worker rank 1"):
        llm.generate("hello", GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 1.0
    llm.shutdown()


@needs_ray
def test_check_health_detects_a_dead_actor(tiny_model, ray_local):
    llm = LLM(str(tiny_model(arch="llama", num_layers=4)), device="cpu",
              pipeline_parallel_size=2, distributed_executor_backend="ray", max_model_len=128)
    executor = llm.engine.core.executor
    group = executor.placement_group
    executor.check_health()
    os.kill(executor.nodes[0]["pid"], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(ExecutorFailedError, match="worker rank 0"):
        executor.check_health(timeout=5.0)
    assert time.monotonic() - start < 5.0
    assert _eventually(lambda: _removed(group))
    llm.shutdown()


@needs_ray
def test_a_stage_that_stops_answering_fails_within_the_step_timeout(tiny_model, ray_local):
    llm = LLM(str(tiny_model(arch="llama", num_layers=4)), pipeline_parallel_size=2,
              distributed_executor_backend="ray", step_timeout_s=2.0, **ENGINE_ARGS)
    executor = llm.engine.core.executor
    group = executor.placement_group
    executor.collective_rpc(hang_rank_on_step(rank=0, step=3))
    errors = generate_errors_in_thread(llm, wait=60.0)
    assert len(errors) == 1 and isinstance(errors[0], ExecutorFailedError), errors
    assert "did not finish within 2s (step_timeout_s)" in str(errors[0])
    assert "rank(s) [0, 1] did not answer" in str(errors[0])  # rank 1 waits for rank 0
    assert _eventually(lambda: _removed(group))  # the hung actor is killed too
    llm.shutdown()


@needs_ray
def test_a_ray_instance_the_executor_started_is_stopped(tiny_model, ray_local):
    ray.shutdown()  # (the module's instance; the fixture's teardown is then a no-op)
    path = str(tiny_model(arch="llama", num_layers=4))
    expected = uni_reference(path)
    with LLM(path, pipeline_parallel_size=2, distributed_executor_backend="ray",
             **ENGINE_ARGS) as llm:
        assert llm.engine.core.executor.owns_ray and ray.is_initialized()
        assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == expected
    assert not ray.is_initialized()


def test_rank_order_keeps_nodes_contiguous_and_tp_groups_on_one_node():
    from spindle.executor.ray_executor import check_tp_groups_within_nodes, rank_order

    infos = [{"node_id": n, "gpu_ids": g} for n, g in
             [("B", ["1"]), ("A", ["3"]), ("B", ["0"]), ("A", ["2"])]]
    order = rank_order(infos, driver_node_id="A")  # the driver's node first, GPUs in order
    assert [(infos[i]["node_id"], infos[i]["gpu_ids"][0]) for i in order] == \
        [("A", "2"), ("A", "3"), ("B", "0"), ("B", "1")]
    check_tp_groups_within_nodes(["A", "A", "B", "B"], tp=2)
    with pytest.raises(ValueError, match="ranks 2..3 would span 2 nodes"):
        check_tp_groups_within_nodes(["A", "A", "A", "B"], tp=2)
