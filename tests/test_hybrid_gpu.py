"""Hybrid (Bamba, NemotronH, GraniteMoeHybrid, FalconH1, LFM2, LFM2-MoE, Qwen3-Next, Qwen3.5,
OLMo Hybrid, KimiLinear, Jamba) models
on CUDA: the Triton Mamba2, gated delta and selective scan kernels, CUDA graphs for decode,
state snapshots, against transformers on the CPU in float32 (the oracle the CPU tests
use: spindle's CUDA run must give the same greedy tokens)."""

from __future__ import annotations

import pytest

from spindle import LLM, SamplingParams
from test_generate_vs_hf import hf_greedy
from test_hybrid_models import MAX_NEW, SHAPES, prompts_for

BAMBA = SHAPES["bamba"]

pytestmark = pytest.mark.gpu

LOGPROB_TOL = 1e-3  # float32 on the GPU: other reduction orders than the CPU's


def run_cuda(path, prompts, repeat=1, **kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    with LLM(str(path), dtype="float32", device="cuda", max_model_len=256, **kwargs) as llm:
        runs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(repeat)]
        core = llm.engine.core
        graphs = core.executor.worker.runner.graph_runner
        hits = core.scheduler.prefix_cache_stats.hits
    return runs, graphs, hits


def check(expected, outputs):
    for (tokens, lps), out in zip(expected, outputs):
        assert list(out.outputs[0].token_ids) == tokens
        got = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(lps, got)) < LOGPROB_TOL


@pytest.mark.parametrize("shape", list(BAMBA))
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_greedy_equals_cpu_transformers(tiny_model, shape, enforce_eager):
    path = tiny_model("bamba", **BAMBA[shape])
    prompts = prompts_for(seed=5)
    expected = hf_greedy(path, prompts, MAX_NEW)
    (outputs,), graphs, _ = run_cuda(path, prompts, enforce_eager=enforce_eager)
    assert (graphs is None) == enforce_eager
    check(expected, outputs)


@pytest.mark.parametrize("arch,shape", [("nemotron_h", "groups2"), ("nemotron_h", "odd-heads"),
                                        ("granite_hybrid", "groups2"),
                                        ("granite_hybrid", "odd-heads"),
                                        ("falcon_h1", "default"), ("falcon_h1", "odd-heads"),
                                        ("lfm2", "default"), ("lfm2", "odd-heads"),
                                        ("lfm2_moe", "odd-heads"),
                                        ("qwen3_next", "default"),
                                        ("qwen3_next", "odd-heads"),
                                        ("qwen3_5", "odd-heads"),
                                        ("qwen3_5_moe", "groups2"),
                                        ("jamba", "default"), ("jamba", "odd-heads"),
                                        ("olmo_hybrid", "default"),
                                        ("kimi_linear", "default"),
                                        ("kimi_linear", "odd-heads"), ("mamba", "odd-heads"),
                                        ("falcon_mamba", "default"), ("zamba2", "default"),
                                        ("zamba2", "odd-heads")])
def test_cuda_more_hybrids_greedy_equal_cpu_transformers(tiny_model, arch, shape):
    """NemotronH (attention without rotary, squared-ReLU MLPs and experts beside the
    Mamba2 layers; the experts through the fused MoE kernels' gate-less variant) and
    GraniteMoeHybrid (Granite's multipliers; experts through the fused MoE
    kernels) and FalconH1 (attention beside the mixer in every layer, multipliers; the
    norm before the gate, and no norm) and LFM2 (short convolutions through the conv
    kernels without activation, attention with per-head q/k norms; LFM2-MoE's experts
    through the fused MoE kernels) and Qwen3-Next (the gated delta rule's Triton decode
    step and torch prefill, the conv kernels with SiLU, the per-head gated norm kernel,
    gated attention, experts with a shared expert) and KimiLinear (the decode kernel with
    a decay per key feature, the torch prefill, latent attention without positions,
    DeepSeek-V3's experts) and Jamba (the selective scan's Triton
    prefill and decode, attention without positions) and Mamba / FalconMamba (the same
    kernels on a float32 state, no attention) and Zamba2 (shared transformer blocks with
    adapters, each hybrid layer's own KV cache; dt unclamped in the decode kernel),
    decode in CUDA graphs."""
    path = tiny_model(arch, **SHAPES[arch][shape])
    prompts = prompts_for(seed=8)
    expected = hf_greedy(path, prompts, MAX_NEW)
    (outputs,), graphs, _ = run_cuda(path, prompts)
    assert graphs is not None
    check(expected, outputs)


def test_cuda_chunked_prefill_and_prefix_hits(tiny_model):
    path = tiny_model("bamba", **BAMBA["groups2"])
    prompts = prompts_for(seed=6, shared_prefix=24)
    expected = hf_greedy(path, prompts, MAX_NEW)
    runs, _, hits = run_cuda(path, prompts, repeat=2, block_size=8, max_num_batched_tokens=32)
    assert hits > 0
    for outputs in runs:
        check(expected, outputs)


def test_cumem_sleep_keeps_states_addresses_graphs_and_output(tiny_model):
    """The state tensors (a list per mamba layer) sleep and wake with the KV cache, at
    level 1 and then level 2: every tensor keeps its address, the captured graphs
    replay, the output stays. (One engine for both levels: a second engine with the
    cumem allocator in one process crashes in torch.cuda.empty_cache when it sleeps,
    whatever the model; seen with Qwen3 too.)"""
    from spindle.memory.sleep_backend import KV_CACHE, WEIGHTS

    path = tiny_model("bamba", **BAMBA["groups2"])
    prompts = prompts_for(seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(str(path), dtype="float32", device="cuda", max_model_len=256,
             enable_sleep_mode=True, kv_cache_memory_bytes=1 << 28, max_num_seqs=8) as llm:
        runner = llm.engine.core.executor.worker.runner
        assert llm.config.memory.sleep_mode_backend == "cumem"
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        captures = runner.num_graph_captures
        tensors = runner.tagged_tensors(WEIGHTS) + runner.tagged_tensors(KV_CACHE)
        assert len(runner.tagged_tensors(KV_CACHE)) > 1  # the shared KV tensor and the states
        addresses = [t.data_ptr() for t in tensors]
        after = []
        for level in (1, 2):
            llm.sleep(level)
            assert llm.sleep_state()["workers"][0]["device_bytes"] == {"weights": 0,
                                                                       "kv_cache": 0}
            llm.wake_up()
            assert [t.data_ptr() for t in tensors] == addresses
            after.append([o.outputs[0].token_ids
                          for o in llm.generate(prompts, params, use_tqdm=False)])
        assert runner.num_graph_captures == captures
    assert after == [expected, expected]
    assert expected == [t for t, _ in hf_greedy(path, prompts, MAX_NEW)]
