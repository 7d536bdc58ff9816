"""Tests of the sampler: seeding, filters, distribution, penalties, greedy, logprobs, min_tokens."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from spindle.runner.sample import Sampler, SamplerOutput, SamplingMetadata
from spindle.runner.sample.penalties import apply_penalties
from spindle.runner.sample.topk_topp import apply_min_p, apply_top_k_top_p

SAMPLER = Sampler()


# --------------------------------------------------------------------------- helpers


def make_metadata(temperature, *, top_k=None, top_p=None, min_p=None, generators=None,
                  max_num_logprobs=None, prompt_token_ids=None, output_token_ids=None,
                  frequency=None, presence=None, repetition=None, min_tokens_blocked=None,
                  vocab=None) -> SamplingMetadata:
    """Build metadata from per-row Python lists (None: feature off for every row)."""
    temps = torch.tensor(temperature, dtype=torch.float32)
    greedy = temps < 1e-5
    f32 = lambda v: None if v is None else torch.tensor(v, dtype=torch.float32)  # noqa: E731
    prompt = None
    if prompt_token_ids is not None:
        width = max((len(p) for p in prompt_token_ids), default=0)
        prompt = torch.full((len(prompt_token_ids), width), vocab, dtype=torch.int64)
        for i, ids in enumerate(prompt_token_ids):
            prompt[i, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return SamplingMetadata(
        temperature=temps,
        all_greedy=bool(greedy.all()),
        all_random=bool((~greedy).all()),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int64),
        top_p=f32(top_p),
        min_p=f32(min_p),
        generators=generators or {},
        max_num_logprobs=max_num_logprobs,
        prompt_token_ids=prompt,
        output_token_ids=output_token_ids or [],
        frequency_penalties=f32(frequency),
        presence_penalties=f32(presence),
        repetition_penalties=f32(repetition),
        min_tokens_blocked=min_tokens_blocked or {},
    )


def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """Plain float64 reference of the distribution a random row samples from."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    order = np.argsort(-x, kind="stable")
    if top_k:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        q = p * keep
        q /= q.sum()
        mass = 0.0
        for i in order:
            if not keep[i]:
                continue
            if mass >= top_p:
                keep[i] = False
            else:
                mass += q[i]
    out = p * keep
    return out / out.sum()


def reference_penalties(logits, prompt, output, rep, freq, pres) -> list[float]:
    """vLLM's penalties for one row, one token at a time."""
    result = []
    for token, value in enumerate(logits):
        if token in prompt or token in output:
            value = value / rep if value > 0 else value * rep
        count = output.count(token)
        value -= freq * count
        value -= pres * (count > 0)
        result.append(value)
    return result


def chi_square_critical(df: int, z: float = 3.0902) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.0902: p = 0.999)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    n = counts.sum()
    kept = probs > 0
    expected = n * probs[kept]
    assert expected.min() >= 5, "test design: every kept token needs an expected count >= 5"
    stat = float((((counts[kept] - expected) ** 2) / expected).sum())
    return stat, int(kept.sum()) - 1


# ------------------------------------------------------- (a) seeded reproducibility


def _seeded_stream_alone(step_logits, seed):
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    for logits in step_logits:
        meta = make_metadata([1.5], top_k=[40], top_p=[0.97], generators={0: generator})
        tokens.append(int(SAMPLER(logits.unsqueeze(0), meta).sampled_token_ids[0]))
    return tokens


def _seeded_stream_in_batch(step_logits, seed, row=3):
    generator = torch.Generator().manual_seed(seed)
    other = torch.Generator().manual_seed(seed + 1)
    tokens = []
    for logits in step_logits:
        batch = torch.randn(5, logits.shape[0]) * 2
        batch[row] = logits
        meta = make_metadata(
            [0.7, 1.0, 0.0, 1.5, 2.0], top_k=[5, 0, 0, 40, 3], top_p=[1.0, 0.5, 1.0, 0.97, 0.9],
            generators={1: other, row: generator})
        tokens.append(int(SAMPLER(batch, meta).sampled_token_ids[row]))
    return tokens


def test_seeded_sampling_reproducible_across_runs_and_batch_positions():
    gen = torch.Generator().manual_seed(7)
    step_logits = [torch.randn(64, generator=gen) for _ in range(12)]

    torch.manual_seed(1)
    alone = _seeded_stream_alone(step_logits, seed=1234)
    torch.manual_seed(2)
    alone_again = _seeded_stream_alone(step_logits, seed=1234)
    torch.manual_seed(3)
    in_batch = _seeded_stream_in_batch(step_logits, seed=1234)

    assert alone == alone_again == in_batch
    assert len(set(alone)) > 1, "the stream should actually be random"
    assert _seeded_stream_alone(step_logits, seed=4321) != alone


def test_seeded_row_draws_exactly_v_exponentials_from_its_generator():
    """The contract that makes a seeded stream independent of its batch: argmax(p / E)
    with E the next V exponentials of the row's own generator."""
    vocab, temperature = 32, 1.3
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    ours = torch.Generator().manual_seed(99)
    reference = torch.Generator().manual_seed(99)
    for _ in range(5):
        meta = make_metadata([1.0, temperature, 0.0, 0.8], generators={1: ours})
        token = int(SAMPLER(logits, meta).sampled_token_ids[1])
        noise = torch.empty(vocab).exponential_(generator=reference)
        probs = (logits[1] / temperature).softmax(-1)
        assert token == int((probs / noise).argmax())


def test_unseeded_rows_use_default_generator():
    logits = torch.zeros(1, 1000)
    meta = make_metadata([1.0])
    torch.manual_seed(5)
    first = SAMPLER(logits, meta).sampled_token_ids
    torch.manual_seed(5)
    assert torch.equal(SAMPLER(logits, meta).sampled_token_ids, first)
    draws = {int(SAMPLER(logits, meta).sampled_token_ids[0]) for _ in range(10)}
    assert len(draws) > 1


# ------------------------------------------------------------- (b) filters exclude

FILTER_CASES = [
    # temperature, top_k, top_p, min_p
    (1.0, 5, 1.0, 0.0),
    (1.0, 0, 0.5, 0.0),
    (1.0, 0, 1.0, 0.2),
    (0.8, 8, 0.7, 0.05),
    (2.0, 12, 0.9, 0.1),
    (1.0, 1000, 1.0, 0.0),  # k above the vocabulary: no filtering
    (1.0, 0, 1e-6, 0.0),  # tiny top_p: only the best token
    (1.0, 0, 1.0, 1.0),  # min_p 1: only the best token
]


def test_filters_never_emit_excluded_tokens():
    torch.manual_seed(0)
    vocab, repeats = 32, 400
    logits_row = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 2
    temps, ks, ps, mins = zip(*[case for case in FILTER_CASES for _ in range(repeats)])
    logits = logits_row.repeat(len(temps), 1)
    meta = make_metadata(list(temps), top_k=list(ks), top_p=list(ps), min_p=list(mins))
    tokens = SAMPLER(logits, meta).sampled_token_ids.view(len(FILTER_CASES), repeats)

    for case, row_tokens in zip(FILTER_CASES, tokens):
        allowed = reference_probs(logits_row.tolist(), *case) > 0
        emitted = set(row_tokens.tolist())
        assert all(allowed[t] for t in emitted), f"{case}: emitted excluded tokens"
        assert int(np.argmax(logits_row.numpy())) in emitted
    assert set(tokens[-1].tolist()) == set(tokens[-2].tolist()) == {int(logits_row.argmax())}


def test_top_k_keeps_ties_at_the_boundary():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2]), None)
    assert torch.isinf(out[0, 3:]).all() and torch.isfinite(out[0, :3]).all()


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = lambda p: torch.isfinite(  # noqa: E731
        apply_top_k_top_p(logits, None, torch.tensor([p]))[0]).tolist()
    assert kept(0.5) == [True, False, False, False]
    assert kept(0.6) == [True, True, False, False]
    assert kept(0.85) == [True, True, True, False]
    assert kept(1.0) == [True, True, True, True]


def test_min_p_relative_to_best_token():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = apply_min_p(probs.log(), torch.tensor([0.4]))  # drop p < 0.2
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    assert torch.equal(apply_min_p(probs.log(), torch.tensor([0.0])), probs.log())


# ------------------------------------------------------------- (c) distribution


DISTRIBUTION_CASES = [
    # temperature, top_k, top_p, min_p
    (0.7, 0, 1.0, 0.0),
    (1.3, 5, 1.0, 0.0),
    (1.0, 0, 0.8, 0.0),
    (1.2, 0, 1.0, 0.15),
    (0.9, 6, 0.9, 0.05),
]
DIST_LOGITS = [2.0, 1.5, 1.2, 1.0, 0.3, 0.0, -0.5, -1.0]


@pytest.mark.parametrize("case", DISTRIBUTION_CASES)
def test_sampled_distribution_matches_reference(case):
    torch.manual_seed(1000 + DISTRIBUTION_CASES.index(case))
    temperature, top_k, top_p, min_p = case
    n, vocab = 20000, len(DIST_LOGITS)
    logits = torch.tensor(DIST_LOGITS).repeat(n, 1)
    meta = make_metadata([temperature] * n, top_k=[top_k] * n, top_p=[top_p] * n,
                         min_p=[min_p] * n)
    tokens = SAMPLER(logits, meta).sampled_token_ids
    counts = np.bincount(tokens.numpy(), minlength=vocab)
    probs = reference_probs(DIST_LOGITS, temperature, top_k, top_p, min_p)

    assert (counts[probs == 0] == 0).all()
    stat, df = chi_square(counts, probs)
    assert stat < chi_square_critical(df), (stat, df, counts, probs)


def test_seeded_rows_follow_the_distribution():
    n, case = 4000, (1.1, 6, 0.95, 0.02)
    logits = torch.tensor(DIST_LOGITS).repeat(n, 1)
    generators = {i: torch.Generator().manual_seed(10_000 + i) for i in range(n)}
    meta = make_metadata([case[0]] * n, top_k=[case[1]] * n, top_p=[case[2]] * n,
                         min_p=[case[3]] * n, generators=generators)
    counts = np.bincount(SAMPLER(logits, meta).sampled_token_ids.numpy(),
                         minlength=len(DIST_LOGITS))
    probs = reference_probs(DIST_LOGITS, *case)
    assert (counts[probs == 0] == 0).all()
    stat, df = chi_square(counts, probs)
    assert stat < chi_square_critical(df)


def test_chi_square_critical_is_close_to_table_values():
    # Table values of the 0.999 quantile.
    for df, table in [(1, 10.828), (4, 18.467), (7, 24.322), (20, 45.315)]:
        assert abs(chi_square_critical(df) - table) / table < 0.05


# ------------------------------------------------------------------ (d) penalties


def _random_penalty_case(seed, batch=6, vocab=30):
    rng = random.Random(seed)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 10))] for _ in range(batch)]
    outputs = [[rng.randrange(vocab // 2) for _ in range(rng.randrange(0, 15))] for _ in range(batch)]
    rep = [rng.uniform(0.5, 2.0) for _ in range(batch)]
    freq = [rng.uniform(-2.0, 2.0) for _ in range(batch)]
    pres = [rng.uniform(-2.0, 2.0) for _ in range(batch)]
    return logits, prompts, outputs, rep, freq, pres


@pytest.mark.parametrize("seed", range(5))
def test_penalties_match_reference(seed):
    logits, prompts, outputs, rep, freq, pres = _random_penalty_case(seed)
    vocab = logits.shape[1]
    meta = make_metadata([1.0] * len(prompts), prompt_token_ids=prompts, output_token_ids=outputs,
                         repetition=rep, frequency=freq, presence=pres, vocab=vocab)
    original = logits.clone()
    got = apply_penalties(logits, meta)
    want = [reference_penalties(logits[b].tolist(), prompts[b], outputs[b], rep[b], freq[b], pres[b])
            for b in range(len(prompts))]
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=1e-5)
    assert torch.equal(logits, original), "apply_penalties must not modify its input"


def test_penalties_with_only_some_kinds_and_no_outputs():
    logits, prompts, _, rep, _, _ = _random_penalty_case(11)
    vocab = logits.shape[1]
    meta = make_metadata([1.0] * len(prompts), prompt_token_ids=prompts, repetition=rep,
                         vocab=vocab)
    want = [reference_penalties(logits[b].tolist(), prompts[b], [], rep[b], 0.0, 0.0)
            for b in range(len(prompts))]
    torch.testing.assert_close(apply_penalties(logits, meta), torch.tensor(want))


def test_no_penalties_is_identity():
    logits = torch.randn(3, 10)
    assert apply_penalties(logits, make_metadata([1.0, 1.0, 0.0])) is logits


# -------------------------------------------------------------------- (e) greedy


def test_greedy_is_argmax_of_penalised_logits():
    logits, prompts, outputs, rep, freq, pres = _random_penalty_case(3)
    batch, vocab = logits.shape
    meta = make_metadata([0.0] * batch, prompt_token_ids=prompts, output_token_ids=outputs,
                         repetition=rep, frequency=freq, presence=pres, vocab=vocab)
    assert meta.all_greedy
    want = torch.tensor([reference_penalties(logits[b].tolist(), prompts[b], outputs[b],
                                             rep[b], freq[b], pres[b]) for b in range(batch)])
    got = SAMPLER(logits, meta).sampled_token_ids
    assert got.dtype == torch.int64
    assert torch.equal(got, want.argmax(-1))
    # The penalties matter for this case (otherwise the test proves nothing).
    assert not torch.equal(got, logits.argmax(-1))


def test_mixed_greedy_and_random_batch():
    torch.manual_seed(0)
    vocab, batch = 50, 4
    logits = torch.randn(batch, vocab)
    temps = [0.0, 5.0, 0.0, 5.0]
    meta = make_metadata(temps, top_k=[0, 0, 3, 0], top_p=[1.0, 1.0, 1.0, 0.99])
    assert not meta.all_greedy and not meta.all_random
    draws = torch.stack([SAMPLER(logits, meta).sampled_token_ids for _ in range(50)])
    argmax = logits.argmax(-1)
    assert (draws[:, 0] == argmax[0]).all() and (draws[:, 2] == argmax[2]).all()
    assert len(set(draws[:, 1].tolist())) > 5 and len(set(draws[:, 3].tolist())) > 5


def test_fast_path_flags_do_not_change_results():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))

    def seeded_run(all_random):
        gens = {i: torch.Generator().manual_seed(i) for i in range(3)}
        meta = make_metadata([0.9, 1.2, 2.0], top_k=[10, 0, 5], top_p=[0.9, 0.8, 1.0],
                             generators=gens)
        meta.all_random = all_random
        return SAMPLER(logits, meta).sampled_token_ids

    assert torch.equal(seeded_run(True), seeded_run(False))
    greedy = make_metadata([0.0, 0.0, 0.0])
    slow = make_metadata([0.0, 0.0, 0.0])
    slow.all_greedy = False
    assert torch.equal(SAMPLER(logits, greedy).sampled_token_ids,
                       SAMPLER(logits, slow).sampled_token_ids)


def test_plain_greedy_steps_take_the_argmax_of_the_logits_as_they_come(monkeypatch):
    """All greedy and nothing to report or mask: the argmax of the logits in their own
    dtype (bf16 here), no float32 copy; the same tokens as the full path. With
    logprobs wanted, min_tokens or penalties the full path runs (it widens)."""
    from spindle.runner.sample import sampler as sampler_module

    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(4)).bfloat16()
    logits[1, [7, 90]] = 12.0  # a tie: the first index
    widened = []
    original_draw = Sampler.draw
    monkeypatch.setattr(Sampler, "draw", lambda self, x, m: widened.append(x.dtype)
                        or original_draw(self, x, m))
    plain = make_metadata([0.0] * 5)
    assert sampler_module.argmax_suffices(plain)
    got = SAMPLER(logits, plain)
    assert widened == []
    assert torch.equal(got.sampled_token_ids, logits.float().argmax(-1))
    assert got.sampled_token_ids[1].item() == 7 and got.logprobs is None
    for meta in (make_metadata([0.0] * 5, max_num_logprobs=2),
                 make_metadata([0.0] * 5, min_tokens_blocked={0: {3}}),
                 make_metadata([0.0] * 5, prompt_token_ids=[[1]] * 5, output_token_ids=[[]] * 5,
                               repetition=[1.3] * 5, frequency=[0.0] * 5, presence=[0.0] * 5,
                               vocab=300)):
        assert not sampler_module.argmax_suffices(meta)
        SAMPLER(logits, meta)
    assert len(widened) == 3
    with pytest.raises(ValueError, match=r"logits must be \[batch, vocab\]"):
        SAMPLER(logits[0], plain)


# ------------------------------------------------------------------ (f) logprobs


def test_logprobs_are_raw_and_independent_of_sampling_knobs():
    torch.manual_seed(0)
    logits, prompts, outputs, rep, freq, pres = _random_penalty_case(4)
    batch, vocab = logits.shape
    k = 5
    raw = torch.log_softmax(logits, dim=-1)
    knobs = make_metadata([0.0, 0.5, 2.0, 0.0, 1.0, 3.0], top_k=[0, 3, 0, 0, 10, 0],
                          top_p=[1.0, 1.0, 0.5, 1.0, 0.9, 1.0], max_num_logprobs=k,
                          prompt_token_ids=prompts, output_token_ids=outputs, repetition=rep,
                          frequency=freq, presence=pres, vocab=vocab)
    plain = make_metadata([0.0] * batch, max_num_logprobs=k)

    for meta in (knobs, plain):
        out = SAMPLER(logits, meta)
        assert out.logprob_token_ids.shape == out.logprobs.shape == (batch, k + 1)
        assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
        torch.testing.assert_close(out.logprobs, raw.gather(1, out.logprob_token_ids))
        torch.testing.assert_close(out.logprobs[:, 1:], raw.topk(k, dim=-1).values)
        want_ranks = (raw > raw.gather(1, out.sampled_token_ids[:, None])).sum(-1) + 1
        assert torch.equal(out.sampled_ranks, want_ranks)
    # Greedy with no penalties always picks the best token: rank 1.
    assert (SAMPLER(logits, plain).sampled_ranks == 1).all()


def test_processed_logprobs_are_those_of_the_distribution_sampled_from():
    """logprobs_mode="processed_logprobs": the sampled token's logprob (and the top-k)
    come from the logits it was drawn from: penalised, then for random rows divided by
    the temperature and filtered (filtered tokens -inf); computed here in float64 from
    the definition (reference_probs), not from the sampler's own code."""
    torch.manual_seed(1)
    logits, prompts, outputs, rep, freq, pres = _random_penalty_case(4)
    batch, vocab = logits.shape
    temps, top_k, top_p = [0.0, 0.5, 2.0, 0.0, 1.0, 0.7], [0, 3, 0, 0, 10, 0], \
        [1.0, 1.0, 0.5, 1.0, 0.9, 1.0]
    meta = make_metadata(temps, top_k=top_k, top_p=top_p, max_num_logprobs=4,
                         prompt_token_ids=prompts, output_token_ids=outputs, repetition=rep,
                         frequency=freq, presence=pres, vocab=vocab)
    out = Sampler(processed=True)(logits, meta)
    penalised = apply_penalties(logits.clone(), meta)
    for row in range(batch):
        if temps[row] == 0.0:
            want = torch.log_softmax(penalised[row].double(), -1).numpy()
        else:
            with np.errstate(divide="ignore"):
                want = np.log(reference_probs(penalised[row].numpy(), temps[row], top_k[row],
                                              top_p[row]))
        got = out.logprobs[row].double().numpy()
        ids = out.logprob_token_ids[row].numpy()
        np.testing.assert_allclose(got, want[ids], rtol=1e-5, atol=1e-5)
        assert np.isfinite(got[0])  # the sampled token was never filtered out
        top = np.sort(want)[::-1][:4]
        np.testing.assert_allclose(got[1:], top, rtol=1e-5, atol=1e-5)


def test_logprob_ranks_with_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0],
                           [5.0, 2.0, 2.0, 1.0, -1.0]])
    # Row 1 cannot pick tokens 0 and 1, so greedily picks 2, tied with 1 behind token 0.
    meta = make_metadata([0.0, 0.0], max_num_logprobs=3, min_tokens_blocked={1: {0, 1}})
    out = SAMPLER(logits, meta)
    assert int(out.sampled_token_ids[0]) in {1, 2, 4}
    assert int(out.sampled_token_ids[1]) == 2
    assert out.sampled_ranks.tolist() == [1, 2]
    assert set(out.logprob_token_ids[0, 1:].tolist()) == {1, 2, 4}
    assert out.logprob_token_ids[1, 1].item() == 0
    assert set(out.logprob_token_ids[1, 2:].tolist()) == {1, 2}


def test_logprobs_zero_none_and_above_vocab():
    logits = torch.randn(2, 6)
    out = SAMPLER(logits, make_metadata([0.0, 1.0], max_num_logprobs=0))
    assert out.logprobs.shape == (2, 1) and out.sampled_ranks.shape == (2,)
    out = SAMPLER(logits, make_metadata([0.0, 1.0]))
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_ranks is None
    out = SAMPLER(logits, make_metadata([0.0, 1.0], max_num_logprobs=20))
    assert out.logprobs.shape == (2, 7)  # capped at the vocabulary size


# ---------------------------------------------------------------- (g) min_tokens


def test_min_tokens_blocking_prevents_blocked_ids():
    torch.manual_seed(0)
    vocab = 20
    logits = torch.randn(1, vocab).repeat(300, 1)
    best = int(logits[0].argmax())
    blocked = {best, (best + 1) % vocab, 10_000}  # an id outside the vocabulary is ignored
    temps = [0.0] * 100 + [1.0] * 200
    blocked_rows = {row: blocked for row in range(0, 300, 2)}
    meta = make_metadata(temps, min_tokens_blocked=blocked_rows)
    original = logits.clone()
    tokens = SAMPLER(logits, meta).sampled_token_ids
    assert torch.equal(logits, original), "the sampler must not modify its input"

    assert not any(int(tokens[row]) in blocked for row in blocked_rows)
    second_best = int(logits[0].masked_fill(
        torch.isin(torch.arange(vocab), torch.tensor(sorted(blocked - {10_000}))),
        float("-inf")).argmax())
    assert all(int(tokens[row]) == second_best for row in range(0, 100, 2))
    assert all(int(tokens[row]) == best for row in range(1, 100, 2))


def test_allowed_token_ids_restrict_greedy_and_random_rows():
    """Rows with allowed ids sample only those (greedy: the best of them; random: a draw
    among them); the others are untouched; logprobs stay the raw model's."""
    torch.manual_seed(1)
    vocab = 30
    logits = torch.randn(1, vocab).repeat(200, 1)
    order = logits[0].argsort(descending=True).tolist()
    allowed = [order[5], order[9], order[20], 10_000]  # (an id outside the vocabulary: ignored)
    temps = [0.0] * 100 + [1.0] * 100
    rows = {row: allowed for row in range(0, 200, 2)}
    meta = make_metadata(temps, min_tokens_blocked={})
    meta.allowed_token_ids = rows
    meta.max_num_logprobs = 0
    out = SAMPLER(logits, meta)
    tokens = out.sampled_token_ids.tolist()
    assert all(tokens[row] == order[5] for row in range(0, 100, 2))  # the best allowed
    assert all(tokens[row] == order[0] for row in range(1, 100, 2))  # unrestricted greedy
    assert all(tokens[row] in allowed for row in range(100, 200, 2))
    assert len({tokens[row] for row in range(100, 200, 2)}) > 1  # still a draw among them
    raw = torch.log_softmax(logits[0], -1)
    assert abs(float(out.logprobs[0, 0]) - float(raw[order[5]])) < 1e-5


def test_allowed_token_ids_are_checked():
    from spindle.sampling_params import SamplingParams

    for bad in ([], [-1], [1.5], "12"):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    assert SamplingParams(allowed_token_ids=(3, 4)).allowed_token_ids == [3, 4]


def test_logit_bias_is_added_before_greedy_and_random_rows():
    """Biased rows pick from logits + bias (greedy: its argmax; random: a draw that
    favours the pushed-up token); other rows are untouched; raw logprobs ignore it."""
    torch.manual_seed(2)
    vocab = 30
    logits = torch.randn(1, vocab).repeat(200, 1)
    order = logits[0].argsort(descending=True).tolist()
    up = order[12]
    meta = make_metadata([0.0] * 100 + [1.0] * 100, min_tokens_blocked={})
    rows = list(range(0, 200, 2))
    meta.logit_bias = (torch.tensor([r for r in rows for _ in range(2)]),
                       torch.tensor([order[0], up] * len(rows)),
                       torch.tensor([-100.0, 20.0] * len(rows)))
    meta.max_num_logprobs = 0
    out = SAMPLER(logits, meta)
    tokens = out.sampled_token_ids.tolist()
    assert all(tokens[row] == up for row in range(0, 100, 2))
    assert all(tokens[row] == order[0] for row in range(1, 100, 2))
    assert sum(tokens[row] == up for row in range(100, 200, 2)) >= 45  # e^20 ahead
    raw = torch.log_softmax(logits[0], -1)
    assert abs(float(out.logprobs[0, 0]) - float(raw[up])) < 1e-5


# --------------------------------------------------------------- (h) temperature -> 0


def test_small_temperature_matches_greedy():
    torch.manual_seed(0)
    logits, prompts, outputs, rep, freq, pres = _random_penalty_case(8, batch=4, vocab=25)
    # Make the penalised logits' best token clearly ahead, so the limit is sharp.
    penalised = torch.tensor([reference_penalties(logits[b].tolist(), prompts[b], outputs[b],
                                                  rep[b], freq[b], pres[b]) for b in range(4)])
    top2 = penalised.topk(2, dim=-1).values
    assert ((top2[:, 0] - top2[:, 1]) > 0.01).all()
    kwargs = dict(prompt_token_ids=prompts, output_token_ids=outputs, repetition=rep,
                  frequency=freq, presence=pres, vocab=25)
    greedy = SAMPLER(logits, make_metadata([0.0] * 4, **kwargs)).sampled_token_ids
    assert torch.equal(greedy, penalised.argmax(-1))
    for temperature in (1e-3, 1e-4, 1e-6):  # 1e-6 is below the greedy threshold
        for _ in range(20):
            meta = make_metadata([temperature, 0.0, temperature, 1.0], **kwargs)
            tokens = SAMPLER(logits, meta).sampled_token_ids
            assert tokens[:3].tolist() == greedy[:3].tolist()


def test_sampler_output_type_and_dtype():
    out = SAMPLER(torch.randn(3, 9), make_metadata([1.0, 0.0, 0.5]))
    assert isinstance(out, SamplerOutput)
    assert out.sampled_token_ids.dtype == torch.int64 and out.sampled_token_ids.shape == (3,)


# ---------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_full_path_without_host_sync():
    device, batch, vocab = "cuda", 6, 5000
    gens = {1: torch.Generator(device=device).manual_seed(1),
            4: torch.Generator(device=device).manual_seed(2)}
    meta = make_metadata([0.0, 1.0, 0.7, 1.3, 2.0, 0.0], top_k=[0, 5, 50, 0, 10, 0],
                         top_p=[1.0, 0.9, 0.8, 1.0, 0.95, 1.0], min_p=[0.0, 0.05, 0.0, 0.1, 0.0, 0.0],
                         generators=gens, max_num_logprobs=3,
                         prompt_token_ids=[[1, 2, 3]] * batch, output_token_ids=[[4, 4, 5]] * batch,
                         repetition=[1.1] * batch, frequency=[0.5] * batch, presence=[0.2] * batch,
                         min_tokens_blocked={0: {2, 3}}, vocab=vocab)
    meta.logit_bias = tuple(torch.tensor(values, device=device)
                            for values in ([1, 3], [7, 9], [2.0, -1.0]))
    for name in ("temperature", "top_k", "top_p", "min_p", "prompt_token_ids",
                 "repetition_penalties", "frequency_penalties", "presence_penalties"):
        setattr(meta, name, getattr(meta, name).to(device))
    logits = torch.randn(batch, vocab, device=device)
    SAMPLER(logits, meta)  # warm-up: first calls may lazily initialise CUDA state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = SAMPLER(logits, meta)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out.sampled_token_ids.device.type == "cuda"
    assert out.logprobs.shape == (batch, 4)
