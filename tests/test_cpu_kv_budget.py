"""The CPU start: the KV cache is sized from a configured budget (cpu_kv_cache_gb), not
from a share of free RAM; the block count is the same for the same inputs; the startup
table names the budget and its flag; profile_run is a small forward, not one at the
step's token budget; and the cache's RAM is not touched until blocks fill."""

from __future__ import annotations

import psutil
import pytest
import torch

from spindle import LLM
from spindle.config import EngineArgs
from spindle.platforms import CpuPlatform, CudaPlatform
from spindle.runner.model_runner import ModelRunner

GiB = 2**30
DEFAULT_GIB = 4  # the documented default of cpu_kv_cache_gb


@pytest.fixture(scope="module")
def long_model(tiny_model):
    """A tiny model whose max_num_seqs full sequences would use more than the default
    budget (3 layers x 4 KV heads x 16 dims, fp32: 24 KiB a block; 16,384 positions:
    6 GiB for 256 sequences), so the budget, not that cap, decides."""
    return tiny_model("llama", num_layers=3, num_kv_heads=4, max_position_embeddings=16384)


def engine_facts(llm: LLM) -> tuple[int, int, dict[str, dict]]:
    """(KV blocks, bytes of one block, startup rows by stage) of a one-worker engine."""
    core = llm.engine.core
    rows = {row["stage"]: row for row in core.executor.lifecycle_reports()[0]}
    return core.num_kv_blocks, core.executor.cache_requirements()[0].block_bytes, rows


# ---- the sizing rule ------------------------------------------------------------------
def test_budget_is_the_configured_space_whatever_the_free_ram():
    from spindle.worker.worker import cpu_kv_cache_budget

    for available in (16 * GiB, 64 * GiB, 500 * GiB):
        budget, note = cpu_kv_cache_budget(4 * GiB, useful_bytes=100 * GiB,
                                           available_bytes=available, workers=1)
        assert budget == 4 * GiB
        assert note == "cpu_kv_cache_gb=4 (--cpu-kv-cache-gb)"


def test_budget_caps():
    from spindle.worker.worker import cpu_kv_cache_budget

    # No more than max_num_seqs full sequences can use.
    budget, note = cpu_kv_cache_budget(4 * GiB, useful_bytes=300 * 2**20,
                                       available_bytes=64 * GiB, workers=1)
    assert budget == 300 * 2**20 and note.startswith("capped at max_num_seqs x max_model_len")
    # Short of RAM: half of what is available, and the note says so.
    budget, note = cpu_kv_cache_budget(4 * GiB, useful_bytes=100 * GiB,
                                       available_bytes=6 * GiB, workers=1)
    assert budget == 3 * GiB and note.startswith("capped at half of available RAM")
    # Workers sharing the host split the space.
    budget, _ = cpu_kv_cache_budget(4 * GiB, useful_bytes=100 * GiB,
                                    available_bytes=64 * GiB, workers=2)
    assert budget == 2 * GiB


# ---- the engine -----------------------------------------------------------------------
def test_block_count_follows_the_budget_not_free_ram(long_model, monkeypatch):
    """Two starts with different free RAM (both plentiful) hold the same blocks: the
    default budget's worth."""
    counts = []
    for available in (12 * GiB, 20 * GiB):
        monkeypatch.setattr(CpuPlatform, "mem_get_info",
                            lambda self, device, a=available: (a, 64 * GiB))
        with LLM(str(long_model), device="cpu", max_num_seqs=256) as llm:
            blocks, block_bytes, _ = engine_facts(llm)
        counts.append(blocks)
    assert counts[0] == counts[1] == DEFAULT_GIB * GiB // block_bytes


def test_cpu_kv_cache_gb_sets_the_blocks_and_the_table_names_it(long_model):
    with LLM(str(long_model), device="cpu", cpu_kv_cache_gb=0.25) as llm:
        blocks, block_bytes, rows = engine_facts(llm)
        table = llm.engine.core.startup_table
    assert blocks == GiB // 4 // block_bytes
    note = rows["profile_run"]["note"]
    assert note == "kv budget 256.0 MiB (cpu_kv_cache_gb=0.25 (--cpu-kv-cache-gb))"
    assert note in table
    assert [line.split()[0] for line in table.splitlines()[2:8]] == [
        "init_device", "load_model", "profile_run", "allocate_kv_cache", "warmup",
        "freeze_gc_heap"]


def test_a_budget_below_one_sequence_names_the_knob(tiny_model):
    with pytest.raises(ValueError, match=r"cannot hold one sequence.*cpu_kv_cache_gb"):
        LLM(str(tiny_model("llama")), device="cpu", max_model_len=2048, cpu_kv_cache_gb=1e-5)


def test_profile_run_is_a_small_forward_on_cpu(long_model, monkeypatch):
    """On CPU profile_run only checks that the model and the sampler run: a forward of a
    few tokens, not one at max_num_batched_tokens (tens of seconds on a few cores)."""
    forwards = []
    original = ModelRunner.profile_run

    def spying_profile_run(self, *args, **kwargs):
        state_forward = self.state.forward

        def recording(inputs):
            forwards.append(inputs["input_ids"].numel())
            return state_forward(inputs)

        self.state.forward = recording
        try:
            return original(self, *args, **kwargs)
        finally:
            del self.state.forward

    monkeypatch.setattr(ModelRunner, "profile_run", spying_profile_run)
    with LLM(str(long_model), device="cpu", max_num_batched_tokens=4096) as llm:
        assert llm.config.scheduler.max_num_batched_tokens == 4096
    assert len(forwards) == 1 and forwards[0] <= 16


def test_cpu_warmup_is_one_short_request(long_model, monkeypatch):
    """Nothing is compiled on CPU: warmup checks the cache path with one short request
    (prefill and decode) instead of also running a long prefill."""
    prompts = []
    original = ModelRunner._warmup_request

    def recording(self, num_prompt, block_ids):
        prompts.append(num_prompt)
        return original(self, num_prompt, block_ids)

    monkeypatch.setattr(ModelRunner, "_warmup_request", recording)
    with LLM(str(long_model), device="cpu", kv_cache_memory_bytes=2**26) as llm:
        assert prompts == [llm.config.cache.block_size]


def test_kv_cache_ram_is_not_touched_at_allocation(long_model):
    """4 GiB of cache: allocate_kv_cache takes well under a second and almost no RSS
    (pages are zeroed by the kernel as blocks fill), and the engine still generates."""
    from spindle import SamplingParams

    with LLM(str(long_model), device="cpu") as llm:
        blocks, block_bytes, rows = engine_facts(llm)
        assert blocks * block_bytes >= 4 * GiB - block_bytes
        assert rows["allocate_kv_cache"]["bytes"] < 256 * 2**20
        assert rows["allocate_kv_cache"]["seconds"] < 2.0
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_allocate_zeroed_on_cpu_is_zero_writable_and_given_back():
    platform = CpuPlatform()
    for dtype in (torch.float32, torch.bfloat16):
        t = platform.allocate_zeroed((2, 3, 16, 4, 8), dtype, torch.device("cpu"))
        assert t.shape == (2, 3, 16, 4, 8) and t.dtype == dtype and t.is_contiguous()
        assert not t.any()
        t[1, 2] = 1.5
        assert t.sum().item() == 1.5 * 16 * 4 * 8
    process = psutil.Process()
    size = 256 * 2**20
    before = process.memory_info().rss
    big = platform.allocate_zeroed((size // 4,), torch.float32, torch.device("cpu"))
    assert process.memory_info().rss - before < 32 * 2**20  # nothing touched yet
    big.fill_(1.0)
    filled = process.memory_info().rss
    assert filled - before > size * 3 // 4
    del big
    assert filled - process.memory_info().rss > size * 3 // 4  # unmapped with the tensor


def test_gpu_keeps_the_measured_budget():
    """The CUDA path still sizes its cache from a full-budget profile_run."""
    assert getattr(CudaPlatform, "kv_cache_from_measured_peak", None) is True
    assert getattr(CpuPlatform, "kv_cache_from_measured_peak", None) is False


# ---- the knob ------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1.0, True, "4"])
def test_cpu_kv_cache_gb_is_validated(bad, tiny_model):
    with pytest.raises(ValueError, match="cpu_kv_cache_gb"):
        EngineArgs(model=str(tiny_model("llama")), device="cpu",
                   cpu_kv_cache_gb=bad).create_engine_config()


def test_cpu_kv_cache_gb_flag():
    import argparse

    from spindle.entrypoints.cli_args import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from(parser.parse_args(["--cpu-kv-cache-gb", "2.5"])).cpu_kv_cache_gb == 2.5
    assert engine_args_from(parser.parse_args([])).cpu_kv_cache_gb == DEFAULT_GIB


@pytest.mark.parametrize("arch", ["llama", "gemma2", "bamba"])
def test_warmup_mixed_steps_give_each_request_its_own_blocks_and_slot(tiny_model, arch):
    """The warm-up's mixed steps (run where a model state splits mixed steps: on a GPU;
    forced here on the CPU): a prompt of 2 tokens, then one of 33, each beside
    max_num_seqs - 1 one-token requests, every request in blocks of its own in each
    paged group (Gemma 2's full and sliding-window groups) and in a state slot of its
    own (Bamba's Mamba layers); nothing is left in the batch, and the engine then
    generates as before."""
    from spindle import SamplingParams

    path = tiny_model(arch=arch)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    engine_args = dict(device="cpu", max_num_seqs=6, max_num_batched_tokens=64,
                       max_model_len=128)
    with LLM(str(path), **engine_args) as llm:
        before = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(str(path), **engine_args) as llm:
        runner = llm.engine.core.executor.worker.runner
        steps = []
        execute = runner.execute_model

        def recording(scheduler_output):
            steps.append(scheduler_output)
            return execute(scheduler_output)

        runner.execute_model = recording
        runner._require_state().splits_mixed_steps = True
        runner._warmup_mixed_steps()
        del runner.execute_model
        assert not runner.input_batch.requests
        assert all(step.new_requests and not step.cached_requests for step in steps)
        groups, num_blocks = runner.cache_layout.groups, runner.num_kv_blocks
        num_slots = runner.kv_config.num_state_slots
        after = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before
    assert [sorted(s.num_scheduled_tokens.values()) for s in steps] == \
        [[1] * 5 + [2], [1] * 5 + [33]]
    for step in steps:
        for g, group in enumerate(groups):
            ids = [b for new in step.new_requests for b in new.block_ids[g]]
            assert len(ids) == len(set(ids)), f"a block shared in group {group.kind}"
            if group.is_paged:
                assert max(ids) < num_blocks
            else:
                assert max(ids) < num_slots
    assert any(not group.is_paged for group in groups) == (arch == "bamba")
    assert (sum(group.is_paged for group in groups) > 1) == (arch == "gemma2")


def test_a_failed_start_is_logged_before_the_executor_shuts_down(tiny_model, logs,
                                                                 monkeypatch):
    """The error is in the log before the shutdown frees device memory (which, after a
    device-side assert on a GPU, can abort the process before the exception is seen)."""
    from spindle.executor.abstract import Executor

    errors_at_shutdown = []
    shutdown = Executor.shutdown

    def recording_shutdown(self):
        errors_at_shutdown.append([r.getMessage() for r in logs.records
                                   if r.levelname == "ERROR"])
        shutdown(self)

    monkeypatch.setattr(Executor, "shutdown", recording_shutdown)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        LLM(str(tiny_model("llama")), device="cpu", max_model_len=2048, cpu_kv_cache_gb=1e-5)
    assert errors_at_shutdown, "the executor was not shut down"
    first = errors_at_shutdown[0]
    assert len(first) == 1 and first[0].startswith("engine start failed: ValueError: ")
    assert "cannot hold one sequence" in first[0]
