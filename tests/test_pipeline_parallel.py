"""Pipeline parallelism: stage partition, greedy parity with the uni executor for
PP=2 (and PP=2 x TP=2) on the mp backend, and a stage that stops answering mid-step
failing the executor within the step timeout. The Ray backend: test_ray_executor.py."""

from __future__ import annotations

import functools
import threading
import time

import pytest

from spindle import LLM, SamplingParams
from spindle.distributed.pipeline import partition_layers
from spindle.executor.errors import ExecutorFailedError
from test_multiproc_executor import wait_gone

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE_ARGS = dict(device="cpu", max_model_len=256, max_num_batched_tokens=32,
                   enable_chunked_prefill=True, enable_prefix_caching=True)


def prompts() -> list[list[int]]:
    """Prompts sharing prefixes (prefix-cache hits), longer than the step budget
    (chunked prefill: steps where nothing samples)."""
    base = [(7 * i + 3) % 500 + 5 for i in range(70)]
    return [base + [11, 12], base[:40] + [99, 98, 97], base[:17],
            [(5 * i + 1) % 500 + 5 for i in range(50)]]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@functools.lru_cache(maxsize=None)
def uni_reference(path: str) -> list[list[int]]:
    with LLM(path, **ENGINE_ARGS) as llm:
        return token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False))


def stage_layers(worker) -> tuple[int, int, int, bool, bool]:
    """(stage, own decoder layers, KV-cached attention layers, has embedding, has head)."""
    model = worker.runner.model
    return (worker.pp_stage.rank, len(model.model.own_layers()), len(worker.runner.kv_caches),
            model.model.embed_tokens is not None, model.lm_head is not None)


def test_partition_layers():
    assert partition_layers(4, 2) == [(0, 2), (2, 4)]
    assert partition_layers(5, 2) == [(0, 2), (2, 5)]  # the last stage also samples
    assert partition_layers(5, 2, [4, 1]) == [(0, 4), (4, 5)]
    with pytest.raises(ValueError, match="at least one layer"):
        partition_layers(4, 2, [4, 0])
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        partition_layers(2, 3)


@pytest.mark.parametrize("arch,tp", [("llama", 1), ("qwen3", 1), ("llama", 2)],
                         ids=["llama-pp2", "qwen3-pp2-tied", "llama-pp2-tp2"])
def test_mp_pp2_greedy_matches_uni(tiny_model, arch, tp):
    path = str(tiny_model(arch=arch, num_layers=4))
    expected = uni_reference(path)
    with LLM(path, pipeline_parallel_size=2, tensor_parallel_size=tp,
             distributed_executor_backend="mp", **ENGINE_ARGS) as llm:
        assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == expected
        assert llm.engine.core.batch_queue.peak_in_flight == 2  # P batches in flight
        # Each stage holds only its layers and allocates KV for those only.
        layers = llm.engine.core.executor.collective_rpc(stage_layers)
        tied = arch == "qwen3"
        assert layers[0] == (0, 2, 2, True, False)
        assert layers[-1] == (1, 2, 2, tied, True)
        assert len(layers) == 2 * tp


def test_mp_pp2_explicit_partition_one_batch_in_flight(tiny_model):
    path = str(tiny_model(arch="llama", num_layers=4))
    expected = uni_reference(path)
    with LLM(path, pipeline_parallel_size=2, pipeline_layer_partition=[3, 1],
             max_concurrent_batches=1, distributed_executor_backend="mp", **ENGINE_ARGS) as llm:
        assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == expected
        assert llm.engine.core.batch_queue.peak_in_flight == 1
        layers = llm.engine.core.executor.collective_rpc(stage_layers)
        assert [row[1] for row in layers] == [3, 1]


def test_mp_pp2_preemption_with_batches_in_flight(tiny_model):
    """A KV cache too small for every request at once: requests are preempted (some
    while their batch is in flight) and recomputed; greedy output is unchanged."""
    path = str(tiny_model(arch="llama", num_layers=4))
    expected = uni_reference(path)
    block_bytes = 2 * 16 * 2 * 16 * 4 * 2  # K+V, 16 tokens, 2 KV heads x 16 dims, fp32, 2 layers
    args = dict(ENGINE_ARGS, max_model_len=128, kv_cache_memory_bytes=10 * block_bytes)
    with LLM(path, pipeline_parallel_size=2, distributed_executor_backend="mp", **args) as llm:
        assert llm.engine.core.num_kv_blocks == 10
        assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == expected
        assert llm.engine.core.scheduler.num_preemptions > 0


def hang_rank_on_step(rank: int, step: int):
    """A function for collective_rpc that makes worker `rank` stop answering inside
    its step-th execute_model call (its peers then wait for it in the pipeline's
    send/recv: a hung collective). A closure, so that it travels by value."""
    def install(worker) -> None:
        if worker.rank != rank:
            return
        original, calls = worker.execute_model, []

        def execute_model(sched):
            calls.append(sched.step_id)
            if len(calls) == step:
                time.sleep(600)
            return original(sched)

        worker.execute_model = execute_model

    return install


def test_mp_pp2_a_stage_that_stops_answering_fails_within_the_step_timeout(tiny_model):
    llm = LLM(str(tiny_model(arch="llama", num_layers=4)), pipeline_parallel_size=2,
              distributed_executor_backend="mp", step_timeout_s=2.0, **ENGINE_ARGS)
    executor = llm.engine.core.executor
    pids = executor.worker_pids
    executor.collective_rpc(hang_rank_on_step(rank=0, step=3))
    errors = generate_errors_in_thread(llm, wait=60.0)
    assert len(errors) == 1 and isinstance(errors[0], ExecutorFailedError)
    message = str(errors[0])
    assert "did not finish within 2s (step_timeout_s)" in message
    assert "rank 0 in execute_model" in message  # where the hung stage is
    assert wait_gone(pids, 10.0) == []  # the executor failed as a whole
    with pytest.raises(ExecutorFailedError, match="did not finish within 2s"):
        llm.generate("hello", GREEDY, use_tqdm=False)
    llm.shutdown()


def generate_errors_in_thread(llm: LLM, wait: float) -> list[BaseException]:
    """Run llm.generate in a thread that must end within wait seconds (without a step
    timeout an engine with a hung stage waits forever); what it raised."""
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            llm.generate(prompts(), GREEDY, use_tqdm=False)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    thread.join(wait)
    assert not thread.is_alive(), "the engine is still waiting for the hung stage"
    return errors


# Hybrids: FalconH1 has attention and a Mamba2 mixer in every layer, so each stage
# holds both cache groups; a Bamba, a Qwen3-Next and an OLMo Hybrid (Gated DeltaNet) and
# a Jamba (Mamba1)
# with attention at layers 1 and 3 too, cut in two.
HYBRID_CUTS = {"falcon_h1": {}, "bamba": dict(attn_layer_indices=(1, 3)),
               "qwen3_next": dict(layer_types=("linear_attention", "full_attention") * 2),
               "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
               "olmo_hybrid": dict(layer_types=("linear_attention", "full_attention") * 2)}


@pytest.mark.parametrize("arch", list(HYBRID_CUTS))
def test_mp_pp2_hybrid_equals_transformers(tiny_model, arch):
    """Each stage keeps its own layers' states in the slots the scheduler gives every
    stage: greedy tokens and log-probs stay transformers', two batches in flight, with
    chunked prefill and prefix hits served by state snapshots."""
    from test_hybrid_models import LOGPROB_TOL
    from test_generate_vs_hf import hf_greedy

    path = tiny_model(arch, num_layers=4, **HYBRID_CUTS[arch])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    expected = hf_greedy(path, prompts(), 12)
    with LLM(str(path), pipeline_parallel_size=2, distributed_executor_backend="mp",
             dtype="float32", block_size=4, **ENGINE_ARGS) as llm:
        runs = [llm.generate(prompts(), params, use_tqdm=False) for _ in range(2)]
        core = llm.engine.core
        assert core.batch_queue.peak_in_flight == 2
        assert core.scheduler.prefix_cache_stats.hits > 0
    for outputs in runs:
        for (tokens, lps), out in zip(expected, outputs):
            assert list(out.outputs[0].token_ids) == tokens
            got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]
            assert max(abs(a - b) for a, b in zip(lps, got)) < LOGPROB_TOL


def test_mp_pp2_stages_with_different_cache_groups_are_refused(tiny_model):
    """Bamba's default: attention in layer 2 of 4 only, so stage 0 would hold Mamba
    layers alone."""
    path = tiny_model("bamba", num_layers=4)
    with pytest.raises(ValueError, match="different cache groups.*pipeline_layer_partition"):
        LLM(str(path), pipeline_parallel_size=2, distributed_executor_backend="mp",
            **ENGINE_ARGS)


@pytest.mark.parametrize("arch", ["nemotron_h", "mamba2"])
def test_pp_is_refused_at_config_time_for_models_that_cannot_be_cut(tiny_model, arch):
    from spindle.config import EngineArgs

    args = EngineArgs(model=str(tiny_model(arch, num_layers=4)), pipeline_parallel_size=2,
                      distributed_executor_backend="mp", device="cpu")
    with pytest.raises(ValueError, match="does not support pipeline_parallel_size > 1"):
        args.create_engine_config()
