"""The gated delta rule (spindle/layers/mamba/gated_delta.py, the linear attention of
Qwen3-Next, Qwen3.5 and OLMo Hybrid) against transformers' token-by-token reference
(``torch_recurrent_gated_delta_rule``, run in float64), on fresh random inputs: packed
requests of ragged lengths (one token, under a chunk, several chunks), some continuing a
stored state, grouped heads (a key head serving several value heads), padding rows that
must leave every state alone; and the Triton decode step against the torch one.

Tolerance: 1e-5 relative to the largest reference value (float32 sums against
float64; the chunked form solves a triangular system per chunk)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_utils import DEVICE, HALF, pick

from spindle.layers.mamba import gated_delta
from spindle.layers.mamba.metadata import MambaMetadata

TOL = 1e-5
NUM_SLOTS = 6


def _inputs(tokens, key_heads, value_heads, key_dim, value_dim, seed, device="cpu",
            dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype).to(device)

    return dict(q=randn(tokens, key_heads, key_dim), k=randn(tokens, key_heads, key_dim),
                v=randn(tokens, value_heads, value_dim), a=randn(tokens, value_heads),
                b=randn(tokens, value_heads, scale=2.0),
                A_log=(torch.rand(value_heads, generator=g) * 2.5).to(device),
                dt_bias=randn(value_heads).float())


def _reference(x, rows, initial, beta_scale=1.0):
    """transformers' recurrent rule over rows (a slice), float64, from initial [Hv, Dk, Dv]
    (beta times beta_scale, as OLMo Hybrid's layer scales it before the rule)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_recurrent_gated_delta_rule)

    d = {k: v.double() for k, v in x.items()}
    g = -d["A_log"].exp() * F.softplus(d["a"][rows] + d["dt_bias"])
    beta = torch.sigmoid(x["b"][rows]).double() * beta_scale
    out, state = torch_recurrent_gated_delta_rule(
        d["q"][rows][None], d["k"][rows][None], d["v"][rows][None], g[None], beta[None],
        initial_state=initial.double()[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    return out[0], state[0]


def _close(out, ref, what):
    scale = max(ref.abs().max().item(), 1e-6)
    torch.testing.assert_close(out.double().cpu(), ref.double().cpu(), atol=TOL * scale,
                               rtol=TOL, msg=lambda m: f"{what}: {m}")


def _check_requests(out, state, x, before, lens, slots, has_init, beta_scale):
    """Each packed request's outputs and final state (where it has a slot) against the
    token-by-token rule from its entering state (before[slot], or zeros)."""
    start = 0
    for n, slot, init in zip(lens, slots, has_init):
        rows = slice(start, start + n)
        initial = before[slot] if init else torch.zeros_like(before[0])
        ref_out, ref_state = _reference(x, rows, initial, beta_scale)
        _close(out[rows], ref_out, f"output of the request at slot {slot}")
        if slot >= 0:
            _close(state[slot], ref_state, f"state of slot {slot}")
        start += n


def _metadata(lens, slots, has_init):
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    return MambaMetadata(num_reqs=len(lens), num_tokens=sum(lens), query_start_loc=qsl,
                         state_indices=torch.tensor(slots, dtype=torch.int32),
                         has_initial_state=torch.tensor(has_init), max_query_len=max(lens),
                         query_start_loc_cpu=qsl)


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("key_heads,value_heads,key_dim,value_dim,chunk,beta_scale", [
    (2, 2, 16, 8, 8, 1.0), (1, 3, 8, 16, 5, 2.0), (2, 6, 16, 8, 64, 1.0)])
def test_prefill_equals_the_token_by_token_rule(key_heads, value_heads, key_dim, value_dim,
                                                chunk, beta_scale, batched):
    """Both evaluations: request by request (the CPU's) and all chunks batched (CUDA's)."""
    lens, slots, has_init = [1, 4, 19, 7], [3, 0, 5, -1], [True, False, True, False]
    x = _inputs(sum(lens), key_heads, value_heads, key_dim, value_dim, seed=chunk)
    state = torch.randn(NUM_SLOTS, value_heads, key_dim, value_dim)
    before = state.clone()
    out = gated_delta.gated_delta_prefill(**x, state=state, md=_metadata(lens, slots, has_init),
                                          chunk_size=chunk, batched=batched,
                                          beta_scale=beta_scale)
    _check_requests(out, state, x, before, lens, slots, has_init, beta_scale)
    for untouched in (1, 2, 4):
        assert torch.equal(state[untouched], before[untouched])


def test_the_batched_prefill_plans_once_per_step():
    """The chunk plan of a step is made by the first layer and reused by the others
    (md.derived): a second layer with other weights gets its own right answer from it."""
    lens, slots, has_init = [3, 20, 9], [0, 2, -1], [True, False, False]
    md = _metadata(lens, slots, has_init)
    for layer in range(2):
        x = _inputs(sum(lens), 2, 4, 16, 8, seed=20 + layer)
        state = torch.randn(NUM_SLOTS, 4, 16, 8)
        expected_state = state.clone()
        expected = gated_delta.gated_delta_prefill(**x, state=expected_state,
                                                   md=_metadata(lens, slots, has_init),
                                                   chunk_size=8, batched=False)
        got = gated_delta.gated_delta_prefill(**x, state=state, md=md, chunk_size=8,
                                              batched=True)
        assert [key for key in md.derived if key.startswith("gated_delta_plan")] == \
            ["gated_delta_plan/8/cpu"]
        _close(got, expected, f"layer {layer}'s output")
        _close(state, expected_state, f"layer {layer}'s states")


@pytest.mark.parametrize("beta_scale", [1.0, 2.0])
def test_decode_equals_the_token_by_token_rule(beta_scale):
    slots = [4, -1, 0, 2]
    x = _inputs(len(slots), 2, 4, 16, 8, seed=7)
    state = torch.randn(NUM_SLOTS, 4, 16, 8)
    before = state.clone()
    out = gated_delta.gated_delta_decode(**x, state=state,
                                         state_indices=torch.tensor(slots, dtype=torch.int32),
                                         beta_scale=beta_scale)
    for row, slot in enumerate(slots):
        initial = before[slot] if slot >= 0 else torch.zeros_like(before[0])
        ref_out, ref_state = _reference(x, slice(row, row + 1), initial, beta_scale)
        _close(out[row], ref_out[0], f"row {row}")
        if slot >= 0:
            _close(state[slot], ref_state, f"state of slot {slot}")
    for untouched in (1, 3, 5):
        assert torch.equal(state[untouched], before[untouched])


def _feature_inputs(tokens, heads, key_dim, value_dim, seed):
    """Kimi delta attention's: a and dt_bias per key feature."""
    x = _inputs(tokens, heads, heads, key_dim, value_dim, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x["a"] = torch.randn(tokens, heads, key_dim, generator=g)
    x["dt_bias"] = torch.randn(heads, key_dim, generator=g)
    return x


def _feature_reference(x, rows, initial):
    """transformers' recurrent Kimi delta attention over rows, float64."""
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        recurrent_kimi_delta_attention)

    d = {k: v.double() for k, v in x.items()}
    g = -d["A_log"].exp()[:, None] * F.softplus(d["a"][rows] + d["dt_bias"])
    beta = torch.sigmoid(x["b"][rows]).double()
    out, state = recurrent_kimi_delta_attention(
        d["q"][rows][None], d["k"][rows][None], d["v"][rows][None], g[None], beta[None],
        initial_state=initial.double()[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    return out[0], state[0]


@pytest.mark.parametrize("batched,slice_elements", [(False, None), (True, None), (True, 1)])
@pytest.mark.parametrize("heads,key_dim,value_dim,chunk", [(2, 16, 8, 8), (3, 8, 16, 5)])
def test_a_decay_per_key_feature_equals_kimi_delta_attention(heads, key_dim, value_dim,
                                                            chunk, batched, slice_elements,
                                                            monkeypatch):
    """a [T, H, Dk] and dt_bias [H, Dk] (KimiLinear's KDA): the prefill, both ways (the
    batched one also with its decays built one chunk at a time), and the decode step
    against transformers' token-by-token rule."""
    if slice_elements is not None:
        monkeypatch.setattr(gated_delta, "PER_FEATURE_SLICE_ELEMENTS", slice_elements)
    lens, slots, has_init = [1, 4, 19, 7], [3, 0, 5, -1], [True, False, True, False]
    x = _feature_inputs(sum(lens), heads, key_dim, value_dim, seed=chunk)
    state = torch.randn(NUM_SLOTS, heads, key_dim, value_dim)
    before = state.clone()
    out = gated_delta.gated_delta_prefill(**x, state=state, md=_metadata(lens, slots, has_init),
                                          chunk_size=chunk, batched=batched)
    start = 0
    for n, slot, init in zip(lens, slots, has_init):
        rows = slice(start, start + n)
        ref_out, ref_state = _feature_reference(
            x, rows, before[slot] if init else torch.zeros_like(before[0]))
        _close(out[rows], ref_out, f"output of the request at slot {slot}")
        if slot >= 0:
            _close(state[slot], ref_state, f"state of slot {slot}")
        start += n
    assert all(torch.equal(state[i], before[i]) for i in (1, 2, 4))

    step = {**x, "a": x["a"][:3], "b": x["b"][:3], "q": x["q"][:3], "k": x["k"][:3],
            "v": x["v"][:3]}
    decode_slots = [4, -1, 0]
    before = state.clone()
    out = gated_delta.gated_delta_decode(
        **step, state=state, state_indices=torch.tensor(decode_slots, dtype=torch.int32))
    for row, slot in enumerate(decode_slots):
        ref_out, ref_state = _feature_reference(
            step, slice(row, row + 1), before[slot] if slot >= 0 else torch.zeros_like(before[0]))
        _close(out[row], ref_out[0], f"decode row {row}")
        if slot >= 0:
            _close(state[slot], ref_state, f"decode state of slot {slot}")


def test_bad_shapes_are_refused():
    x = _inputs(3, 2, 3, 8, 8, seed=0)  # 3 value heads for 2 key heads
    with pytest.raises(ValueError, match="Hk dividing"):
        gated_delta.gated_delta_decode(**x, state=torch.zeros(2, 3, 8, 8),
                                       state_indices=torch.zeros(3, dtype=torch.int32))
    x = _inputs(3, 1, 2, 8, 8, seed=0)
    x["a"] = x["a"][:, :1]
    with pytest.raises(ValueError, match="a/b"):
        gated_delta.gated_delta_decode(**x, state=torch.zeros(2, 2, 8, 8),
                                       state_indices=torch.zeros(3, dtype=torch.int32))
    x = _feature_inputs(3, 2, 8, 8, seed=0)
    x["dt_bias"] = x["dt_bias"][:, :4]  # (a per key feature, dt_bias not)
    with pytest.raises(ValueError, match=r"dt_bias \[Hv, Dk\]"):
        gated_delta.gated_delta_decode(**x, state=torch.zeros(2, 2, 8, 8),
                                       state_indices=torch.zeros(3, dtype=torch.int32))


def test_the_triton_prefill_refuses_a_decay_per_key_feature(monkeypatch):
    """It reads one decay per token and head: a [T, Hv, Dk] would be misread."""
    pytest.importorskip("triton")
    from spindle.layers.mamba import gated_delta_triton

    x = _feature_inputs(3, 2, 16, 16, seed=0)
    md = _metadata([3], [-1], [False])
    with pytest.raises(ValueError, match=r"decay per head \(a \[T, Hv\]\), got a \(3, 2, 16\)"):
        gated_delta_triton.triton_prefill(**x, state=None, md=md)
    monkeypatch.setenv(gated_delta_triton.TRITON_PREFILL_ENV, "1")
    with pytest.raises(ValueError, match="SPINDLE_GDN_TRITON_PREFILL=1: the Triton prefill "
                                         "has no decay per key feature"):
        gated_delta_triton.gated_delta_prefill(**x, state=None, md=md)


@pytest.mark.gpu
@pytest.mark.kernel
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("heads,key_dim,value_dim", pick(
    [(32, 128, 128), (3, 96, 40)], [(3, 8, 40), (2, 16, 8)]))
def test_triton_decode_with_a_decay_per_key_feature_equals_torch(dtype, heads, key_dim,
                                                                 value_dim):
    """Kimi delta attention's step: a [B, H, Dk] and dt_bias [H, Dk], as strided views
    (a of a wider projection's rows, as f_b_proj's output is not; dt_bias a view of the
    checkpoint's [H * Dk])."""
    from spindle.layers.mamba import gated_delta_triton

    slots = [4, -1, 0, 2, 5]
    x = {k: v.to(dtype) if v.dtype.is_floating_point and k not in ("A_log", "dt_bias") else v
         for k, v in _feature_inputs(len(slots), heads, key_dim, value_dim, seed=9).items()}
    x["a"] = torch.cat([x["a"], x["a"]], dim=2)[:, :, :key_dim]  # (strided rows)
    x["dt_bias"] = x["dt_bias"].flatten().view(heads, key_dim)
    state = torch.randn(NUM_SLOTS, heads, key_dim, value_dim)
    indices = torch.tensor(slots, dtype=torch.int32)
    expected_state = state.clone()
    expected = gated_delta.gated_delta_decode(**x, state=expected_state, state_indices=indices)
    got_state = state.to(DEVICE)
    got = gated_delta_triton.gated_delta_decode(**{k: v.to(DEVICE) for k, v in x.items()},
                                                state=got_state,
                                                state_indices=indices.to(DEVICE))
    tol = TOL if dtype == torch.float32 else 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float().cpu(), expected.float(), atol=tol * scale, rtol=tol)
    torch.testing.assert_close(got_state.cpu(), expected_state, atol=TOL, rtol=TOL)


@pytest.mark.gpu
@pytest.mark.kernel
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("key_heads,value_heads,key_dim,value_dim", pick(
    [(16, 32, 128, 128), (2, 6, 96, 40), (3, 3, 16, 8)], [(1, 3, 8, 40), (2, 2, 16, 8)]))
def test_triton_decode_equals_torch(dtype, key_heads, value_heads, key_dim, value_dim):
    from spindle.layers.mamba import gated_delta_triton

    slots = [4, -1, 0, 2, 5]
    x = _inputs(len(slots), key_heads, value_heads, key_dim, value_dim, seed=3, dtype=dtype)
    # q, k and v as strided views of one row, as the model hands them over.
    row = torch.cat([x["q"].flatten(1), x["k"].flatten(1), x["v"].flatten(1)], dim=1)
    qw, vw = key_heads * key_dim, value_heads * value_dim
    x["q"] = row[:, :qw].unflatten(1, (key_heads, key_dim))
    x["k"] = row[:, qw:2 * qw].unflatten(1, (key_heads, key_dim))
    x["v"] = row[:, 2 * qw:].unflatten(1, (value_heads, value_dim))
    state = torch.randn(NUM_SLOTS, value_heads, key_dim, value_dim)
    indices = torch.tensor(slots, dtype=torch.int32)
    expected_state = state.clone()
    beta_scale = 2.0 if value_heads % 2 else 1.0  # (OLMo's doubled beta in some cases)
    expected = gated_delta.gated_delta_decode(**x, state=expected_state, state_indices=indices,
                                              beta_scale=beta_scale)
    on_device = {k: v.to(DEVICE) for k, v in x.items()}
    got_state = state.to(DEVICE)
    got = gated_delta_triton.gated_delta_decode(**on_device, state=got_state,
                                                state_indices=indices.to(DEVICE),
                                                beta_scale=beta_scale)
    tol = TOL if dtype == torch.float32 else 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float().cpu(), expected.float(), atol=tol * scale, rtol=tol)
    torch.testing.assert_close(got_state.cpu(), expected_state, atol=TOL, rtol=TOL)


@pytest.mark.gpu
@pytest.mark.kernel
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("chunk", pick([16, 32, 64], [16, 32]))
@pytest.mark.parametrize("key_heads,value_heads,key_dim,value_dim", pick(
    [(16, 32, 128, 128), (2, 6, 96, 40), (3, 3, 16, 8)], [(1, 3, 8, 40), (2, 2, 16, 8)]))
def test_triton_prefill_equals_the_token_by_token_rule(dtype, chunk, key_heads, value_heads,
                                                       key_dim, value_dim):
    """The Triton prefill (one launch) on packed ragged requests (one token, under a
    chunk, exactly a chunk, several chunks), some continuing a stored state, one without
    a slot; q, k and v as strided views of one row, as the model hands them over. Against
    transformers' rule in float32; in half precision against the torch prefill of the
    same half-precision inputs."""
    from spindle.layers.mamba import gated_delta_triton

    lens = [1, chunk, 3 * chunk + 5, 7, 2 * chunk + 1]
    slots, has_init = [3, 0, 5, -1, 2], [True, False, True, False, True]
    x = _inputs(sum(lens), key_heads, value_heads, key_dim, value_dim, seed=chunk, dtype=dtype)
    row = torch.cat([x["q"].flatten(1), x["k"].flatten(1), x["v"].flatten(1)], dim=1)
    qw = key_heads * key_dim
    x["q"] = row[:, :qw].unflatten(1, (key_heads, key_dim))
    x["k"] = row[:, qw:2 * qw].unflatten(1, (key_heads, key_dim))
    x["v"] = row[:, 2 * qw:].unflatten(1, (value_heads, value_dim))
    state = torch.randn(NUM_SLOTS, value_heads, key_dim, value_dim)
    before = state.clone()
    md = _metadata(lens, slots, has_init)
    beta_scale = 2.0 if value_heads % 2 else 1.0
    on_device = {k: v.to(DEVICE) for k, v in x.items()}
    md_device = MambaMetadata(md.num_reqs, md.num_tokens, md.query_start_loc.to(DEVICE),
                              md.state_indices.to(DEVICE), md.has_initial_state.to(DEVICE),
                              md.max_query_len)
    got_state = state.to(DEVICE)
    got = gated_delta_triton.triton_prefill(**on_device, state=got_state, md=md_device,
                                            beta_scale=beta_scale, chunk=chunk).cpu()
    got_state = got_state.cpu()
    if dtype == torch.float32:
        _check_requests(got, got_state, x, before, lens, slots, has_init, beta_scale)
    else:
        expected_state = before.clone()
        expected = gated_delta.gated_delta_prefill(**x, state=expected_state, md=md,
                                                   batched=False, beta_scale=beta_scale)
        tol = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
        scale = expected.float().abs().max().item()
        torch.testing.assert_close(got.float(), expected.float(), atol=tol * scale, rtol=tol)
        torch.testing.assert_close(got_state, expected_state, atol=1e-4, rtol=1e-4)
    for untouched in (1, 4):
        assert torch.equal(got_state[untouched], before[untouched])


def test_triton_prefill_without_a_state_tensor(monkeypatch):
    """state None (a layer run without its cache): zeros enter, nothing is stored; and
    gated_delta_prefill runs the kernel only with SPINDLE_GDN_TRITON_PREFILL=1."""
    from spindle.layers.mamba import gated_delta_triton

    lens = [5, 40]
    x = _inputs(sum(lens), 1, 2, 16, 16, seed=11)
    md = _metadata(lens, [0, 1], [True, True])
    expected = gated_delta.gated_delta_prefill(**x, state=None, md=md, batched=False)
    calls = []
    real = gated_delta_triton.triton_prefill
    monkeypatch.setattr(gated_delta_triton, "triton_prefill",
                        lambda *args, **kw: calls.append(1) or real(*args, **kw))
    for switch, launches in (("0", 0), ("1", 1)):
        monkeypatch.setenv("SPINDLE_GDN_TRITON_PREFILL", switch)
        got = gated_delta_triton.gated_delta_prefill(**x, state=None, md=md, chunk_size=16)
        assert len(calls) == launches
        scale = expected.abs().max().item()
        torch.testing.assert_close(got, expected, atol=TOL * scale, rtol=TOL)


def test_triton_prefill_refuses_bad_tiles_and_states():
    from spindle.layers.mamba import gated_delta_triton

    x = _inputs(3, 1, 2, 16, 16, seed=0)
    md = _metadata([3], [0], [False])
    with pytest.raises(ValueError, match="chunk must be a power of two"):
        gated_delta_triton.triton_prefill(**x, state=None, md=md, chunk=24)
    with pytest.raises(ValueError, match="the state must be"):
        gated_delta_triton.triton_prefill(**x, state=torch.zeros(2, 2, 16, 8), md=md)
