"""Speculative decoding (spindle/runner/spec_decode/): the n-gram lookup, exact
rejection sampling, and greedy outputs equal to transformers with each proposer
across the scheduling regimes (prefix hits, preemption, chunked prefill, async
scheduling, TP=2); sampled outputs follow the target's distribution (chi-square)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from spindle import LLM, SamplingParams
from spindle.runner.sample.metadata import SamplingMetadata
from spindle.runner.sample.sampler import Sampler
from spindle.runner.spec_decode import verify_drafts
from spindle.runner.spec_decode.ngram import ngram_lookup
from test_generate_vs_hf import hf_greedy

MAX_NEW = 24
P_VALUE = 1e-3  # a correct sampler fails one run in a thousand


# ------------------------------------------------------------------ n-gram lookup

def test_ngram_lookup_continues_the_latest_longest_match():
    tokens = np.array([5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 2, 3])
    # The last 2 tokens (2, 3) occur twice before; the latest is followed by 7, 8, 4.
    assert ngram_lookup(tokens, 1, 2, 3) == [7, 8, 4]
    assert ngram_lookup(tokens, 1, 2, 10) == [7, 8, 4, 2, 3]
    # With n = 3 (4, 2, 3) has no earlier match: it falls back to n = 2.
    assert ngram_lookup(tokens, 2, 3, 2) == [7, 8]
    assert ngram_lookup(tokens, 3, 3, 2) == []


def test_ngram_lookup_never_matches_the_suffix_itself():
    assert ngram_lookup(np.array([1, 2, 3]), 1, 3, 4) == []
    assert ngram_lookup(np.array([4, 4]), 1, 1, 3) == [4]
    assert ngram_lookup(np.array([7]), 1, 4, 3) == []


# ------------------------------------------------------------- rejection sampling

def _metadata(rows: int, temperature: float, top_k: int | None = None) -> SamplingMetadata:
    greedy = temperature == 0.0
    return SamplingMetadata(
        temperature=torch.full((rows,), temperature), all_greedy=greedy, all_random=not greedy,
        top_k=None if top_k is None else torch.full((rows,), top_k, dtype=torch.int64),
        top_p=None, min_p=None)


def _target(vocab: int, temperature: float, top_k: int) -> tuple[torch.Tensor, np.ndarray]:
    """Random logits and, in float64, the distribution they mean after temperature and top-k."""
    logits = torch.randn(vocab) * 1.5
    scaled = logits.double() / temperature
    kth = scaled.sort(descending=True).values[top_k - 1]
    scaled[scaled < kth] = float("-inf")
    return logits, torch.softmax(scaled, -1).numpy()


@pytest.mark.parametrize("draft_kind", ["one_hot", "weighed"])
def test_rejection_sampling_emits_the_target_distribution(draft_kind):
    """Each of many requests verifies one draft: its first token follows p exactly,
    whether the draft stands alone or was drawn from a q rejection sampling weighs;
    and drafts are accepted as often as theory says."""
    torch.manual_seed(0)
    vocab, requests, temperature, top_k = 12, 40_000, 0.8, 8
    logits, p = _target(vocab, temperature, top_k)
    q = torch.softmax(torch.randn(vocab) * 1.5, -1)  # a draft model unlike the target
    drafts = torch.multinomial(q, requests, replacement=True)
    rows = 2 * requests  # per request: the draft row, then the bonus row
    metadata = _metadata(rows, temperature, top_k)
    sampled, drawn_from, _ = Sampler().draw(logits.expand(rows, vocab).clone(), metadata)
    draft_ids = torch.stack([drafts, torch.full_like(drafts, -1)], 1).reshape(-1)
    first_row = torch.arange(requests).repeat_interleave(2) * 2
    probs = flags = None
    if draft_kind == "weighed":
        probs = q.expand(rows, vocab).clone()
        flags = draft_ids >= 0
    tokens = verify_drafts(sampled, drawn_from, metadata, draft_ids, first_row, probs, flags)
    tokens = tokens.view(requests, 2)
    first = tokens[:, 0].numpy()
    counts = np.bincount(first, minlength=vocab)
    support = p > 0
    assert counts[~support].sum() == 0  # nothing outside top-k, ever
    assert chisquare(counts[support], p[support] * requests).pvalue > P_VALUE
    accepted = (tokens[:, 0] == drafts).numpy()
    # The bonus row emits exactly when the draft was accepted.
    assert ((tokens[:, 1] >= 0).numpy() == accepted).all()
    q64 = q.double().numpy()
    expected = (np.minimum(p, q64).sum() if draft_kind == "weighed" else (p * q64).sum())
    n_acc = int(accepted.sum())
    assert abs(n_acc - expected * requests) < 5 * np.sqrt(requests * expected * (1 - expected))


def test_greedy_verification_accepts_the_argmax_prefix():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0],  # request 0
                           [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])                   # request 1
    metadata = _metadata(5, 0.0)
    sampled, drawn_from, _ = Sampler().draw(logits, metadata)
    drafts = torch.tensor([1, 2, -1, 0, -1])  # request 0: 1 accepted, 2 rejected (argmax 0)
    first_row = torch.tensor([0, 0, 0, 3, 3])
    tokens = verify_drafts(sampled, drawn_from, metadata, drafts, first_row)
    assert tokens.tolist() == [1, 0, -1, 0, 1]


# ------------------------------------------------------- end to end, greedy vs HF

def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves (the n-gram lookup has something to find) and
    some that do not, of several lengths."""
    rng = random.Random(seed)
    prompts = []
    for period, repeats in ((3, 6), (5, 4), (7, 3), (11, 2), (40, 1), (2, 9), (17, 3), (1, 1)):
        unit = [rng.randrange(vocab) for _ in range(period)]
        prompts.append(unit * repeats + unit[:period // 2])
    return prompts


@pytest.fixture(scope="module")
def target(tiny_model):
    path = tiny_model(arch="llama")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = _prompts(vocab)
    return path, prompts, [t for t, _ in hf_greedy(path, prompts, MAX_NEW)]


def _generate(path, prompts, spec, params=None, **engine):
    kwargs = dict(dtype="float32", device="cpu", max_model_len=512, seed=0)
    kwargs.update(engine)
    llm = LLM(str(path), speculative_config=spec, **kwargs)
    try:
        params = params or SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.core.scheduler.spec_decode_stats.copy()
        preemptions = llm.engine.core.scheduler.num_preemptions
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outputs], stats, preemptions


@pytest.fixture(scope="module")
def shallow_draft(target, tmp_path_factory):
    """The target's first layer alone: a smaller model that often, not always, agrees."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("shallow_draft")
    for f in target[0].iterdir():
        shutil.copy(f, path / f.name)
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    weights = load_file(path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("model.layers.1.")},
              path / "model.safetensors")
    return path


def _spec(method: str, draft=None, k: int = 3) -> dict:
    """(Speculating in batches of any size, so that every regime verifies drafts.)"""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
                "disable_by_batch_size": 1024}
    return {"method": "draft_model", "num_speculative_tokens": k, "model": str(draft),
            "disable_by_batch_size": 1024}


REGIMES = {
    "plain": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    # 14 blocks of the target alone (7 beside a draft model) for 8 prompts needing 40.
    "preemption": {"kv_cache_memory_bytes": 14 * 2 * 16 * 2 * 16 * 4 * 2, "block_size": 16,
                   "max_model_len": 96},
    "sync": {"async_scheduling": False},
}


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_with_speculation_equals_transformers(target, shallow_draft, method, regime):
    path, prompts, expected = target
    tokens, stats, preemptions = _generate(path, prompts, _spec(method, shallow_draft),
                                           **REGIMES[regime])
    assert tokens == expected
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    if regime == "preemption":
        assert preemptions > 0


def test_a_draft_model_equal_to_the_target_is_always_accepted(target):
    path, prompts, expected = target
    tokens, stats, _ = _generate(path, prompts, _spec("draft_model", target[0], k=4))
    assert tokens == expected
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_prefix_cache_hits_with_speculation(target, shallow_draft, method):
    """A second pass over the same prompts is served from the prefix cache, whose
    blocks a speculating step wrote (a draft model's keys included)."""
    path, prompts, expected = target
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=512,
              speculative_config=_spec(method, shallow_draft))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        # Each prompt again, continued by its own output: hits cover the outputs too.
        longer = [p + t[:MAX_NEW // 2] for p, t in zip(prompts, first)]
        second = [o.outputs[0].token_ids
                  for o in llm.generate(longer, SamplingParams(
                      temperature=0.0, max_tokens=MAX_NEW // 2, ignore_eos=True), use_tqdm=False)]
        hits = llm.engine.core.scheduler.prefix_cache_stats.hits
    finally:
        llm.shutdown()
    assert first == expected
    assert second == [t[MAX_NEW // 2:] for t in expected]
    assert hits > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tensor_parallel_speculation_equals_transformers(target, shallow_draft, method):
    path, prompts, expected = target
    tokens, stats, _ = _generate(path, prompts, _spec(method, shallow_draft),
                                 tensor_parallel_size=2, distributed_executor_backend="mp")
    assert tokens == expected
    assert stats.num_accepted_tokens > 0


def test_speculation_switches_off_for_large_batches(target):
    path, prompts, expected = target
    spec = dict(_spec("ngram"), disable_by_batch_size=len(prompts))
    tokens, stats, _ = _generate(path, prompts, spec)
    assert tokens == expected
    # All prompts run together from the first step to the last: never below the bound.
    assert stats.num_draft_tokens == 0


# ------------------------------------------------ end to end, sampled distribution

def _exact_joint(path, prompt: list[int], temperature: float, top_k: int,
                 repetition_penalty: float, presence_penalty: float, length: int) -> dict:
    """The probability of every continuation of length tokens under transformers'
    logits, processed as spindle documents (penalties, then temperature and top-k)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def next_probs(tokens: list[int], outputs: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].double()
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[tokens] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / repetition_penalty,
                                               logits * repetition_penalty), logits)
        in_output = torch.zeros_like(seen)
        in_output[outputs] = True
        logits = logits - presence_penalty * in_output.double()
        logits = logits / temperature
        kth = logits.sort(descending=True).values[top_k - 1]
        return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), -1)

    joint = {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, prob in joint.items():
            probs = next_probs(prompt + list(seq), list(seq))
            for token in torch.nonzero(probs).flatten().tolist():
                grown[seq + (token,)] = prob * probs[token].item()
        joint = grown
    return joint


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_outputs_follow_the_target_distribution(target, shallow_draft, method):
    """Three sampled tokens per request, with penalties, temperature and top-k: the
    frequency of each continuation matches its exact probability (chi-square)."""
    path, prompts, greedy = target
    temperature, top_k, rep, presence, length = 0.9, 2, 1.1, 0.2, 3
    # The prompt, its greedy continuation and the prompt again, then the likeliest
    # continuation of that under these parameters (found beforehand), then all of it
    # again: the n-gram lookup then proposes drafts that are accepted about half the
    # time (a random model repeats little by itself).
    base = prompts[0] + greedy[0] + prompts[0]
    prompt = base + [292, 347, 307] + base
    num = 2400
    params = [SamplingParams(temperature=temperature, top_k=top_k, repetition_penalty=rep,
                             presence_penalty=presence, max_tokens=length, ignore_eos=True,
                             seed=1000 + i) for i in range(num)]
    tokens, stats, _ = _generate(path, [prompt] * num, _spec(method, shallow_draft, k=2), params,
                                 max_num_seqs=8, enable_prefix_caching=False)
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    exact = _exact_joint(path, prompt, temperature, top_k, rep, presence, length)
    observed = {}
    for t in tokens:
        observed[tuple(t)] = observed.get(tuple(t), 0) + 1
    assert set(observed) <= set(exact)
    keys = sorted(exact)
    counts = np.array([observed.get(k, 0) for k in keys], dtype=float)
    expected = np.array([exact[k] for k in keys]) * num
    assert chisquare(counts, expected * counts.sum() / expected.sum()).pvalue > P_VALUE


def test_seeded_requests_repeat_with_speculation(target, shallow_draft):
    path, prompts, _ = target
    params = SamplingParams(temperature=1.0, max_tokens=MAX_NEW, ignore_eos=True, seed=7)
    spec = _spec("draft_model", shallow_draft)
    first, _, _ = _generate(path, prompts[:3], spec, params)
    again, _, _ = _generate(path, prompts[:3], spec, params, max_num_seqs=1)
    assert first == again


# ----------------------------------------------------------------- configuration

@pytest.mark.parametrize("spec, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "speculative_config.model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "keys among"),
    ('{"method": "ngram", ', "JSON"),
])
def test_bad_speculative_configs_are_refused_by_name(target, spec, message):
    path, _, _ = target
    with pytest.raises(ValueError, match=message):
        LLM(str(path), device="cpu", speculative_config=spec)


def test_bad_combinations_are_refused(target, tiny_model):
    path, _, _ = target
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(str(path), device="cpu", speculative_config=ngram, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        LLM(str(path), device="cpu", speculative_config=ngram, enable_prompt_embeds=True,
            enable_prefix_caching=False)
    other_vocab = tiny_model(arch="llama", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(path), device="cpu", speculative_config={
            "method": "draft_model", "num_speculative_tokens": 2, "model": str(other_vocab)})
    hybrid = tiny_model(arch="bamba")
    with pytest.raises(ValueError, match="roll back"):
        LLM(str(hybrid), device="cpu", speculative_config=ngram)


def test_extended_lookup_continues_past_a_short_match():
    from spindle.runner.spec_decode.ngram import extended_lookup

    tokens = np.array([1, 2, 3, 1, 2, 3, 1, 2])
    # (1, 2) last matched at 3..4, followed by 3, 1, 2 and then the end: looking up
    # again on the tokens plus those drafts continues the cycle.
    assert ngram_lookup(tokens, 2, 2, 6) == [3, 1, 2]
    assert extended_lookup(tokens, 2, 2, 6) == [3, 1, 2, 3, 1, 2]
    assert extended_lookup(np.array([5, 6, 7]), 1, 2, 4) == []


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_logprobs_with_speculation_equal_those_without(target, shallow_draft, method):
    """Every token of a verifying step gets the logprobs of its own position."""
    path, prompts, expected = target
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)

    def run(spec):
        llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=512,
                  speculative_config=spec)
        try:
            return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()

    plain, spec = run(None), run(_spec(method, shallow_draft))
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        assert len(b.logprobs) == len(b.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert list(x) == list(y)
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 and x[t].rank == y[t].rank
                       for t in x)


# ------------------------------------------------------------ sleep, server, stats log

def test_sleep_level_2_reloads_the_draft_model_too(target, shallow_draft):
    """Level 2 drops both models' weights and the cache; after wake_up the draft
    proposes as before and the tokens are unchanged."""
    path, prompts, expected = target
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=512,
              enable_sleep_mode=True, speculative_config=_spec("draft_model", shallow_draft))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        accepted = llm.engine.core.scheduler.spec_decode_stats.num_accepted_tokens
        llm.sleep(2)
        llm.wake_up()
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.core.scheduler.spec_decode_stats
    finally:
        llm.shutdown()
    assert first == again == expected
    assert stats.num_accepted_tokens == 2 * accepted > 0  # the same acceptance both times


def test_server_takes_the_flag_and_exports_acceptance(target, tmp_path):
    import httpx

    from server_utils import RemoteServer, metric_value, wait_for

    path, prompts, expected = target
    spec = json.dumps(_spec("ngram"))
    server = RemoteServer(str(path), "--device", "cpu", "--dtype", "float32",
                          "--max-model-len", "512", "--speculative-config", spec,
                          log_path=tmp_path / "server.log")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            reply = http.post("/v1/completions", json={
                "model": str(path), "prompt": prompts, "max_tokens": MAX_NEW,
                "temperature": 0, "ignore_eos": True})
            assert reply.status_code == 200, reply.text
            num_choices = len(reply.json()["choices"])
            # (the engine loop records stats after it delivers a step's outputs)
            assert wait_for(lambda: metric_value(
                http.get("/metrics").text, "spindle:spec_decode_num_accepted_tokens_total") > 0)
            metrics = http.get("/metrics").text
            bad = http.post("/v1/completions", json={"model": str(path), "prompt": "x"})
    finally:
        server.stop()
    assert bad.status_code == 200  # (speculation changes nothing a client sends)
    assert num_choices == len(prompts)
    drafts = metric_value(metrics, "spindle:spec_decode_num_draft_tokens_total")
    accepted = metric_value(metrics, "spindle:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= drafts
    rate = metric_value(metrics, "spindle:spec_decode_acceptance_rate")
    assert rate == pytest.approx(accepted / drafts)


def test_bad_speculative_config_flag_is_refused_before_the_engine_starts(target, tmp_path):
    import subprocess
    import sys

    path, _, _ = target
    result = subprocess.run([sys.executable, "-m", "spindle", "generate", "--model", str(path),
                             "--device", "cpu", "--speculative-config",
                             '{"method": "medusa", "num_speculative_tokens": 2}', "x"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "speculative_config.method" in result.stderr


def test_stats_log_reports_acceptance(monkeypatch):
    import io
    import logging

    from spindle.engine import stats as stats_module
    from spindle.engine.stats import (EngineStats, IterationStats, LoggingStatLogger,
                                      SpecDecodeStats)

    clock = iter([0.0, 11.0])
    monkeypatch.setattr(stats_module.time, "monotonic", lambda: next(clock))
    spec = SpecDecodeStats()
    spec.observe(4, 3)
    spec.observe(4, 1)
    log = LoggingStatLogger(interval_s=10.0)
    # (a handler of its own: spindle's logger may not propagate to pytest's)
    text, target_logger = io.StringIO(), logging.getLogger("spindle.engine.stats")
    handler = logging.StreamHandler(text)
    target_logger.addHandler(handler)
    level, target_logger.level = target_logger.level, logging.INFO
    try:
        log.record(EngineStats(num_running=1, num_waiting=0, num_held=0, kv_cache_usage=0.1,
                               spec_decode=spec), IterationStats(num_generation_tokens=6))
    finally:
        target_logger.removeHandler(handler)
        target_logger.setLevel(level)
    assert spec.acceptance_rate == 0.5 and spec.mean_accepted_length == 3.0
    assert spec.accepted_by_position == [2, 1, 1, 0]
    assert "50.0% of 8 drafts accepted, 3.00 tokens per verifying step" in text.getvalue()


def _lookup_by_brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == suffix]
        if starts:
            return tokens[starts[-1] + n:starts[-1] + n + k]
    return []


def test_ngram_lookup_equals_a_brute_force_search():
    rng = random.Random(5)
    for _ in range(2000):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        low = rng.randrange(1, 4)
        high = low + rng.randrange(0, 4)
        k = rng.randrange(1, 6)
        assert ngram_lookup(np.array(tokens), low, high, k) == \
            _lookup_by_brute_force(tokens, low, high, k), (tokens, low, high, k)
