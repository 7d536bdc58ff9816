"""The Mamba2 Triton kernels (spindle/layers/mamba/triton_ops.py) on fresh random inputs,
against the definition written out token by token here (float64) and against the
transformers Bamba functions (their plain-torch paths, in float32):

* conv: out[t] = act(bias + sum_k w[:, k] * window[t + k]) over the window history +
  new inputs; the state afterwards is the window's last K-1 columns.
* SSD: state = exp(dt * A) * state + dt * x B^T; y = C . state + D x, with dt =
  clamp(softplus(dt + dt_bias), dt_limit) and head h reading group h // (H // G).

Inputs are strided views into one projection-like buffer, as the model hands them
over; requests have ragged lengths (1, < K-1, odd, > chunk_size), some start from a
state, and padding rows (negative slots) must leave every state untouched.

Tolerances, relative to the largest reference value: float32 1e-5 (the kernels sum in
float32, in another order than the float64 definition: a chunk's worth of products per
output; measured up to 1.3e-6 at chunk 256). Half precision (bf16 on a GPU,
fp16 under the interpreter, kernel_utils): the inputs are rounded to half before both
sides see them, so the gap is the kernels' own roundings: the output once (half an ulp)
plus the half-precision tensor-core operands of the SSD (decay-weighted B, C.B^T
weights and the chunk start states, each rounded once before a float32 sum): four ulps
of the format (bf16 ulp 2^-7, fp16 2^-10)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from kernel_utils import DEVICE, HALF, pick

pytestmark = [pytest.mark.gpu, pytest.mark.kernel]
DTYPES = [torch.float32, HALF]
TOL = {torch.float32: 1e-5, torch.float16: 4 * 2 ** -10, torch.bfloat16: 4 * 2 ** -7}

# (heads, groups, head_dim, state_size): one group; several groups with odd heads; P and
# N over the kernels' 64-wide tiles (two tiles, the second partly masked).
SSD_SHAPES = pick([(8, 1, 64, 128), (9, 3, 16, 16), (5, 5, 8, 32), (2, 2, 72, 80)],
                  [(3, 1, 4, 8), (6, 3, 4, 16), (2, 2, 72, 80)])
NUM_SLOTS = 8


def _close(out, ref, dtype, what=""):
    """out within TOL of ref, scaled by ref's largest magnitude."""
    ref = ref.double().cpu()
    tol = TOL[dtype]
    scale = max(ref.abs().max().item(), 1e-6)
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol * scale, rtol=tol, msg=lambda m:
                               f"{what}: {m}")


def _metadata(lens, slots, has_init):
    from spindle.layers.mamba.metadata import MambaMetadata

    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    idx = torch.tensor(slots, dtype=torch.int32)
    init = torch.tensor(has_init, dtype=torch.bool)
    return MambaMetadata(num_reqs=len(lens), num_tokens=sum(lens),
                         query_start_loc=qsl.to(DEVICE), state_indices=idx.to(DEVICE),
                         has_initial_state=init.to(DEVICE), max_query_len=max(lens),
                         query_start_loc_cpu=qsl, has_initial_state_cpu=init,
                         state_indices_cpu=idx)


def _hf(name):
    """A transformers Bamba function's own torch path (never a hub kernel)."""
    from transformers.models.bamba import modeling_bamba

    return inspect.unwrap(getattr(modeling_bamba, name))


# ---------------------------------------------------------------------- conv1d
def _conv_case(num_tokens, channels, width, dtype, seed, with_bias=True):
    gen = torch.Generator().manual_seed(seed)
    # x as a column slice of a wider projection output.
    proj = torch.randn(num_tokens, channels + 7, generator=gen).to(dtype)
    x = proj[:, 3:3 + channels]
    weight = (torch.randn(channels, width, generator=gen) / width ** 0.5).to(dtype)
    bias = torch.randn(channels, generator=gen).to(dtype) if with_bias else None
    state = torch.randn(NUM_SLOTS, channels, width - 1, generator=gen).to(dtype)
    return proj, x, weight, bias, state


def _naive_conv(x, weight, bias, history, activation):
    """x [L, C], history [C, K-1] (float64) -> (out [L, C], new history [C, K-1])."""
    width = weight.shape[1]
    window = torch.cat([history.T, x])
    out = torch.stack([(window[t:t + width] * weight.T).sum(0) for t in range(len(x))]) \
        if len(x) else x.clone()
    if bias is not None:
        out = out + bias
    if activation is not None:
        out = F.silu(out)
    return out, window[len(window) - (width - 1):].T


def _to_device(*tensors):
    """Copies on the kernels' device (copies on CPU too: the kernels write states)."""
    return [t.to(DEVICE, copy=True) if t is not None else None for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [4, 2])
@pytest.mark.parametrize("with_bias,activation", [(True, "silu"), (False, None)])
def test_conv_prefill_against_definition_and_transformers(dtype, width, with_bias, activation):
    from spindle.layers.mamba.triton_ops import causal_conv1d_prefill

    lens = pick([1, 2, 37, 300, 1, 64], [1, 2, 37, 1, 5])
    slots = [3, 0, 5, -1, 6, 1][:len(lens)]
    has_init = [True, True, False, True, True, False][:len(lens)]
    channels = pick(300, 37)
    proj, x, weight, bias, state = _conv_case(sum(lens), channels, width, dtype, seed=width,
                                              with_bias=with_bias)
    md = _metadata(lens, slots, has_init)
    dev_proj, dev_weight, dev_bias, dev_state = _to_device(proj, weight, bias, state)
    dev_x = dev_proj[:, 3:3 + channels]
    out = causal_conv1d_prefill(dev_x, dev_weight, dev_bias, dev_state, md, activation)

    starts = md.query_start_loc_cpu.tolist()
    d = lambda t: t.double() if t is not None else None  # noqa: E731
    for i, (slot, init) in enumerate(zip(slots, has_init)):
        xs = x[starts[i]:starts[i + 1]]
        history = state[slot] if init and slot >= 0 else torch.zeros(channels, width - 1,
                                                                      dtype=dtype)
        ref, ref_state = _naive_conv(d(xs), d(weight), d(bias), d(history), activation)
        _close(out[starts[i]:starts[i + 1]], ref, dtype, f"request {i} output")
        # transformers: causal_conv1d_update also takes a history and several tokens.
        hf_state = history.float()[None].clone()
        hf = _hf("causal_conv1d_update")(xs.float().T[None], hf_state, weight.float(),
                                         bias.float() if bias is not None else None,
                                         activation=activation)
        _close(out[starts[i]:starts[i + 1]], hf[0].T, dtype, f"request {i} vs transformers")
        if slot >= 0:
            _close(dev_state[slot], ref_state, dtype, f"request {i} state")
            _close(dev_state[slot], hf_state[0], dtype, f"request {i} state vs transformers")
    used = {s for s in slots if s >= 0}
    for slot in range(NUM_SLOTS):
        if slot not in used:
            assert torch.equal(dev_state[slot].cpu(), state[slot]), f"slot {slot} touched"
    # The rest of the projection buffer is untouched.
    assert torch.equal(dev_proj.cpu(), proj)


def test_conv_prefill_without_state_is_zero_history():
    """conv_state None (the profiling forward): zero history, as transformers'
    causal_conv1d_fn on each request alone."""
    from spindle.layers.mamba.triton_ops import causal_conv1d_prefill

    lens = [5, 1, 12]
    proj, x, weight, bias, _ = _conv_case(sum(lens), 20, 4, torch.float32, seed=3)
    md = _metadata(lens, [0, 1, 2], [True, True, True])  # ignored without a state
    out = causal_conv1d_prefill(*_to_device(x, weight, bias), None, md).cpu()
    starts = md.query_start_loc_cpu.tolist()
    for i in range(len(lens)):
        hf = _hf("causal_conv1d_fn")(x[starts[i]:starts[i + 1]].T[None], weight, bias,
                                     activation="silu")
        _close(out[starts[i]:starts[i + 1]], hf[0].T, torch.float32, f"request {i}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width,activation", [(4, "silu"), (3, "silu"), (3, None)])
def test_conv_decode_against_definition_and_transformers(dtype, width, activation):
    """(Without activation: LFM2's short convolution.)"""
    from spindle.layers.mamba.triton_ops import causal_conv1d_decode

    slots = [4, -1, 0, 7, -1, 2]
    channels = pick(1000, 45)
    proj, x, weight, bias, state = _conv_case(len(slots), channels, width, dtype, seed=10)
    dev_proj, dev_weight, dev_bias, dev_state = _to_device(proj, weight, bias, state)
    idx = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    out = causal_conv1d_decode(dev_proj[:, 3:3 + channels], dev_weight, dev_bias, dev_state,
                               idx, activation)
    assert out.isfinite().all()  # padding rows too
    for b, slot in enumerate(slots):
        if slot < 0:
            continue
        ref, ref_state = _naive_conv(x[b:b + 1].double(), weight.double(), bias.double(),
                                     state[slot].double(), activation)
        _close(out[b:b + 1], ref, dtype, f"row {b}")
        _close(dev_state[slot], ref_state, dtype, f"row {b} state")
        hf_state = state[slot].float()[None].clone()
        hf = _hf("causal_conv1d_update")(x[b:b + 1].float().T[None], hf_state, weight.float(),
                                         bias.float(), activation=activation)
        _close(out[b:b + 1], hf[0].T, dtype, f"row {b} vs transformers")
        _close(dev_state[slot], hf_state[0], dtype, f"row {b} state vs transformers")
    for slot in set(range(NUM_SLOTS)) - set(slots):
        assert torch.equal(dev_state[slot].cpu(), state[slot]), f"slot {slot} touched"


@pytest.mark.parametrize("split", [1, 2, 5])
def test_conv_prefill_split_equals_one_call(split):
    """A prompt in two prefill steps (the second from the state the first left, also
    when the first step is shorter than K-1) equals one step; so do decodes after it."""
    from spindle.layers.mamba.triton_ops import causal_conv1d_decode, causal_conv1d_prefill

    length, channels, width = 9, 24, 4
    proj, x, weight, bias, state = _conv_case(length + 2, channels, width, torch.float32,
                                              seed=split)
    x, weight, bias = _to_device(x, weight, bias)
    whole, parts = _to_device(state, state)
    one = causal_conv1d_prefill(x[:length], weight, bias, whole,
                                _metadata([length], [2], [False]))
    first = causal_conv1d_prefill(x[:split], weight, bias, parts, _metadata([split], [2], [False]))
    second = causal_conv1d_prefill(x[split:length], weight, bias, parts,
                                   _metadata([length - split], [2], [True]))
    _close(torch.cat([first, second]), one, torch.float32)
    _close(parts[2], whole[2], torch.float32)
    idx = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    for t in range(length, length + 2):
        _close(causal_conv1d_decode(x[t:t + 1], weight, bias, parts, idx),
               causal_conv1d_decode(x[t:t + 1], weight, bias, whole, idx), torch.float32)


# ---------------------------------------------------------------------- SSD
def _ssd_case(num_tokens, heads, groups, head_dim, state_size, dtype, seed,
              state_dtype=torch.float32):
    """Inputs as the mixer produces them: x, B, C views into one conv output, dt a
    column slice of the projection; float32 A = -exp(A_log)."""
    gen = torch.Generator().manual_seed(seed)
    width = heads * head_dim + 2 * groups * state_size
    conv_out = torch.randn(num_tokens, width + 5, generator=gen).to(dtype)
    proj = (torch.randn(num_tokens, heads + 3, generator=gen) - 0.5).to(dtype)
    case = dict(
        conv_out=conv_out, proj=proj,
        A_log=torch.rand(heads, generator=gen) * 1.5 - 0.5,
        D=torch.randn(heads, generator=gen),
        dt_bias=torch.randn(heads, generator=gen) * 0.5,
        state=torch.randn(NUM_SLOTS, heads, head_dim, state_size, generator=gen)
        .to(state_dtype))
    case["A"] = -torch.exp(case["A_log"])  # (what the references take)
    return case


def _ssd_views(case, heads, groups, head_dim, state_size):
    conv_out, proj = case["conv_out"], case["proj"]
    tokens = conv_out.shape[0]
    inner, gn = heads * head_dim, groups * state_size
    return dict(x=conv_out[:, :inner].view(tokens, heads, head_dim),
                B=conv_out[:, inner:inner + gn].view(tokens, groups, state_size),
                C=conv_out[:, inner + gn:inner + 2 * gn].view(tokens, groups, state_size),
                dt=proj[:, 2:2 + heads])


def _naive_ssd(x, dt, A, B, C, D, dt_bias, dt_limit, state):
    """The recurrence, one token at a time, in float64: x [L, H, P], dt [L, H],
    B/C [L, G, N], state [H, P, N] -> (y [L, H, P], final state)."""
    x, dt, A, B, C, D, dt_bias, state = (t.double() for t in (x, dt, A, B, C, D, dt_bias,
                                                              state))
    rep = x.shape[1] // B.shape[1]
    ys = []
    for t in range(len(x)):
        d = F.softplus(dt[t] + dt_bias).clamp(*dt_limit)
        b, c = B[t].repeat_interleave(rep, 0), C[t].repeat_interleave(rep, 0)
        state = torch.exp(d * A)[:, None, None] * state \
            + (d[:, None] * x[t])[:, :, None] * b[:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", state, c) + D[:, None] * x[t])
    return (torch.stack(ys) if ys else x.clone()), state


def _run_ssd_prefill(case, views, md, chunk_size, dt_limit=(0.0, float("inf")),
                     with_state=True):
    from spindle.layers.mamba.triton_ops import ssd_prefill

    dev = {k: v.to(DEVICE, copy=True) for k, v in case.items()}
    heads, head_dim = views["x"].shape[1:]
    groups, state_size = views["B"].shape[1:]
    dv = _ssd_views(dev, heads, groups, head_dim, state_size)
    y = ssd_prefill(dv["x"], dv["dt"], dev["A_log"], dv["B"], dv["C"], dev["D"], dev["dt_bias"],
                    dt_limit, chunk_size, dev["state"] if with_state else None, md)
    return y, dev


# Chunk sizes: one of several token tiles (32 here, 256 on a GPU), and a smaller one
# (more chunks per request; 48 on a GPU: not a power of two); the wide shape with the
# first only.
SSD_PREFILL_CASES = [(chunk, shape) for chunk in pick([256, 48], [32, 8])
                     for shape in SSD_SHAPES if chunk == pick(256, 32) or shape[2] < 64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_size,shape", SSD_PREFILL_CASES)
def test_ssd_prefill_against_definition_and_transformers(dtype, chunk_size, shape):
    heads, groups, head_dim, state_size = shape
    lens = pick([1, 700, 33, 256, 5, 2], [1, 70, 13, 2, 32])
    slots = [2, 0, 7, -1, 4, 5][:len(lens)]
    has_init = [True, False, True, True, True, False][:len(lens)]
    case = _ssd_case(sum(lens), heads, groups, head_dim, state_size, dtype, seed=chunk_size)
    views = _ssd_views(case, heads, groups, head_dim, state_size)
    md = _metadata(lens, slots, has_init)
    y, dev = _run_ssd_prefill(case, views, md, chunk_size)
    assert y.dtype == dtype and y.shape == views["x"].shape

    chunk_scan = _hf("mamba2_chunk_scan")
    starts = md.query_start_loc_cpu.tolist()
    for i, (slot, init) in enumerate(zip(slots, has_init)):
        part = {k: v[starts[i]:starts[i + 1]] for k, v in views.items()}
        initial = case["state"][slot] if init and slot >= 0 else \
            torch.zeros_like(case["state"][0])
        ref, ref_state = _naive_ssd(part["x"], part["dt"], case["A"], part["B"], part["C"],
                                    case["D"], case["dt_bias"], (0.0, float("inf")), initial)
        _close(y[starts[i]:starts[i + 1]], ref, dtype, f"request {i}")
        hf, hf_state = chunk_scan(
            part["x"].float()[None], part["dt"].float()[None], case["A"], part["B"].float()[None],
            part["C"].float()[None], chunk_size, D=case["D"], dt_bias=case["dt_bias"],
            initial_states=initial.float()[None], dt_softplus=True, return_final_states=True)
        _close(y[starts[i]:starts[i + 1]], hf[0], dtype, f"request {i} vs transformers")
        if slot >= 0:
            _close(dev["state"][slot], ref_state, dtype, f"request {i} state")
            _close(dev["state"][slot], hf_state[0], dtype, f"request {i} state vs transformers")
    for slot in set(range(NUM_SLOTS)) - {s for s in slots if s >= 0}:
        assert torch.equal(dev["state"][slot].cpu(), case["state"][slot]), f"slot {slot}"
    for name in ("conv_out", "proj"):
        assert torch.equal(dev[name].cpu(), case[name]), f"{name} was written"


@pytest.mark.parametrize("dt_limit", [(0.05, 0.4), (0.0, 0.2)])
def test_ssd_prefill_and_decode_clamp_dt(dt_limit):
    """A time_step_limit: dt clamped after the softplus, in both kernels."""
    from spindle.layers.mamba.triton_ops import ssd_decode

    heads, groups, head_dim, state_size = 4, 2, 4, 16
    lens, slots = [11, 3], [1, 6]
    case = _ssd_case(sum(lens) + 2, heads, groups, head_dim, state_size, torch.float32, seed=5)
    views = _ssd_views(case, heads, groups, head_dim, state_size)
    md = _metadata(lens, slots, [True, False])
    prefill_case = {k: (v[:sum(lens)] if k in ("conv_out", "proj") else v)
                    for k, v in case.items()}
    y, dev = _run_ssd_prefill(prefill_case, views, md, 8, dt_limit=dt_limit)
    starts = md.query_start_loc_cpu.tolist()
    finals = []
    for i, slot in enumerate(slots):
        initial = case["state"][slot] if i == 0 else torch.zeros_like(case["state"][0])
        part = {k: v[starts[i]:starts[i + 1]] for k, v in views.items()}
        ref, ref_state = _naive_ssd(part["x"], part["dt"], case["A"], part["B"], part["C"],
                                    case["D"], case["dt_bias"], dt_limit, initial)
        _close(y[starts[i]:starts[i + 1]], ref, torch.float32, f"request {i}")
        finals.append(ref_state)
    # One decode step for both requests from the states the prefill left.
    tail = {k: v[sum(lens):].to(DEVICE) for k, v in views.items()}
    out = ssd_decode(tail["x"], tail["dt"], dev["A_log"], tail["B"], tail["C"], dev["D"],
                     dev["dt_bias"], dt_limit, dev["state"],
                     torch.tensor(slots, dtype=torch.int32, device=DEVICE))
    for b, slot in enumerate(slots):
        ref, ref_state = _naive_ssd(views["x"][sum(lens) + b:][:1], views["dt"][sum(lens) + b:][:1],
                                    case["A"], views["B"][sum(lens) + b:][:1],
                                    views["C"][sum(lens) + b:][:1], case["D"], case["dt_bias"],
                                    dt_limit, finals[b])
        _close(out[b:b + 1], ref, torch.float32, f"decode row {b}")
        _close(dev["state"][slot], ref_state, torch.float32, f"decode row {b} state")


@pytest.mark.parametrize("split", [1, 7, 8, 13])
def test_ssd_prefill_split_equals_one_call(split):
    """Chunked prefill: the second step starts from the state the first wrote (split
    inside a chunk, on a chunk boundary, after one token)."""
    heads, groups, head_dim, state_size, chunk = 3, 1, 4, 8, 8
    length = 21
    case = _ssd_case(length, heads, groups, head_dim, state_size, torch.float32, seed=split)
    views = _ssd_views(case, heads, groups, head_dim, state_size)
    y_one, dev_one = _run_ssd_prefill(case, views, _metadata([length], [3], [False]), chunk)

    from spindle.layers.mamba.triton_ops import ssd_prefill

    dev = {k: v.to(DEVICE, copy=True) for k, v in case.items()}
    dv = _ssd_views(dev, heads, groups, head_dim, state_size)
    ys = []
    for lo, hi, init in ((0, split, False), (split, length, True)):
        ys.append(ssd_prefill(dv["x"][lo:hi], dv["dt"][lo:hi], dev["A_log"], dv["B"][lo:hi],
                              dv["C"][lo:hi], dev["D"], dev["dt_bias"], (0.0, float("inf")),
                              chunk, dev["state"], _metadata([hi - lo], [3], [init])))
    _close(torch.cat(ys), y_one, torch.float32)
    _close(dev["state"][3], dev_one["state"][3], torch.float32)


def test_ssd_prefill_without_state():
    """ssm_state None (the profiling forward): zero initial states, nothing stored."""
    heads, groups, head_dim, state_size = 2, 1, 4, 8
    lens = [6, 10]
    case = _ssd_case(sum(lens), heads, groups, head_dim, state_size, torch.float32, seed=9)
    views = _ssd_views(case, heads, groups, head_dim, state_size)
    md = _metadata(lens, [0, 1], [True, True])
    y, _ = _run_ssd_prefill(case, views, md, 4, with_state=False)
    starts = md.query_start_loc_cpu.tolist()
    for i in range(len(lens)):
        part = {k: v[starts[i]:starts[i + 1]] for k, v in views.items()}
        ref, _ = _naive_ssd(part["x"], part["dt"], case["A"], part["B"], part["C"], case["D"],
                            case["dt_bias"], (0.0, float("inf")),
                            torch.zeros_like(case["state"][0]))
        _close(y[starts[i]:starts[i + 1]], ref, torch.float32, f"request {i}")


@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32),
                                               (HALF, torch.float32), (HALF, HALF)])
@pytest.mark.parametrize("heads,groups,head_dim,state_size", SSD_SHAPES)
def test_ssd_decode_against_definition_and_transformers(dtype, state_dtype, heads, groups,
                                                        head_dim, state_size):
    from spindle.layers.mamba.triton_ops import ssd_decode

    slots = [5, -1, 0, 3, -1]
    case = _ssd_case(len(slots), heads, groups, head_dim, state_size, dtype, seed=heads,
                     state_dtype=state_dtype)
    views = _ssd_views(case, heads, groups, head_dim, state_size)
    dev = {k: v.to(DEVICE, copy=True) for k, v in case.items()}
    dv = _ssd_views(dev, heads, groups, head_dim, state_size)
    out = ssd_decode(dv["x"], dv["dt"], dev["A_log"], dv["B"], dv["C"], dev["D"], dev["dt_bias"],
                     (0.0, float("inf")), dev["state"],
                     torch.tensor(slots, dtype=torch.int32, device=DEVICE))
    assert out.dtype == dtype and out.isfinite().all()  # padding rows too
    update = _hf("mamba2_selective_state_update")
    # The state's own rounding (half states) is part of what the kernel must reproduce.
    tol_dtype = dtype if state_dtype == torch.float32 else HALF
    for b, slot in enumerate(slots):
        if slot < 0:
            continue
        ref, ref_state = _naive_ssd(views["x"][b:b + 1], views["dt"][b:b + 1], case["A"],
                                    views["B"][b:b + 1], views["C"][b:b + 1], case["D"],
                                    case["dt_bias"], (0.0, float("inf")), case["state"][slot])
        _close(out[b:b + 1], ref, tol_dtype, f"row {b}")
        _close(dev["state"][slot], ref_state, tol_dtype, f"row {b} state")
        # transformers' decode takes per-(head, p) parameters, expanded as BambaMixer does.
        hf_state = case["state"][slot].float()[None].clone()
        hf = update(hf_state, views["x"][b:b + 1].float(),
                    views["dt"][b:b + 1].float()[:, :, None].expand(-1, -1, head_dim),
                    case["A"][:, None, None].expand(-1, head_dim, state_size),
                    views["B"][b:b + 1].float(), views["C"][b:b + 1].float(),
                    case["D"][:, None].expand(-1, head_dim),
                    dt_bias=case["dt_bias"][:, None].expand(-1, head_dim), dt_softplus=True)
        _close(out[b:b + 1], hf, tol_dtype, f"row {b} vs transformers")
        _close(dev["state"][slot], hf_state[0], tol_dtype, f"row {b} state vs transformers")
    for slot in set(range(NUM_SLOTS)) - set(slots):
        assert torch.equal(dev["state"][slot].cpu(), case["state"][slot]), f"slot {slot}"


def test_prefill_then_decodes_equal_one_prefill():
    """Prefill, then decode steps, equal one prefill over all the tokens (outputs of the
    decoded tokens and the final state): the two kernels agree on the state."""
    from spindle.layers.mamba.triton_ops import ssd_decode

    heads, groups, head_dim, state_size, chunk = 6, 2, 4, 16, 8
    prompt, steps = 10, 3
    case = _ssd_case(prompt + steps, heads, groups, head_dim, state_size, torch.float32, seed=1)
    views = _ssd_views(case, heads, groups, head_dim, state_size)
    y_all, dev_all = _run_ssd_prefill(case, views, _metadata([prompt + steps], [1], [True]),
                                      chunk)
    prompt_case = {k: (v[:prompt] if k in ("conv_out", "proj") else v) for k, v in case.items()}
    _, dev = _run_ssd_prefill(prompt_case, views, _metadata([prompt], [1], [True]), chunk)
    idx = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    dv = _ssd_views({k: v.to(DEVICE, copy=True) for k, v in case.items()}, heads, groups, head_dim,
                    state_size)
    for t in range(prompt, prompt + steps):
        y = ssd_decode(dv["x"][t:t + 1], dv["dt"][t:t + 1], dev["A_log"], dv["B"][t:t + 1],
                       dv["C"][t:t + 1], dev["D"], dev["dt_bias"], (0.0, float("inf")),
                       dev["state"], idx)
        _close(y, y_all[t:t + 1], torch.float32, f"token {t}")
    _close(dev["state"][1], dev_all["state"][1], torch.float32)


def test_prefill_padding_tokens_are_not_read_and_give_zeros():
    """Token rows past md.num_tokens (a padded batch): never read (NaN there changes
    nothing), zeros out, the requests' rows as without them."""
    from spindle.layers.mamba.triton_ops import causal_conv1d_prefill, ssd_prefill

    lens, pad = [3, 6], 4
    md = _metadata(lens, [0, 1], [True, False])
    _, x, weight, bias, state = _conv_case(sum(lens) + pad, 20, 4, torch.float32, seed=2)
    x, weight, bias, state, state_ref = _to_device(x, weight, bias, state, state)
    x[sum(lens):] = float("nan")
    out = causal_conv1d_prefill(x, weight, bias, state, md)
    ref = causal_conv1d_prefill(x[:sum(lens)], weight, bias, state_ref, md)
    assert torch.equal(out[:sum(lens)], ref) and torch.equal(state, state_ref)
    assert not out[sum(lens):].any()

    heads, groups, head_dim, state_size = 2, 1, 4, 8
    case = _ssd_case(sum(lens) + pad, heads, groups, head_dim, state_size, torch.float32, 4)
    dev = {k: v.to(DEVICE, copy=True) for k, v in case.items()}
    dev["conv_out"][sum(lens):] = float("nan")
    dev["proj"][sum(lens):] = float("nan")
    dv = _ssd_views(dev, heads, groups, head_dim, state_size)
    limit, t = (0.0, float("inf")), sum(lens)
    ssm_ref = dev["state"].clone()
    y = ssd_prefill(dv["x"], dv["dt"], dev["A_log"], dv["B"], dv["C"], dev["D"], dev["dt_bias"],
                    limit, 4, dev["state"], md)
    y_ref = ssd_prefill(dv["x"][:t], dv["dt"][:t], dev["A_log"], dv["B"][:t], dv["C"][:t],
                        dev["D"], dev["dt_bias"], limit, 4, ssm_ref, md)
    assert torch.equal(y[:t], y_ref) and torch.equal(dev["state"], ssm_ref)
    assert not y[t:].any()


def test_bad_inputs_are_named():
    from spindle.layers.mamba.triton_ops import causal_conv1d_decode, ssd_decode

    x = torch.zeros(2, 8, device=DEVICE)
    weight = torch.zeros(8, 4, device=DEVICE)
    state = torch.zeros(4, 8, 3, device=DEVICE)
    idx = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_decode(x, weight, None, state, idx, "gelu")
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_decode(x, weight, None, state[:, :, :2], idx)
    heads = torch.zeros(3, device=DEVICE)
    with pytest.raises(ValueError, match="groups"):
        ssd_decode(torch.zeros(2, 3, 4, device=DEVICE), torch.zeros(2, 3, device=DEVICE), heads,
                   torch.zeros(2, 2, 8, device=DEVICE), torch.zeros(2, 2, 8, device=DEVICE),
                   heads, heads, (0.0, float("inf")), torch.zeros(4, 3, 4, 8, device=DEVICE), idx)
    with pytest.raises(ValueError, match="ssm_state"):
        ssd_decode(torch.zeros(2, 3, 4, device=DEVICE), torch.zeros(2, 3, device=DEVICE), heads,
                   torch.zeros(2, 1, 8, device=DEVICE), torch.zeros(2, 1, 8, device=DEVICE),
                   heads, heads, (0.0, float("inf")), torch.zeros(4, 3, 4, 9, device=DEVICE), idx)


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("batch", [1, 8])
def test_decode_graph_replays_with_new_inputs_and_slots(batch):
    """The decode kernels captured once in a CUDA graph, replayed with new inputs, slots
    (padding rows among them) and states: each replay equals an eager call."""
    from spindle.layers.mamba.triton_ops import causal_conv1d_decode, ssd_decode

    heads, groups, head_dim, state_size, width, slots_total = 8, 1, 64, 128, 4, 32
    dtype = torch.bfloat16
    channels = heads * head_dim + 2 * groups * state_size
    gen = torch.Generator().manual_seed(batch)
    conv_in = torch.zeros(batch, channels, dtype=dtype, device=DEVICE)
    dt_in = torch.zeros(batch, heads, dtype=dtype, device=DEVICE)
    idx = torch.zeros(batch, dtype=torch.int32, device=DEVICE)
    weight = torch.randn(channels, width, generator=gen).to(DEVICE, dtype)
    A_log = torch.log(torch.rand(heads, generator=gen) + 0.5).to(DEVICE)
    D, dt_bias = torch.randn(heads, generator=gen).to(DEVICE), torch.zeros(heads, device=DEVICE)
    conv_state = torch.zeros(slots_total, channels, width - 1, dtype=dtype, device=DEVICE)
    ssm_state = torch.zeros(slots_total, heads, head_dim, state_size, device=DEVICE)

    def step():
        xbc = causal_conv1d_decode(conv_in, weight, None, conv_state, idx)
        inner = heads * head_dim
        x = xbc[:, :inner].view(batch, heads, head_dim)
        B = xbc[:, inner:inner + groups * state_size].view(batch, groups, state_size)
        C = xbc[:, inner + groups * state_size:].view(batch, groups, state_size)
        return ssd_decode(x, dt_in, A_log, B, C, D, dt_bias, (0.0, float("inf")), ssm_state, idx)

    step()  # compile outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for replay in range(4):
        perm = torch.randperm(slots_total, generator=gen)[:batch]
        perm[torch.rand(batch, generator=gen) < 0.25] = -1
        idx.copy_(perm)
        conv_in.copy_(torch.randn(batch, channels, generator=gen))
        dt_in.copy_(torch.randn(batch, heads, generator=gen))
        conv_state.copy_(torch.randn(conv_state.shape, generator=gen))
        ssm_state.copy_(torch.randn(ssm_state.shape, generator=gen))
        before = (conv_state.clone(), ssm_state.clone())
        expected = step()
        eager_states = (conv_state.clone(), ssm_state.clone())
        conv_state.copy_(before[0])
        ssm_state.copy_(before[1])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected), f"replay {replay}"
        assert torch.equal(conv_state, eager_states[0]) and torch.equal(ssm_state,
                                                                         eager_states[1])
        padded = perm < 0
        assert out[padded].isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_gated_rms_norm_equals_torch(dtype):
    from spindle.distributed.parallel_state import TensorParallelGroup
    from spindle.layers.mamba.mixer import GatedRMSNorm
    from spindle.layers.mamba.triton_ops import gated_rms_norm

    torch.manual_seed(11)
    width = pick(4096, 96)
    x = torch.randn(7, width, device=DEVICE).to(dtype)
    gate = torch.randn(7, 2 * width, device=DEVICE).to(dtype)[:, :width]  # a strided view
    norm = GatedRMSNorm(width, width, 1e-5, TensorParallelGroup(rank=0, size=1, group=None),
                        [(0, width)]).to(DEVICE)
    norm.weight.data.copy_(1.0 + 0.2 * torch.randn(width))
    expected = norm.weight.float() * _torch_gated_rms(x.float(), gate.float(), 1e-5)
    got = gated_rms_norm(x, gate, norm.weight.to(dtype), 1e-5)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


def _torch_gated_rms(x, gate, eps):
    h = x * F.silu(gate)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("norm_first,sigmoid_gate", [(False, False), (True, False), (True, True)])
def test_group_wise_gated_rms_norm_equals_torch(dtype, norm_first, sigmoid_gate):
    """The mean square per group (NemotronH's norm): groups of 96 in a 4 * 96 width on a
    GPU (a block of 128, partly masked), of 12 in 36 under the interpreter; the gate
    applied first or, with norm_first, after the norm (FalconH1's norm_before_gate), or
    through a sigmoid after it (KimiLinear's output norm)."""
    from spindle.distributed.parallel_state import TensorParallelGroup
    from spindle.layers.mamba.mixer import GatedRMSNorm
    from spindle.layers.mamba.triton_ops import gated_rms_norm

    torch.manual_seed(12)
    group, groups = pick((96, 4), (12, 3))
    width = group * groups
    x = torch.randn(7, width).to(dtype)
    gate = torch.randn(7, 2 * width).to(dtype)[:, :width]  # a strided view
    norm = GatedRMSNorm(width, width, 1e-5, TensorParallelGroup(rank=0, size=1, group=None),
                        [(0, width)], group_size=group, norm_first=norm_first,
                        sigmoid_gate=sigmoid_gate)
    norm.weight.data.copy_(1.0 + 0.2 * torch.randn(width))
    expected = norm(x.float(), gate.float())  # the torch path (CPU tensors)
    got = gated_rms_norm(x.to(DEVICE), gate.to(DEVICE), norm.weight.to(DEVICE, dtype), 1e-5,
                         group, norm_first, sigmoid_gate)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float().cpu(), expected, atol=tol, rtol=tol)
