"""Whisper on CUDA: the encoder, paged self-attention, the cross-attention decode
kernel and CUDA graphs for decode, against transformers on the CPU in float32 (the
oracle of the CPU tests: spindle's CUDA run must give the same greedy tokens), and
cumem sleep with the cross-attention slots."""

from __future__ import annotations

import numpy as np
import pytest

from spindle import LLM, SamplingParams
from test_whisper import SHAPES, _cache_bytes, audio_prompt, clear_cases, window

pytestmark = pytest.mark.gpu

LOGPROB_TOL = 1e-3  # float32 on the GPU: other reduction orders than the CPU's
MAX_NEW = 12


def check(cases, outputs):
    for i, ((_, (tokens, logprobs, _)), out) in enumerate(zip(cases, outputs)):
        assert list(out.outputs[0].token_ids) == tokens, f"request {i}"
        got = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(logprobs, got)) < LOGPROB_TOL


def greedy():
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=0)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_greedy_equals_cpu_transformers(tiny_whisper, shape, enforce_eager):
    path = tiny_whisper(**SHAPES[shape])
    full = window(path)
    cases = clear_cases(path, 5, [0.4, full * 0.6, full, 1.1, full * 0.8])
    with LLM(str(path), dtype="float32", device="cuda", max_num_seqs=8,
             enforce_eager=enforce_eager) as llm:
        outputs = llm.generate([audio_prompt(w) for w, _ in cases], greedy(), use_tqdm=False)
        graphs = llm.engine.core.executor.worker.runner.graph_runner
        replays = sum(graphs.num_replays.values()) if graphs is not None else 0
    assert (graphs is None) == enforce_eager
    assert enforce_eager or replays > 0  # decode steps ran from graphs
    check(cases, outputs)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_chunked_prefill_preemption_and_encoder_budget(tiny_whisper, enforce_eager):
    """3-token prompt chunks, one encoder window a step, and 5 blocks of 4 tokens for 4
    requests of 16: requests are preempted and run their encoder again."""
    path = tiny_whisper()
    cases = clear_cases(path, 4, [0.5, 1.0, 1.5, 2.0])
    with LLM(str(path), dtype="float32", device="cuda", max_num_seqs=4, block_size=4,
             max_model_len=16, max_num_batched_tokens=3, max_num_encoder_tokens=100,
             kv_cache_memory_bytes=_cache_bytes(path, slots=4, blocks=5, block_size=4),
             enforce_eager=enforce_eager) as llm:
        check(cases, llm.generate([audio_prompt(w) for w, _ in cases], greedy(),
                                  use_tqdm=False))
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_cumem_sleep_keeps_cross_attention_slots_working(tiny_whisper):
    path = tiny_whisper()
    cases = clear_cases(path, 3, [0.6, 1.2, 1.9])
    prompts = [audio_prompt(w) for w, _ in cases]
    with LLM(str(path), dtype="float32", device="cuda", enable_sleep_mode=True) as llm:
        check(cases, llm.generate(prompts, greedy(), use_tqdm=False))
        for level in (1, 2):
            llm.sleep(level)
            llm.wake_up()
            check(cases, llm.generate(prompts, greedy(), use_tqdm=False))


def test_bf16_on_cuda_runs_and_mostly_agrees(tiny_whisper):
    """bf16 is no float32 oracle match; its first tokens follow transformers'."""
    path = tiny_whisper()
    cases = clear_cases(path, 4, [0.5, 1.0, 1.5, 2.0])
    with LLM(str(path), dtype="bfloat16", device="cuda") as llm:
        outputs = llm.generate([audio_prompt(w) for w, _ in cases], greedy(), use_tqdm=False)
    first = [out.outputs[0].token_ids[0] == tokens[0]
             for out, (_, (tokens, _, _)) in zip(outputs, cases)]
    assert np.mean(first) >= 0.75
