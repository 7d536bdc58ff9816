"""The priority scheduling policy (engine/request_queue.py): a lower priority is
admitted and scheduled first, then first come, first served; when blocks run out the
lowest-priority running request is preempted first; a priority on an engine that
schedules first come, first served is refused by name."""

from __future__ import annotations

import pytest

from spindle import LLM, SamplingParams
from spindle.engine.request_queue import WaitingQueue
from test_scheduler import FakeRunner, make_request, make_scheduler, step


def _priority_scheduler(**kwargs):
    import dataclasses

    from spindle.engine.scheduler import Scheduler

    base = make_scheduler(**kwargs)
    config = dataclasses.replace(base.scheduler_config, scheduling_policy="priority")
    return Scheduler(config, base.cache_config, base.kv_cache_manager.block_pool.num_blocks)


def _request(rid: str, priority: int, arrival: float, **kwargs):
    request = make_request(rid, range(10, 18), eos=False, **kwargs)
    request.priority, request.arrival_time = priority, arrival
    return request


def test_the_queue_orders_by_priority_then_arrival():
    queue = WaitingQueue("priority")
    for rid, priority, arrival in (("a", 2, 0.0), ("b", 0, 1.0), ("c", 2, 0.5), ("d", 0, 0.2)):
        queue.add(_request(rid, priority, arrival))
    assert [r.request_id for r in queue] == ["d", "b", "a", "c"]
    queue.remove({"b"})
    assert [queue.pop().request_id for _ in range(len(queue))] == ["d", "a", "c"]
    fifo = WaitingQueue("fcfs")
    for rid in "xyz":
        fifo.add(_request(rid, 0, 0.0))
    fifo.add_front(_request("w", 0, 0.0))
    assert [r.request_id for r in fifo] == ["w", "x", "y", "z"]
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        WaitingQueue("lifo")


def test_admission_and_preemption_follow_priority():
    """Admission by priority; then, when blocks run out (6 blocks of 4 tokens, 8-token
    prompts growing), the least urgent running request is preempted, though it was
    admitted first (first come, first served would preempt the newer one)."""
    sched = _priority_scheduler(num_blocks=6, max_num_seqs=2)
    runner = FakeRunner()
    sched.add_request(_request("low", 5, 0.0, max_tokens=8))
    step(sched, runner)  # low runs alone
    for rid, priority, arrival in (("mid", 1, 2.0), ("high", 0, 1.0)):
        sched.add_request(_request(rid, priority, arrival, max_tokens=8))
    assert [r.request_id for r in sched.waiting] == ["high", "mid"]
    so, _ = step(sched, runner)
    assert [n.req_id for n in so.new_requests] == ["high"]
    assert [r.request_id for r in sched.running] == ["high", "low"]
    preempted = set()
    for _ in range(12):
        so, _ = step(sched, runner)
        preempted |= so.preempted_req_ids
        if preempted:
            break
    assert preempted == {"low"}


def test_fcfs_refuses_a_priority():
    sched = make_scheduler()
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        sched.add_request(_request("a", 3, 0.0))


def test_an_engine_admits_by_priority(tiny_model):
    """One seat: requests added before the first step finish in priority order, and
    their answers are those of an engine without priorities."""
    path = tiny_model("llama")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=64,
             max_num_seqs=1) as plain:
        expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params,
                                                                   use_tqdm=False)]
        with pytest.raises(ValueError, match="scheduling_policy='priority'"):
            plain.generate(prompts, params, use_tqdm=False, priority=1)
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=1,
             scheduling_policy="priority") as llm:
        engine = llm.engine
        for rid, prompt, priority in zip("abc", prompts, (2, 0, 1)):
            engine.add_request({"prompt_token_ids": prompt}, params, request_id=rid,
                               final_only=True, priority=priority)
        finished = []
        while engine.has_unfinished_requests():
            finished += [(o.request_id, o.outputs[0].token_ids) for o in engine.step()
                         if o.finished]
        assert [rid for rid, _ in finished] == ["b", "c", "a"]
        assert dict(finished) == dict(zip("abc", expected))
        outputs = llm.generate(prompts, params, use_tqdm=False, priority=[2, 0, 1])
        assert [o.outputs[0].token_ids for o in outputs] == expected  # (prompt order)
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(str(path), device="cpu", scheduling_policy="lifo")
