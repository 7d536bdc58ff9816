"""Hybrid (Bamba) models on CUDA: the Triton Mamba2 kernels, CUDA graphs for decode,
state snapshots, against transformers on the CPU in float32 (the oracle the CPU tests
use: spindle's CUDA run must give the same greedy tokens)."""

from __future__ import annotations

import pytest

from spindle import LLM, SamplingParams
from test_generate_vs_hf import hf_greedy
from test_hybrid_models import MAX_NEW, SHAPES, prompts_for

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


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_greedy_equals_cpu_transformers(tiny_model, shape, enforce_eager):
    path = tiny_model("bamba", **SHAPES[shape])
    prompts = prompts_for(seed=5)
    expected = hf_greedy(path, prompts, MAX_NEW)
    (outputs,), graphs, _ = run_cuda(path, prompts, enforce_eager=enforce_eager)
    assert (graphs is None) == enforce_eager
    check(expected, outputs)


def test_cuda_chunked_prefill_and_prefix_hits(tiny_model):
    path = tiny_model("bamba", **SHAPES["groups2"])
    prompts = prompts_for(seed=6, shared_prefix=24)
    expected = hf_greedy(path, prompts, MAX_NEW)
    runs, _, hits = run_cuda(path, prompts, repeat=2, block_size=8, max_num_batched_tokens=32)
    assert hits > 0
    for outputs in runs:
        check(expected, outputs)
