"""Scheduler: token budget, chunked prefill, preemption, stops, aborts.

The runner is simulated by FakeRunner, which keeps the state a real model runner
would (tokens and block table per request, built only from SchedulerOutputs) and a
fake KV cache that stores, at each slot, the token id whose KV it would hold. Every
step it writes the scheduled tokens, then checks that each scheduled request's
whole context reads back its own tokens: this catches wrong block tables, blocks
shared by mistake, bad prefix hits and wrong num_computed_tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from spindle.config import CacheConfig, SchedulerConfig
from spindle.engine.request import Request, RequestStatus
from spindle.engine.scheduler import Scheduler
from spindle.sampling_params import SamplingParams
from spindle.step_messages import ModelRunnerOutput, SampledLogprobs, SchedulerOutput

BS = 4
EOS = 2


def make_scheduler(num_blocks: int = 64, block_size: int = BS, max_num_seqs: int = 16,
                   budget: int = 64, chunked: bool = True, caching: bool = True,
                   max_model_len: int = 1024) -> Scheduler:
    sched_cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                max_model_len=max_model_len, enable_chunked_prefill=chunked)
    cache_cfg = CacheConfig(block_size=block_size, enable_prefix_caching=caching,
                            kv_cache_memory_bytes=None, gpu_memory_utilization=0.9)
    return Scheduler(sched_cfg, cache_cfg, num_blocks)


def make_request(rid: str, prompt, max_tokens: int = 8, eos: bool = True,
                 **params) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, **params)
    if eos:
        sp = sp.with_eos({EOS})
    return Request(rid, list(prompt), sp, max_tokens)


@dataclass
class RunnerState:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int


class FakeRunner:
    def __init__(self, block_size: int = BS, next_token=None, logprobs: bool = False):
        self.block_size = block_size
        self.reqs: dict[str, RunnerState] = {}
        self.kv: dict[int, int] = {}  # slot -> token id whose KV is there
        # next_token(req_id, tokens so far) -> sampled token id.
        self.next_token = next_token or (lambda rid, tokens: 100 + len(tokens))
        self.logprobs = logprobs

    def _slot(self, st: RunnerState, pos: int) -> int:
        return st.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(rid, None)
        for nr in so.new_requests:
            assert nr.req_id not in self.reqs, "new request the runner already holds"
            (block_ids,) = nr.block_ids  # one cache group
            assert len(set(block_ids)) == len(block_ids)
            self.reqs[nr.req_id] = RunnerState(list(nr.token_ids), list(block_ids),
                                               nr.num_computed_tokens)
        for cr in so.cached_requests:
            st = self.reqs[cr.req_id]
            assert st.num_computed == cr.num_computed_tokens
            (new_block_ids,) = cr.new_block_ids
            st.block_ids.extend(new_block_ids)
            assert len(set(st.block_ids)) == len(st.block_ids)
        sent = [r.req_id for r in so.new_requests] + [r.req_id for r in so.cached_requests]
        assert sorted(sent) == sorted(so.num_scheduled_tokens)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())

        written: set[int] = set()
        for rid, n in so.num_scheduled_tokens.items():  # write all KV of the step...
            st = self.reqs[rid]
            end = st.num_computed + n
            assert n >= 1 and end <= len(st.tokens)
            assert len(st.block_ids) * self.block_size >= end, "not enough blocks"
            for pos in range(st.num_computed, end):
                slot = self._slot(st, pos)
                assert slot not in written, "two requests write one slot"
                written.add(slot)
                self.kv[slot] = st.tokens[pos]
        out = ModelRunnerOutput()
        for rid, n in so.num_scheduled_tokens.items():  # ...then attend
            st = self.reqs[rid]
            end = st.num_computed + n
            context = [self.kv.get(self._slot(st, p)) for p in range(end)]
            assert context == st.tokens[:end], f"{rid}: KV cache does not hold its tokens"
            st.num_computed = end
            if end == len(st.tokens):
                tok = self.next_token(rid, st.tokens)
                st.tokens.append(tok)
                out.req_ids.append(rid)
                out.sampled_token_ids.append([tok])
                out.logprobs.append([SampledLogprobs([tok], [-0.5], 1)] if self.logprobs else [])
        return out


def step(sched: Scheduler, runner: FakeRunner):
    so = sched.schedule()
    assert so.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert sched.num_running <= sched.max_num_seqs
    ro = runner.execute(so)
    return so, sched.update_from_output(so, ro)


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000):
    outputs = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outputs
        _, outs = step(sched, runner)
        for o in outs:
            outputs.setdefault(o.req_id, []).append(o)
    raise AssertionError("requests did not finish")


def script(tokens_by_req: dict[str, list[int]]):
    """next_token that replays a fixed list of outputs per request."""
    def next_token(rid, tokens):
        return tokens_by_req[rid].pop(0)
    return next_token


# ------------------------------------------------------------------- basics

def test_empty_schedule():
    sched = make_scheduler()
    so = sched.schedule()
    assert so.is_empty and so.step_id == 1
    assert sched.update_from_output(so, ModelRunnerOutput()) == []
    assert sched.schedule().step_id == 2
    assert not sched.has_unfinished_requests()


def test_prefill_then_decode():
    sched, runner = make_scheduler(), FakeRunner()
    req = make_request("a", range(10, 20), max_tokens=3)
    sched.add_request(req)
    assert sched.num_waiting == 1 and sched.get_num_unfinished_requests() == 1

    so, outs = step(sched, runner)
    (nr,) = so.new_requests
    assert nr.req_id == "a" and nr.token_ids == list(range(10, 20))
    assert nr.num_prompt_tokens == 10 and nr.num_computed_tokens == 0
    assert nr.block_ids == [[0, 1, 2]]
    assert so.num_scheduled_tokens == {"a": 10} and so.cached_requests == []
    assert req.status == RequestStatus.RUNNING and sched.num_running == 1
    assert [o.new_token_ids for o in outs] == [[110]]
    assert req.num_computed_tokens == 10 and req.num_tokens == 11

    so, outs = step(sched, runner)
    (cr,) = so.cached_requests
    assert so.new_requests == []
    assert (cr.req_id, cr.num_computed_tokens, cr.new_block_ids) == ("a", 10, [[]])
    assert so.num_scheduled_tokens == {"a": 1}

    so, outs = step(sched, runner)
    (out,) = outs
    assert out.finished and out.finish_reason == "length"
    assert req.output_token_ids == [110, 111, 112]
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_usage == 0.0
    assert sched.schedule().finished_req_ids == {"a"}
    assert sched.schedule().finished_req_ids == set()


def test_num_computed_advances_at_schedule_time():
    sched = make_scheduler()
    req = make_request("a", range(6))
    sched.add_request(req)
    sched.schedule()
    assert req.num_computed_tokens == 6
    # Without the sampled token back, there is nothing to schedule for it.
    assert sched.schedule().num_scheduled_tokens == {}


def test_duplicate_and_invalid_requests_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2]))
    with pytest.raises(ValueError):
        sched.add_request(make_request("a", [3]))
    with pytest.raises(ValueError):
        sched.add_request(make_request("b", []))


# ----------------------------------------------------------- token budget

def test_token_budget_and_chunking_across_requests():
    sched, runner = make_scheduler(budget=10), FakeRunner()
    for rid in "abc":
        sched.add_request(make_request(rid, [ord(rid)] * 8, max_tokens=4))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 8, "b": 2}
    so, _ = step(sched, runner)
    # Running first (a decodes, b continues its prefill), then c gets the rest.
    assert so.num_scheduled_tokens == {"a": 1, "b": 6, "c": 3}
    assert [r.req_id for r in so.new_requests] == ["c"]
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 5}


def test_chunked_prefill_across_steps_samples_only_at_the_end():
    sched, runner = make_scheduler(budget=10), FakeRunner()
    req = make_request("a", range(25), max_tokens=2)
    sched.add_request(req)
    seen = []
    for _ in range(3):
        so, outs = step(sched, runner)
        seen.append((so.num_scheduled_tokens["a"],
                     [c.num_computed_tokens for c in so.cached_requests], outs))
    assert [s[0] for s in seen] == [10, 10, 5]
    assert [s[1] for s in seen] == [[], [10], [20]]
    assert seen[0][2] == [] and seen[1][2] == []
    assert seen[2][2][0].new_token_ids == [125]
    assert req.num_cached_tokens == 0


def test_chunked_prefill_off_admits_only_whole_prompts_fcfs():
    sched, runner = make_scheduler(budget=10, chunked=False), FakeRunner()
    sched.add_request(make_request("a", [1] * 6))
    sched.add_request(make_request("b", [2] * 6))
    sched.add_request(make_request("c", [3] * 2))
    so, _ = step(sched, runner)
    # b does not fit in the 4 tokens left; c must not jump the queue.
    assert so.num_scheduled_tokens == {"a": 6}
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 6, "c": 2}


def test_mixed_prefill_and_decode_in_one_step():
    sched, runner = make_scheduler(budget=16), FakeRunner()
    sched.add_request(make_request("a", range(5), max_tokens=10))
    step(sched, runner)
    sched.add_request(make_request("b", range(50, 70), max_tokens=10))
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 15}
    assert [c.req_id for c in so.cached_requests] == ["a"]
    assert [n.req_id for n in so.new_requests] == ["b"]
    assert [o.req_id for o in outs] == ["a"]  # b's partial chunk samples nothing
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 5}
    assert sorted(o.req_id for o in outs) == ["a", "b"]


def test_max_num_seqs():
    sched, runner = make_scheduler(max_num_seqs=2), FakeRunner()
    for rid in "abc":
        sched.add_request(make_request(rid, [7, 8, 9], max_tokens=2))
    so, _ = step(sched, runner)
    assert sorted(so.num_scheduled_tokens) == ["a", "b"]
    assert sched.num_running == 2 and sched.num_waiting == 1
    so, _ = step(sched, runner)  # a and b finish here
    assert sorted(so.num_scheduled_tokens) == ["a", "b"]
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"c": 3}
    assert so.finished_req_ids == {"a", "b"}


# ------------------------------------------------------------ prefix cache

def test_prefix_hit_for_later_request():
    sched, runner = make_scheduler(), FakeRunner()
    shared = list(range(30, 42))  # 3 full blocks
    sched.add_request(make_request("a", shared + [1, 2]))
    step(sched, runner)
    b = make_request("b", shared + [5])
    sched.add_request(b)
    so, _ = step(sched, runner)
    (nr,) = so.new_requests
    assert nr.num_computed_tokens == 12
    assert so.num_scheduled_tokens["b"] == 1
    assert b.num_cached_tokens == 12
    assert sched.prefix_cache_stats.hits == 12
    assert sched.prefix_cache_stats.queries == 14 + 13


def test_identical_prompts_in_one_step_share_blocks():
    sched, runner = make_scheduler(), FakeRunner()
    sched.add_request(make_request("a", range(9)))
    sched.add_request(make_request("b", range(9)))
    so, _ = step(sched, runner)
    new = {n.req_id: n for n in so.new_requests}
    assert new["b"].num_computed_tokens == 8
    assert new["b"].block_ids[0][:2] == new["a"].block_ids[0][:2]
    assert so.num_scheduled_tokens == {"a": 9, "b": 1}
    step(sched, runner)  # the fake runner's KV check passes for both


def test_reset_prefix_cache():
    sched, runner = make_scheduler(), FakeRunner()
    sched.add_request(make_request("a", range(9), max_tokens=1))
    step(sched, runner)
    assert sched.reset_prefix_cache() is True  # a finished: nothing held
    sched.add_request(make_request("b", range(9), max_tokens=1))
    so = sched.schedule()
    assert so.new_requests[0].num_computed_tokens == 0
    assert sched.reset_prefix_cache() is False


# -------------------------------------------------------------- preemption

def test_preemption_and_resume_with_all_tokens_and_prefix_hits():
    # 6 blocks of 4. a and b take 2 blocks each for their 7-token prompts.
    sched, runner = make_scheduler(num_blocks=6), FakeRunner()
    a = make_request("a", range(7), max_tokens=8)
    b = make_request("b", range(200, 207), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)  # both prefilled, 8 tokens each
    preempted_so = None
    for _ in range(20):
        so, _ = step(sched, runner)
        if so.preempted_req_ids:
            preempted_so = so
            break
    assert preempted_so is not None
    # The most recently admitted request (b) goes; a keeps running.
    assert preempted_so.preempted_req_ids == {"b"}
    assert "a" in preempted_so.num_scheduled_tokens
    assert "b" not in preempted_so.num_scheduled_tokens
    assert preempted_so.new_requests == []  # no admissions in a preempting step
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert b.num_computed_tokens == 0
    assert list(sched.waiting) == [b]
    tokens_at_preemption = list(b.all_token_ids)
    assert b.num_output_tokens > 0

    hits_before = sched.prefix_cache_stats.hits
    resumed = None
    for _ in range(20):
        so, _ = step(sched, runner)
        if so.new_requests:
            resumed = so
            break
    (nr,) = resumed.new_requests
    assert nr.req_id == "b"
    assert nr.token_ids == tokens_at_preemption  # prompt + outputs so far
    assert nr.num_prompt_tokens == 7
    assert nr.num_computed_tokens > 0  # its head blocks were still cached
    assert sched.prefix_cache_stats.hits - hits_before == nr.num_computed_tokens
    assert resumed.num_scheduled_tokens["b"] == len(tokens_at_preemption) - nr.num_computed_tokens
    outs = run_to_completion(sched, runner)
    assert b.num_output_tokens == 8 and a.num_output_tokens == 8
    assert b.status == RequestStatus.FINISHED_LENGTH
    # Outputs are the same as without preemption (the fake model is deterministic).
    assert b.output_token_ids == [100 + n for n in range(7, 15)]
    assert sched.kv_cache_manager.num_free_blocks == 6
    assert "b" in outs


def test_request_preempts_itself_when_it_is_the_last_candidate():
    # 5 blocks: a, b hold 2 each (8 tokens). Next decode: both need a third block.
    sched, runner = make_scheduler(num_blocks=5), FakeRunner()
    a = make_request("a", range(7), max_tokens=4)
    b = make_request("b", range(100, 107), max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)  # 8 tokens each, 7 computed
    step(sched, runner)  # 9 tokens each, 8 computed
    so, _ = step(sched, runner)
    # a takes the last free block; b cannot get one and is the last candidate.
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.preempted_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and sched.num_running == 1
    run_to_completion(sched, runner)
    assert a.num_output_tokens == 4 and b.num_output_tokens == 4


def test_no_admission_in_a_preempting_step():
    """b has a's prompt and (deterministic fake model) a's outputs, so once
    preempted it could come back at once from prefix hits on a's blocks plus one
    block: the step that preempted it must still admit nobody."""
    sched, runner = make_scheduler(num_blocks=5, max_num_seqs=2), FakeRunner()
    a = make_request("a", range(8), max_tokens=12)
    b = make_request("b", range(8), max_tokens=12)
    c = make_request("c", [50, 51, 52], max_tokens=1)
    for r in (a, b, c):
        sched.add_request(r)
    for _ in range(30):
        so, _ = step(sched, runner)
        if so.preempted_req_ids:
            break
    assert so.preempted_req_ids == {"b"}
    assert so.new_requests == [] and sched.num_running == 1
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    so, _ = step(sched, runner)
    (nr,) = so.new_requests  # max_num_seqs=2: b back (first in line), c waits
    assert nr.req_id == "b" and nr.num_computed_tokens == 12
    run_to_completion(sched, runner)
    assert [r.num_output_tokens for r in (a, b, c)] == [12, 12, 1]


def test_preemption_without_prefix_caching_recomputes_everything():
    sched, runner = make_scheduler(num_blocks=5, caching=False), FakeRunner()
    a = make_request("a", range(7), max_tokens=6)
    b = make_request("b", range(100, 107), max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    resumed = []
    for _ in range(50):
        if not sched.has_unfinished_requests():
            break
        so, _ = step(sched, runner)
        resumed += [n for n in so.new_requests if n.req_id == "b" and n.token_ids != list(range(100, 107))]
    assert resumed and all(n.num_computed_tokens == 0 for n in resumed)
    assert b.num_preemptions >= 1
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6


# ----------------------------------------------------------------- aborts

def test_abort_between_schedule_and_update():
    sched, runner = make_scheduler(), FakeRunner()
    a = make_request("a", range(5))
    b = make_request("b", range(5, 10))
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    ro = runner.execute(so)
    sched.abort_requests(["a"])
    assert a.status == RequestStatus.FINISHED_ABORTED
    outs = sched.update_from_output(so, ro)
    assert [o.req_id for o in outs] == ["b"]
    assert a.num_output_tokens == 0
    assert sched.num_running == 1
    so2 = sched.schedule()
    assert so2.finished_req_ids == {"a"}
    assert sched.schedule().finished_req_ids == set()
    assert sched.kv_cache_manager.get_block_ids("a") == [[]]


def test_abort_waiting_running_and_unknown():
    sched, runner = make_scheduler(max_num_seqs=1), FakeRunner()
    sched.add_request(make_request("a", range(5)))
    sched.add_request(make_request("b", range(5)))
    step(sched, runner)
    sched.abort_requests("b")  # waiting
    sched.abort_requests(["a", "nope"])  # running + unknown
    sched.abort_requests("a")  # twice is fine
    assert not sched.has_unfinished_requests()
    assert sched.num_waiting == 0 and sched.num_running == 0
    assert sched.kv_cache_usage == 0.0
    so, outs = step(sched, runner)
    assert so.finished_req_ids == {"a", "b"} and outs == []


def test_finish_requests_for_stop_string():
    sched, runner = make_scheduler(), FakeRunner()
    a = make_request("a", range(5))
    sched.add_request(a)
    step(sched, runner)
    sched.finish_requests("a", RequestStatus.FINISHED_STOPPED, stop_reason="\n\n")
    assert a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason == "\n\n"
    assert a.get_finish_reason() == "stop"
    assert sched.schedule().finished_req_ids == {"a"}
    with pytest.raises(ValueError):
        sched.finish_requests("a", RequestStatus.RUNNING)


# ------------------------------------------------------------ stop checks

def run_one(req: Request, outputs: list[int]):
    sched = make_scheduler()
    runner = FakeRunner(next_token=script({req.request_id: list(outputs)}))
    sched.add_request(req)
    outs = run_to_completion(sched, runner)[req.request_id]
    assert sched.kv_cache_usage == 0.0
    return outs


def test_eos_stops_with_no_stop_reason():
    req = make_request("a", [1, 3], max_tokens=10)
    outs = run_one(req, [5, 6, EOS, 7])
    assert req.output_token_ids == [5, 6, EOS]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason is None
    assert outs[-1].new_token_ids == [EOS]
    assert [o.finished for o in outs] == [False, False, True]


def test_user_stop_token_reports_itself():
    req = make_request("a", [1, 3], max_tokens=10, stop_token_ids=[6])
    outs = run_one(req, [5, 6, 7])
    assert req.output_token_ids == [5, 6]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == 6


def test_min_tokens_suppresses_early_stop():
    req = make_request("a", [1, 3], max_tokens=10, min_tokens=3, stop_token_ids=[6])
    run_one(req, [EOS, 6, EOS, 9])
    assert req.output_token_ids == [EOS, 6, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_max_tokens():
    req = make_request("a", [1, 3], max_tokens=3)
    outs = run_one(req, [5, 6, 7, 8])
    assert req.output_token_ids == [5, 6, 7]
    assert outs[-1].finish_reason == "length" and outs[-1].stop_reason is None


def test_stop_wins_over_length_on_the_same_token():
    req = make_request("a", [1, 3], max_tokens=2)
    outs = run_one(req, [5, EOS])
    assert outs[-1].finish_reason == "stop"


def test_ignore_eos():
    req = make_request("a", [1, 3], max_tokens=3, ignore_eos=True)
    run_one(req, [EOS, EOS, EOS])
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_tokens_after_a_stop_in_one_output_are_dropped():
    sched = make_scheduler()
    req = make_request("a", [1, 3], max_tokens=10)
    sched.add_request(req)
    so = sched.schedule()
    ro = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[5, EOS, 7]], logprobs=[[]])
    (out,) = sched.update_from_output(so, ro)
    assert out.new_token_ids == [5, EOS] and out.finish_reason == "stop"
    assert req.output_token_ids == [5, EOS]


def test_logprobs_passed_through_and_stale_outputs_ignored():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 3]))
    so = sched.schedule()
    lp = SampledLogprobs([9], [-0.1], 1)
    ro = ModelRunnerOutput(req_ids=["a", "ghost", "a2"], sampled_token_ids=[[9], [4], []],
                           logprobs=[[lp], [], []])
    (out,) = sched.update_from_output(so, ro)
    assert out.new_logprobs == [lp] and out.new_token_ids == [9]
    # Outputs for a request not scheduled in that step are ignored.
    so2 = sched.schedule()
    assert sched.update_from_output(SchedulerOutput(), ModelRunnerOutput(
        req_ids=["a"], sampled_token_ids=[[1]], logprobs=[])) == []
    assert sched.update_from_output(so2, ModelRunnerOutput(
        req_ids=["a"], sampled_token_ids=[[1]], logprobs=[]))[0].new_logprobs == []


# -------------------------------------------------- requests that never fit

def test_prompt_larger_than_the_cache_is_finished_not_looped():
    sched, runner = make_scheduler(num_blocks=4), FakeRunner()
    big = make_request("big", range(17))  # 5 blocks > 4
    ok = make_request("ok", range(8), max_tokens=2)
    sched.add_request(big)
    sched.add_request(ok)
    outs = run_to_completion(sched, runner, max_steps=20)
    assert big.status == RequestStatus.FINISHED_ABORTED
    assert outs["big"][-1].finish_reason == "abort" and outs["big"][-1].new_token_ids == []
    assert ok.num_output_tokens == 2


def test_generation_outgrowing_the_cache_finishes_with_length():
    sched, runner = make_scheduler(num_blocks=3), FakeRunner()
    req = make_request("a", range(10), max_tokens=50)
    sched.add_request(req)
    outs = run_to_completion(sched, runner, max_steps=50)
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert req.num_tokens == 13  # the 13th token would need a 4th block
    assert req.num_preemptions == 0  # finished directly, no pointless preemption
    assert outs["a"][-1].finish_reason == "length"
    assert sched.kv_cache_usage == 0.0


def test_prompt_over_budget_without_chunking_is_finished():
    sched, runner = make_scheduler(budget=8, chunked=False), FakeRunner()
    sched.add_request(make_request("a", range(9)))
    outs = run_to_completion(sched, runner, max_steps=5)
    assert outs["a"][-1].finish_reason == "abort"


# ------------------------------------------------------------------ stress

@pytest.mark.parametrize("seed,chunked,caching",
                         [(seed, seed % 2 == 0, seed % 4 < 2) for seed in range(24)])
def test_randomized_stress(seed, chunked, caching):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    max_len = 40
    num_blocks = -(-max_len // block_size) + rng.randint(0, 3)  # one request always fits
    budget = rng.randint(max_len, 64) if not chunked else rng.randint(1, 48)
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size,
                           max_num_seqs=rng.randint(1, 8), budget=budget,
                           chunked=chunked, caching=caching)
    token_rng = random.Random(seed + 1000)
    runner = FakeRunner(block_size, next_token=lambda rid, toks: token_rng.randrange(8))
    prefixes = [[rng.randrange(8) for _ in range(rng.randint(1, 20))] for _ in range(3)]
    requests = {}

    def new_request(i):
        prompt = rng.choice(prefixes + [[]])[:] + [rng.randrange(8) for _ in range(rng.randint(1, 10))]
        prompt = prompt[:max_len - 1]
        max_tokens = rng.randint(1, max_len - len(prompt))
        req = make_request(f"r{i}", prompt, max_tokens=max_tokens, eos=False,
                           ignore_eos=True)
        requests[req.request_id] = req
        sched.add_request(req)

    for i in range(20):
        new_request(i)
    next_id, steps, aborted = 20, 0, set()
    while sched.has_unfinished_requests():
        steps += 1
        assert steps < 5000, "livelock"
        if next_id < 40 and rng.random() < 0.3:
            new_request(next_id)
            next_id += 1
        so, _ = step(sched, runner)
        # Every scheduled/remembered request's tokens agree with the runner's.
        for rid, st in runner.reqs.items():
            assert st.tokens[:requests[rid].num_tokens] == requests[rid].all_token_ids
        held = sum(sched.kv_cache_manager.get_num_blocks(r.request_id) for r in sched.running)
        assert all(sched.kv_cache_manager.get_num_blocks(r.request_id) == 0 for r in sched.waiting)
        assert sched.kv_cache_manager.num_free_blocks >= num_blocks - held
        if rng.random() < 0.02 and sched.running:
            victim = rng.choice(sched.running).request_id
            sched.abort_requests(victim)
            aborted.add(victim)

    for rid, req in requests.items():
        if rid in aborted:
            assert req.status == RequestStatus.FINISHED_ABORTED
        else:
            assert req.status == RequestStatus.FINISHED_LENGTH, rid
            assert req.num_output_tokens == req.max_tokens
    assert sched.kv_cache_manager.num_free_blocks == num_blocks
    assert all(b.ref_cnt == 0 for b in sched.kv_cache_manager.block_pool.blocks)
    assert sched.requests == {}
    sched.schedule()  # report the last finished ids
    assert sched.reset_prefix_cache() is True


# ------------------------------------------------------------------- LongRoPE

def make_long_rope_scheduler(original: int, **kwargs) -> Scheduler:
    import dataclasses

    sched = make_scheduler(**kwargs)
    sched.scheduler_config = dataclasses.replace(sched.scheduler_config,
                                                 long_rope_from=original)
    sched.long_rope_from = original
    return sched


def test_a_request_is_encoded_again_once_as_it_grows_past_longrope_original_length():
    """Original length 12, a prompt of 10: its tokens at positions 0..11 are computed
    short; the step that would compute position 12 instead sends the request again with
    all 13 tokens, encoded long (from the prefix cache's long blocks only: none yet).
    That is no preemption, and the request is never encoded again."""
    sched = make_long_rope_scheduler(12)
    runner = FakeRunner()
    sched.add_request(make_request("a", range(10, 20), max_tokens=8, eos=False))
    sends = []  # (rope_long, computed, scheduled) of each NewRequestData
    for _ in range(20):
        if not sched.has_unfinished_requests():
            break
        so, _ = step(sched, runner)
        sends += [(n.rope_long, n.num_computed_tokens, so.num_scheduled_tokens[n.req_id])
                  for n in so.new_requests]
        if so.new_requests and len(sends) == 2:
            assert so.preempted_req_ids == {"a"}  # (the runner forgets its short state)
        if len(sends) < 2:  # (short: never a position past 11)
            assert runner.reqs["a"].num_computed <= 12
    assert sends == [(False, 0, 10), (True, 0, 13)]
    assert sched.num_preemptions == 0 and not sched.has_unfinished_requests()
    assert runner.reqs["a"].tokens[10:] == [100 + n for n in range(10, 18)]


def test_a_prompt_past_longrope_original_length_is_long_from_the_start():
    sched = make_long_rope_scheduler(12)
    runner = FakeRunner()
    sched.add_request(make_request("a", range(10, 23), max_tokens=4, eos=False))
    so, _ = step(sched, runner)
    assert [(n.rope_long, so.num_scheduled_tokens["a"]) for n in so.new_requests] == [(True, 13)]
    run_to_completion(sched, runner)
    assert sched.num_preemptions == 0


def test_longrope_encoding_again_waits_for_the_token_in_flight():
    """With async scheduling the token at the original length is still being sampled
    when the next step is scheduled: the request sits that step out (its re-encoding
    needs that token), then goes with every token."""
    sched = make_long_rope_scheduler(12)
    sched.async_scheduling = True
    runner = FakeRunner()
    sched.add_request(make_request("a", range(10, 22), max_tokens=4, eos=False))
    first = sched.schedule()  # the prompt: positions 0..11, short; samples position 12
    assert sched.requests["a"].num_output_placeholders == 1
    second = sched.schedule()  # would compute position 12 with the token in flight
    assert second.num_scheduled_tokens == {} and not second.preempted_req_ids
    sched.update_from_output(first, runner.execute(first))
    sched.update_from_output(second, runner.execute(second))
    third = sched.schedule()
    assert [(n.rope_long, third.num_scheduled_tokens["a"]) for n in third.new_requests] \
        == [(True, 13)]


def test_drafts_stop_at_longrope_original_length():
    """n-gram drafts verified with the short factors must not reach the original
    length: a request of 9 tokens with original length 12 verifies at most 3."""
    from spindle.config import SpeculativeConfig

    sched = make_long_rope_scheduler(12)
    sched.speculative_config = SpeculativeConfig(method="ngram", num_speculative_tokens=5)
    runner = FakeRunner()
    sched.add_request(make_request("a", range(10, 18), max_tokens=8, eos=False))
    step(sched, runner)  # the prompt (8 tokens) and the first output
    sched.requests["a"].spec_token_ids = [1, 2, 3, 4, 5]
    so = sched.schedule()
    assert so.spec_token_ids["a"] == [1, 2, 3]  # positions 9, 10, 11
    assert so.num_scheduled_tokens["a"] == 4
