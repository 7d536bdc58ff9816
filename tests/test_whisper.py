"""Whisper end to end against the oracle: spindle's greedy tokens and logprobs from raw
audio equal a plain transformers greedy loop (the checkpoint's own feature extractor,
WhisperForConditionalGeneration, argmax one token at a time) on tiny random
checkpoints of several shapes, under batching, chunked prefill, preemption, the
encoder budget, async scheduling on and off, tensor parallelism and sleep mode.

Audio is tools/tiny_whisper.synthetic_audio (tones and bursts that change along the
window). Only audio whose greedy continuation has no near-tie (a top-2 logit gap under
1e-3 at some step) is used: two correct float32 implementations may break a tie
either way.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from spindle import LLM, SamplingParams
from spindle.tools.tiny_whisper import SAMPLING_RATE, synthetic_audio

LOGPROB_TOL = 1e-4
MAX_NEW = 12
START, EN, FR, TRANSLATE, TRANSCRIBE, NO_TIMESTAMPS = 1, 2, 3, 6, 7, 11
PROMPT = [START, EN, TRANSCRIBE, NO_TIMESTAMPS]
SHAPES = {
    "default": {},
    "odd_heads": dict(d_model=48, encoder_heads=3, decoder_heads=3, encoder_layers=1,
                      decoder_layers=3, ffn_dim=96, seed=1),
    "mels128": dict(num_mel_bins=128, chunk_length=3, encoder_heads=2, decoder_heads=2,
                    ffn_dim=96, seed=2),
}


@functools.lru_cache(maxsize=8)
def _hf(path: Path):
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return model, WhisperFeatureExtractor.from_pretrained(path)


@torch.no_grad()
def hf_greedy(path: Path, waveform: np.ndarray, prompt: list[int], max_new: int = MAX_NEW
              ) -> tuple[list[int], list[float], float]:
    """transformers' greedy tokens, their logprobs, and the smallest top-2 gap seen
    (stopping after EOS, as spindle does)."""
    model, extractor = _hf(path)
    features = extractor(waveform, sampling_rate=SAMPLING_RATE, return_tensors="pt").input_features
    encoder_states = model.model.encoder(features).last_hidden_state
    ids, tokens, logprobs, gap = list(prompt), [], [], float("inf")
    for _ in range(max_new):
        logits = model(encoder_outputs=(encoder_states,),
                       decoder_input_ids=torch.tensor([ids])).logits[0, -1].float()
        top = logits.topk(2).values
        gap = min(gap, float(top[0] - top[1]))
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
        if token == model.config.eos_token_id:
            break
    return tokens, logprobs, gap


def clear_cases(path: Path, count: int, seconds: list[float], prompt: list[int] = PROMPT,
                first_seed: int = 0) -> list[tuple[np.ndarray, tuple]]:
    """count (waveform, oracle) pairs of the given lengths (cycled) whose greedy
    continuation has no near-tie."""
    cases, seed = [], first_seed
    while len(cases) < count:
        wave = synthetic_audio(seconds[len(cases) % len(seconds)], seed)
        oracle = hf_greedy(path, wave, prompt)
        if oracle[2] >= 1e-3:
            cases.append((wave, oracle))
        seed += 1
        if seed > first_seed + 50:
            raise RuntimeError("no audio without near-ties in 50 seeds")
    return cases


def audio_prompt(wave: np.ndarray, prompt: list[int] = PROMPT, rate: int = SAMPLING_RATE
                 ) -> dict:
    return {"prompt_token_ids": prompt, "multi_modal_data": {"audio": (wave, rate)}}


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)


def assert_matches(outputs, cases) -> None:
    for i, (out, (_, (tokens, logprobs, _))) in enumerate(zip(outputs, cases)):
        got = out.outputs[0]
        assert got.token_ids == tokens, f"request {i}: {got.token_ids} vs {tokens}"
        got_lp = [next(iter(d.values())).logprob for d in got.logprobs]
        np.testing.assert_allclose(got_lp, logprobs, atol=LOGPROB_TOL, rtol=0,
                                   err_msg=f"request {i}")


def window(path: Path) -> float:
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor.from_pretrained(path).chunk_length


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_greedy_from_raw_audio_equals_transformers(tiny_whisper, shape):
    path = tiny_whisper(**SHAPES[shape])
    full = window(path)
    cases = clear_cases(path, 4, [0.4, full * 0.6, full, 1.1])
    llm = LLM(model=path, max_num_seqs=8)
    outputs = llm.generate([audio_prompt(w) for w, _ in cases], greedy(), use_tqdm=False)
    assert_matches(outputs, cases)


def test_text_prompts_and_the_default_decoder_start(tiny_whisper):
    path = tiny_whisper()
    llm = LLM(model=path)
    text = "<|startoftranscript|><|fr|><|translate|><|notimestamps|>"
    (wave, oracle), = clear_cases(path, 1, [1.2], prompt=[START, FR, TRANSLATE, NO_TIMESTAMPS])
    out = llm.generate({"prompt": text, "multi_modal_data": {"audio": (wave, SAMPLING_RATE)}},
                       greedy(), use_tqdm=False)
    assert out[0].prompt_token_ids == [START, FR, TRANSLATE, NO_TIMESTAMPS]
    assert_matches(out, [(wave, oracle)])
    (wave, oracle), = clear_cases(path, 1, [1.3], prompt=[START], first_seed=10)
    out = llm.generate({"multi_modal_data": {"audio": (wave, SAMPLING_RATE)}}, greedy(),
                       use_tqdm=False)
    assert out[0].prompt_token_ids == [START]
    assert_matches(out, [(wave, oracle)])


def _cache_bytes(path: Path, slots: int, blocks: int, block_size: int) -> int:
    """The cache budget of a default-shaped tiny Whisper: slots cross-attention slots
    and blocks self-attention blocks (float32, 2 decoder layers, 4 heads of 16)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    head_dim = cfg.d_model // cfg.decoder_attention_heads
    per_token = 2 * cfg.decoder_layers * cfg.decoder_attention_heads * head_dim * 4
    return slots * cfg.max_source_positions * per_token + blocks * block_size * per_token


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_preemption_and_encoder_budget(tiny_whisper, async_scheduling):
    """Prompts cut into 3-token chunks, one encoder window per step, and a cache of 5
    blocks of 4 tokens for 4 requests of 4 + 12 tokens: requests are preempted and run
    their encoder again, and every output still equals transformers'."""
    path = tiny_whisper()
    cases = clear_cases(path, 4, [0.5, 1.0, 1.5, 2.0])
    llm = LLM(model=path, max_num_seqs=4, block_size=4, max_num_batched_tokens=3,
              max_model_len=16, max_num_encoder_tokens=100, async_scheduling=async_scheduling,
              kv_cache_memory_bytes=_cache_bytes(path, slots=4, blocks=5, block_size=4))
    scheduler = llm.engine.core.scheduler
    admitted_per_step = []
    real_schedule = scheduler.schedule

    def schedule(*args, **kwargs):
        out = real_schedule(*args, **kwargs)
        admitted_per_step.append(len(out.new_requests))
        return out

    scheduler.schedule = schedule
    outputs = llm.generate([audio_prompt(w) for w, _ in cases], greedy(), use_tqdm=False)
    assert_matches(outputs, cases)
    assert scheduler.num_preemptions > 0
    assert max(admitted_per_step) == 1  # 100 encoder positions a step: one window


def test_resampled_audio(tiny_whisper):
    """8 kHz audio is resampled to the checkpoint's 16 kHz (soxr) before its features
    are made: the same tokens as the resampled waveform given directly."""
    soxr = pytest.importorskip("soxr")
    path = tiny_whisper()
    low = synthetic_audio(1.5, 3)[::2].copy()  # (any 8 kHz signal)
    resampled = soxr.resample(low, 8000, SAMPLING_RATE, quality="HQ").astype(np.float32)
    tokens, logprobs, _ = hf_greedy(path, resampled, PROMPT)
    llm = LLM(model=path)
    out = llm.generate(audio_prompt(low, rate=8000), greedy(), use_tqdm=False)
    assert out[0].outputs[0].token_ids == tokens
    out = llm.generate(audio_prompt(torch.from_numpy(low), rate=8000), greedy(), use_tqdm=False)
    assert out[0].outputs[0].token_ids == tokens  # (a torch waveform, too)


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": PROMPT}, "needs audio"),
    (PROMPT, "needs audio"),
    ({"prompt_token_ids": PROMPT, "multi_modal_data": {"image": 1}}, "audio"),
    ({"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": np.zeros(100)}}, "pair"),
    ({"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": (np.zeros(100), 0)}},
     "sample_rate"),
    ({"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": (np.zeros(0), 16000)}},
     "empty"),
    ({"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": (np.full(100, np.nan), 16000)}},
     "NaN"),
    ({"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": (np.zeros((2, 100)), 16000)}},
     "1-D"),
    ({"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": (np.zeros(16000 * 3), 16000)}},
     "at most 2 s"),
    ({"prompt_token_ids": [10_000], "multi_modal_data": {"audio": (np.zeros(100), 16000)}},
     "outside the vocabulary"),
])
def test_bad_inputs_are_refused_and_the_engine_serves_on(tiny_whisper, prompt, message):
    path = tiny_whisper()
    llm = _shared_llm(str(path))
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, greedy(), use_tqdm=False)
    (wave, (tokens, _, _)), = clear_cases(path, 1, [1.0])
    assert llm.generate(audio_prompt(wave), greedy(), use_tqdm=False)[0].outputs[0].token_ids \
        == tokens


@functools.lru_cache(maxsize=1)
def _shared_llm(path: str) -> LLM:
    return LLM(model=path)


def test_a_text_model_refuses_audio(tiny_model):
    llm = LLM(model=tiny_model("llama"))
    with pytest.raises(ValueError, match="multi_modal_data is not supported"):
        llm.generate({"prompt_token_ids": [1, 2], "multi_modal_data": {"audio": (
            np.zeros(100), 16000)}}, greedy(), use_tqdm=False)


def test_cache_groups_and_config(tiny_whisper):
    path = tiny_whisper()
    llm = LLM(model=path)
    core = llm.engine.core
    assert [g.kind for g in core.cache_requirements.groups] == ["full_attention",
                                                                 "cross_attention"]
    assert not core.scheduler.kv_cache_manager.enable_caching  # prefix caching is off
    assert llm.engine.config.model.max_model_len == 64  # max_target_positions
    assert llm.engine.config.scheduler.max_num_encoder_tokens >= 100
    with pytest.raises(ValueError, match="max_num_encoder_tokens"):
        LLM(model=path, max_num_encoder_tokens=50)
    with pytest.raises(ValueError, match="speculative_config needs a decoder"):
        LLM(model=path, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_thirty_second_window(tiny_whisper):
    """Whisper's real window: 30 s of audio, 3000 mel frames, 1500 encoder positions."""
    path = tiny_whisper(chunk_length=30, encoder_layers=1, decoder_layers=1, seed=3)
    cases = clear_cases(path, 2, [30.0, 17.5])
    llm = LLM(model=path, max_num_seqs=2)
    assert_matches(llm.generate([audio_prompt(w) for w, _ in cases], greedy(),
                                use_tqdm=False), cases)


def test_tensor_parallel_two_ranks(tiny_whisper):
    """TP=2 on the CPU (heads split across two worker processes) equals transformers."""
    path = tiny_whisper()
    cases = clear_cases(path, 3, [0.7, 1.4, 2.0])
    llm = LLM(model=path, tensor_parallel_size=2, max_num_seqs=4)
    try:
        assert_matches(llm.generate([audio_prompt(w) for w, _ in cases], greedy(),
                                    use_tqdm=False), cases)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_give_the_same_output(tiny_whisper, level):
    """Sleep drops the cross-attention slots (a list per layer) with the rest of the
    cache; level 2 reloads the weights: the output after waking is the oracle's."""
    path = tiny_whisper()
    cases = clear_cases(path, 2, [0.8, 1.6])
    llm = LLM(model=path, enable_sleep_mode=True)
    prompts = [audio_prompt(w) for w, _ in cases]
    assert_matches(llm.generate(prompts, greedy(), use_tqdm=False), cases)
    llm.sleep(level)
    llm.wake_up()
    assert_matches(llm.generate(prompts, greedy(), use_tqdm=False), cases)


def test_media_buffer_bounds_the_encoder_inputs_of_a_step(tiny_whisper):
    """mm_ipc_gpu_memory_gb set aside for two windows' features: a step starts at most
    two requests, every step stages them in the one buffer (same address), and the
    outputs still equal transformers'."""
    path = tiny_whisper()
    window_bytes = 80 * 200 * 4  # float32 features of one 2 s window
    gib = 2.5 * window_bytes / 2**30
    cases = clear_cases(path, 5, [0.5, 1.0, 1.5, 2.0])
    llm = LLM(model=path, max_num_seqs=8, mm_ipc_gpu_memory_gb=gib)
    assert llm.engine.config.scheduler.max_num_encoder_tokens == 200  # two windows
    state = llm.engine.core.executor.worker.runner.state
    staged, real_stage = [], state.media_buffer.stage

    def stage(features):
        view = real_stage(features)
        staged.append((len(features), view.data_ptr()))
        return view

    state.media_buffer.stage = stage
    assert_matches(llm.generate([audio_prompt(w) for w, _ in cases], greedy(),
                                use_tqdm=False), cases)
    assert sum(n for n, _ in staged) == 5 and max(n for n, _ in staged) == 2
    assert len({ptr for _, ptr in staged}) == 1
    with pytest.raises(ValueError, match="mm_ipc_gpu_memory_gb must be 0 or room for one"):
        LLM(model=path, mm_ipc_gpu_memory_gb=0.5 * window_bytes / 2**30)
    with pytest.raises(ValueError, match="the 2 encoder inputs mm_ipc_gpu_memory_gb"):
        LLM(model=path, mm_ipc_gpu_memory_gb=gib, max_num_encoder_tokens=300)
