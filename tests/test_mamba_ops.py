"""The plain-torch Mamba2 ops (spindle/layers/mamba/ops.py) against two oracles on fresh
random inputs: transformers' own Bamba functions (mamba2_chunk_scan, causal_conv1d_fn,
causal_conv1d_update, mamba2_selective_state_update), run one request at a time, and
the recurrence itself, stepped token by token in float64.

Tolerance: float32 with outputs of magnitude ~10-30; the chunked scan and the float64
recurrence differ by ~2e-6 here, so ATOL = RTOL = 1e-4 leaves room for other BLAS builds
and still catches any wrong decay, group or state hand-off (those move outputs by O(1)).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from spindle.layers.mamba.metadata import MambaMetadata
from spindle.layers.mamba.ops import (causal_conv1d_decode, causal_conv1d_prefill,
                                      ssd_decode, ssd_prefill)

ATOL = RTOL = 1e-4
NUM_SLOTS = 8


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def hf_bamba():
    from transformers.models.bamba import modeling_bamba

    return modeling_bamba


# ----------------------------------------------------------------------------- inputs
@dataclass
class Shape:
    heads: int
    groups: int
    head_dim: int
    state: int
    conv_width: int = 4


SHAPES = [Shape(3, 1, 4, 8), Shape(6, 2, 5, 16), Shape(5, 5, 3, 4, conv_width=2)]
SHAPE_IDS = ["h3g1", "h6g2", "h5g5-k2"]


@dataclass
class Params:
    A_log: torch.Tensor  # what the ops take; the references take A
    D: torch.Tensor
    dt_bias: torch.Tensor
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor

    @property
    def A(self) -> torch.Tensor:
        return -torch.exp(self.A_log)


def make_params(shape: Shape, channels: int, g: torch.Generator) -> Params:
    h = shape.heads
    return Params(A_log=torch.rand(h, generator=g) * 2.7,  # decays of 1..15 per unit dt
                  D=1.0 + 0.5 * torch.randn(h, generator=g),
                  dt_bias=-2.0 + torch.rand(h, generator=g) * 2,
                  conv_weight=0.5 * torch.randn(channels, shape.conv_width, generator=g),
                  conv_bias=0.1 * torch.randn(channels, generator=g))


def make_tokens(shape: Shape, num_tokens: int, g: torch.Generator):
    """x [T, H, P], dt [T, H], B [T, G, N], C [T, G, N]."""
    return (torch.randn(num_tokens, shape.heads, shape.head_dim, generator=g),
            torch.randn(num_tokens, shape.heads, generator=g),
            torch.randn(num_tokens, shape.groups, shape.state, generator=g),
            torch.randn(num_tokens, shape.groups, shape.state, generator=g))


def metadata(lengths: list[int], slots: list[int], has_initial: list[bool],
             host_copies: bool = True) -> MambaMetadata:
    qsl = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    idx = torch.tensor(slots, dtype=torch.int32)
    init = torch.tensor(has_initial, dtype=torch.bool)
    return MambaMetadata(num_reqs=len(lengths), num_tokens=int(qsl[-1]), query_start_loc=qsl,
                         state_indices=idx, has_initial_state=init,
                         max_query_len=max(lengths),
                         query_start_loc_cpu=qsl.clone() if host_copies else None,
                         has_initial_state_cpu=init.clone() if host_copies else None,
                         state_indices_cpu=idx.clone() if host_copies else None)


# ----------------------------------------------------------------------------- the definition
def naive_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
               history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [L, C], history [C, K-1] -> (silu(conv) [L, C], new history), float64."""
    seq = torch.cat([history.double().t(), x.double()])  # [K-1+L, C]
    width = weight.shape[1]
    out = torch.stack([(seq[t:t + width].t() * weight.double()).sum(-1) + bias.double()
                       for t in range(x.shape[0])])
    return F.silu(out), seq[seq.shape[0] - (width - 1):].t()


def naive_ssd(x, dt, B, C, p: Params, state: torch.Tensor,
              dt_limit=(0.0, float("inf"))) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token in float64: x [L, H, P] ... -> (y [L, H, P], final state)."""
    heads, groups = x.shape[1], B.shape[1]
    group_of = torch.arange(heads) // (heads // groups)
    state = state.double().clone()
    ys = []
    for t in range(x.shape[0]):
        step = F.softplus(dt[t].double() + p.dt_bias.double()).clamp(*dt_limit)  # [H]
        b, c = B[t].double()[group_of], C[t].double()[group_of]  # [H, N]
        state = (torch.exp(step * p.A.double())[:, None, None] * state
                 + (step[:, None] * x[t].double())[:, :, None] * b[:, None, :])
        ys.append((state * c[:, None, :]).sum(-1) + p.D.double()[:, None] * x[t].double())
    return torch.stack(ys), state


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), expected.double(), atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------- prefill
# Lengths: 1, odd, exactly one chunk, more than two chunks; a padding row (slot -1).
LENGTHS = [1, 7, 8, 21, 3, 12]
SLOTS = [5, 0, 3, 6, -1, 2]
HAS_INITIAL = [True, False, True, True, False, False]
CHUNK = 8


def prefill_setup(shape: Shape, seed: int):
    g = torch.Generator().manual_seed(seed)
    channels = 2 * shape.heads * shape.head_dim
    p = make_params(shape, channels, g)
    x, dt, B, C = make_tokens(shape, sum(LENGTHS), g)
    conv_x = torch.randn(sum(LENGTHS), channels, generator=g)
    conv_state = torch.randn(NUM_SLOTS, channels, shape.conv_width - 1, generator=g)
    ssm_state = torch.randn(NUM_SLOTS, shape.heads, shape.head_dim, shape.state, generator=g)
    return p, (x, dt, B, C), conv_x, conv_state, ssm_state


def spans():
    start = 0
    for n, slot, init in zip(LENGTHS, SLOTS, HAS_INITIAL):
        yield start, start + n, slot, init
        start += n


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_ssd_prefill_matches_recurrence_and_transformers(shape):
    p, (x, dt, B, C), _, _, ssm_state = prefill_setup(shape, seed=1)
    before = ssm_state.clone()
    state = ssm_state.clone()
    y = ssd_prefill(x, dt, p.A_log, B, C, p.D, p.dt_bias, (0.0, float("inf")), CHUNK, state,
                    metadata(LENGTHS, SLOTS, HAS_INITIAL))
    assert y.dtype == x.dtype and y.shape == x.shape
    chunk_scan = hf_bamba().mamba2_chunk_scan
    for start, end, slot, init in spans():
        initial = before[slot] if init and slot >= 0 else torch.zeros_like(before[0])
        want_y, want_state = naive_ssd(x[start:end], dt[start:end], B[start:end],
                                       C[start:end], p, initial)
        close(y[start:end], want_y)
        hf_y, hf_state = chunk_scan(
            x[None, start:end], dt[None, start:end], p.A, B[None, start:end],
            C[None, start:end], chunk_size=CHUNK, D=p.D, dt_bias=p.dt_bias,
            initial_states=initial[None] if init else None, dt_softplus=True,
            return_final_states=True)
        close(y[start:end], hf_y[0])
        if slot >= 0:
            close(state[slot], want_state)
            close(state[slot], hf_state[0])
    untouched = [s for s in range(NUM_SLOTS) if s not in SLOTS]
    assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_conv_prefill_matches_definition_and_transformers(shape):
    p, _, conv_x, conv_state, _ = prefill_setup(shape, seed=2)
    before = conv_state.clone()
    state = conv_state.clone()
    out = causal_conv1d_prefill(conv_x, p.conv_weight, p.conv_bias, state,
                                metadata(LENGTHS, SLOTS, HAS_INITIAL))
    hf = hf_bamba()
    for start, end, slot, init in spans():
        history = before[slot] if init and slot >= 0 else torch.zeros_like(before[0])
        want, want_state = naive_conv(conv_x[start:end], p.conv_weight, p.conv_bias, history)
        close(out[start:end], want)
        if init:  # continuing: transformers' cache-update path takes the history
            hf_state = history[None].clone()
            hf_out = hf.causal_conv1d_update(conv_x[start:end].t()[None], hf_state,
                                             p.conv_weight, p.conv_bias, activation="silu")
        else:
            hf_out = hf.causal_conv1d_fn(conv_x[start:end].t()[None], p.conv_weight,
                                         p.conv_bias, activation="silu")
        close(out[start:end], hf_out[0].t())
        if slot >= 0:
            close(state[slot], want_state)
    untouched = [s for s in range(NUM_SLOTS) if s not in SLOTS]
    assert torch.equal(state[untouched], before[untouched])


def test_prefill_without_states_is_zero_history():
    """The profiling forward: no state tensors, every request starts from zeros."""
    shape = SHAPES[1]
    p, (x, dt, B, C), conv_x, _, _ = prefill_setup(shape, seed=3)
    no_history = [False] * len(LENGTHS)
    md = metadata(LENGTHS, SLOTS, HAS_INITIAL)  # has_initial_state ignored without states
    y = ssd_prefill(x, dt, p.A_log, B, C, p.D, p.dt_bias, (0.0, float("inf")), CHUNK, None, md)
    conv = causal_conv1d_prefill(conv_x, p.conv_weight, p.conv_bias, None, md)
    scratch_ssm = torch.zeros(NUM_SLOTS, shape.heads, shape.head_dim, shape.state)
    scratch_conv = torch.zeros(NUM_SLOTS, conv_x.shape[1], shape.conv_width - 1)
    md_fresh = metadata(LENGTHS, SLOTS, no_history)
    torch.testing.assert_close(y, ssd_prefill(x, dt, p.A_log, B, C, p.D, p.dt_bias,
                                              (0.0, float("inf")), CHUNK, scratch_ssm, md_fresh),
                               atol=0, rtol=0)
    torch.testing.assert_close(conv, causal_conv1d_prefill(conv_x, p.conv_weight, p.conv_bias,
                                                           scratch_conv, md_fresh),
                               atol=0, rtol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("split", [1, 5, 8, 13])
def test_chunked_prefill_equals_one_call(shape, split):
    """A prompt fed in two calls (the second with has_initial_state) gives the outputs
    and final states of one call, across chunk boundaries or not."""
    g = torch.Generator().manual_seed(10 + split)
    length = 21
    channels = 2 * shape.heads * shape.head_dim
    p = make_params(shape, channels, g)
    x, dt, B, C = make_tokens(shape, length, g)
    conv_x = torch.randn(length, channels, generator=g)
    limit = (0.0, float("inf"))

    def run(parts: list[tuple[int, int]]):
        ssm = torch.zeros(2, shape.heads, shape.head_dim, shape.state)
        conv = torch.zeros(2, channels, shape.conv_width - 1)
        ys, convs = [], []
        for start, end in parts:
            md = metadata([end - start], [1], [start > 0])
            ys.append(ssd_prefill(x[start:end], dt[start:end], p.A_log, B[start:end],
                                  C[start:end], p.D, p.dt_bias, limit, CHUNK, ssm, md))
            convs.append(causal_conv1d_prefill(conv_x[start:end], p.conv_weight,
                                               p.conv_bias, conv, md))
        return torch.cat(ys), torch.cat(convs), ssm[1], conv[1]

    whole = run([(0, length)])
    split_run = run([(0, split), (split, length)])
    for a, b in zip(whole, split_run):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


def test_dt_limit_clamps_the_step():
    shape = SHAPES[1]
    p, (x, dt, B, C), _, _, ssm_state = prefill_setup(shape, seed=4)
    limit = (0.05, 0.3)
    md = metadata(LENGTHS, SLOTS, HAS_INITIAL)
    state = ssm_state.clone()
    y = ssd_prefill(x, dt, p.A_log, B, C, p.D, p.dt_bias, limit, CHUNK, state, md)
    chunk_scan = hf_bamba().mamba2_chunk_scan
    start, end, slot, _ = list(spans())[3]
    want_y, want_state = naive_ssd(x[start:end], dt[start:end], B[start:end], C[start:end], p,
                                   ssm_state[slot], dt_limit=limit)
    close(y[start:end], want_y)
    close(state[slot], want_state)
    hf_y = chunk_scan(x[None, start:end], dt[None, start:end], p.A, B[None, start:end],
                      C[None, start:end], chunk_size=CHUNK, D=p.D, dt_bias=p.dt_bias,
                      initial_states=ssm_state[slot][None], dt_softplus=True, dt_limit=limit)
    close(y[start:end], hf_y[0])
    unclamped = ssd_prefill(x, dt, p.A_log, B, C, p.D, p.dt_bias, (0.0, float("inf")), CHUNK,
                            ssm_state.clone(), md)
    assert (unclamped[start:end] - y[start:end]).abs().max() > 1e-2  # the clamp did bite


def test_metadata_without_host_copies():
    shape = SHAPES[0]
    p, (x, dt, B, C), conv_x, conv_state, ssm_state = prefill_setup(shape, seed=5)
    args = (x, dt, p.A_log, B, C, p.D, p.dt_bias, (0.0, float("inf")), CHUNK)
    y_host = ssd_prefill(*args, ssm_state.clone(), metadata(LENGTHS, SLOTS, HAS_INITIAL))
    y_dev = ssd_prefill(*args, ssm_state.clone(),
                        metadata(LENGTHS, SLOTS, HAS_INITIAL, host_copies=False))
    torch.testing.assert_close(y_host, y_dev, atol=0, rtol=0)


# ----------------------------------------------------------------------------- decode
DECODE_SLOTS = [4, -1, 3, 7, 2]  # one padding row (slot 0, which it must not touch, is free)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_ssd_decode_matches_recurrence_and_transformers(shape):
    g = torch.Generator().manual_seed(6)
    channels = 2 * shape.heads * shape.head_dim
    p = make_params(shape, channels, g)
    batch = len(DECODE_SLOTS)
    x, dt, B, C = make_tokens(shape, batch, g)
    ssm_state = torch.randn(NUM_SLOTS, shape.heads, shape.head_dim, shape.state, generator=g)
    ssm_state[0] = float("nan")  # a free slot holding garbage: a padding row never reads it
    before = ssm_state.clone()
    state = ssm_state.clone()
    idx = torch.tensor(DECODE_SLOTS, dtype=torch.int32)
    y = ssd_decode(x, dt, p.A_log, B, C, p.D, p.dt_bias, (0.0, float("inf")), state, idx)
    assert torch.isfinite(y).all()
    P, N = shape.head_dim, shape.state
    for row, slot in enumerate(DECODE_SLOTS):
        if slot < 0:
            continue
        want_y, want_state = naive_ssd(x[row:row + 1], dt[row:row + 1], B[row:row + 1],
                                       C[row:row + 1], p, before[slot])
        close(y[row], want_y[0])
        close(state[slot], want_state)
        hf_state = before[slot][None].clone()
        hf_y = hf_bamba().mamba2_selective_state_update(
            hf_state, x[row:row + 1], dt[row:row + 1, :, None].expand(-1, -1, P),
            p.A[:, None, None].expand(-1, P, N), B[row:row + 1], C[row:row + 1],
            p.D[:, None].expand(-1, P), dt_bias=p.dt_bias[:, None].expand(-1, P),
            dt_softplus=True)
        close(y[row], hf_y[0])
        close(state[slot], hf_state[0])
    untouched = [s for s in range(NUM_SLOTS) if s not in DECODE_SLOTS]
    assert torch.equal(state[untouched].nan_to_num(), before[untouched].nan_to_num())


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_conv_decode_matches_definition_and_transformers(shape):
    g = torch.Generator().manual_seed(7)
    channels = 2 * shape.heads * shape.head_dim
    p = make_params(shape, channels, g)
    batch = len(DECODE_SLOTS)
    x = torch.randn(batch, channels, generator=g)
    conv_state = torch.randn(NUM_SLOTS, channels, shape.conv_width - 1, generator=g)
    conv_state[0] = float("nan")
    before = conv_state.clone()
    state = conv_state.clone()
    out = causal_conv1d_decode(x, p.conv_weight, p.conv_bias, state,
                               torch.tensor(DECODE_SLOTS, dtype=torch.int32))
    assert torch.isfinite(out).all()
    for row, slot in enumerate(DECODE_SLOTS):
        if slot < 0:
            continue
        want, want_state = naive_conv(x[row:row + 1], p.conv_weight, p.conv_bias, before[slot])
        close(out[row], want[0])
        close(state[slot], want_state)
        hf_state = before[slot][None].clone()
        hf_out = hf_bamba().causal_conv1d_update(x[row:row + 1, :, None], hf_state,
                                                 p.conv_weight, p.conv_bias, activation="silu")
        close(out[row], hf_out[0, :, 0])
        close(state[slot], hf_state[0])
    untouched = [s for s in range(NUM_SLOTS) if s not in DECODE_SLOTS]
    assert torch.equal(state[untouched].nan_to_num(), before[untouched].nan_to_num())


def test_prefill_then_decode_equals_longer_prefill():
    """Decode steps continue exactly where a prefill left the states."""
    shape = SHAPES[1]
    g = torch.Generator().manual_seed(8)
    channels = 2 * shape.heads * shape.head_dim
    p = make_params(shape, channels, g)
    length, prompt = 14, 10
    x, dt, B, C = make_tokens(shape, length, g)
    conv_x = torch.randn(length, channels, generator=g)
    limit = (0.0, float("inf"))
    ssm = torch.zeros(3, shape.heads, shape.head_dim, shape.state)
    conv = torch.zeros(3, channels, shape.conv_width - 1)
    md = metadata([prompt], [2], [False])
    ys = [ssd_prefill(x[:prompt], dt[:prompt], p.A_log, B[:prompt], C[:prompt], p.D, p.dt_bias,
                      limit, CHUNK, ssm, md)]
    convs = [causal_conv1d_prefill(conv_x[:prompt], p.conv_weight, p.conv_bias, conv, md)]
    idx = torch.tensor([2], dtype=torch.int32)
    for t in range(prompt, length):
        s = slice(t, t + 1)
        ys.append(ssd_decode(x[s], dt[s], p.A_log, B[s], C[s], p.D, p.dt_bias, limit, ssm, idx))
        convs.append(causal_conv1d_decode(conv_x[s], p.conv_weight, p.conv_bias, conv, idx))
    ssm_ref = torch.zeros_like(ssm)
    conv_ref = torch.zeros_like(conv)
    md_all = metadata([length], [2], [False])
    y_ref = ssd_prefill(x, dt, p.A_log, B, C, p.D, p.dt_bias, limit, CHUNK, ssm_ref, md_all)
    conv_out_ref = causal_conv1d_prefill(conv_x, p.conv_weight, p.conv_bias, conv_ref, md_all)
    torch.testing.assert_close(torch.cat(ys), y_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(torch.cat(convs), conv_out_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ssm, ssm_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(conv, conv_ref, atol=0, rtol=0)


def test_low_precision_states_and_inputs():
    """States stay in their own dtype, outputs come back in the inputs' dtype."""
    shape = SHAPES[1]
    p, (x, dt, B, C), conv_x, conv_state, ssm_state = prefill_setup(shape, seed=9)
    md = metadata(LENGTHS, SLOTS, HAS_INITIAL)
    state16 = ssm_state.to(torch.bfloat16)
    y16 = ssd_prefill(x.bfloat16(), dt.bfloat16(), p.A_log, B.bfloat16(), C.bfloat16(),
                      p.D.bfloat16(), p.dt_bias.bfloat16(), (0.0, float("inf")), CHUNK,
                      state16, md)
    assert y16.dtype == torch.bfloat16 and state16.dtype == torch.bfloat16
    y32 = ssd_prefill(x, dt, p.A_log, B, C, p.D, p.dt_bias, (0.0, float("inf")), CHUNK,
                      ssm_state.clone(), md)
    rel = (y16.float() - y32).norm() / y32.norm()
    assert rel < 3e-2, rel
    conv16 = conv_state.to(torch.bfloat16)
    out16 = causal_conv1d_decode(conv_x[:5].bfloat16(), p.conv_weight, p.conv_bias, conv16,
                                 torch.tensor(DECODE_SLOTS, dtype=torch.int32))
    assert out16.dtype == torch.bfloat16 and conv16.dtype == torch.bfloat16


def test_bad_inputs_raise_clear_errors():
    shape = SHAPES[1]
    p, (x, dt, B, C), conv_x, conv_state, ssm_state = prefill_setup(shape, seed=11)
    md = metadata(LENGTHS, SLOTS, HAS_INITIAL)
    limit = (0.0, float("inf"))
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_prefill(x, dt, p.A_log, B, C, p.D, p.dt_bias, limit, 0, ssm_state, md)
    with pytest.raises(ValueError, match="G dividing"):
        ssd_prefill(x, dt, p.A_log, B[:, :1].expand(-1, 4, -1), C[:, :1].expand(-1, 4, -1), p.D,
                    p.dt_bias, limit, CHUNK, ssm_state, md)
    with pytest.raises(ValueError, match="dt"):
        ssd_prefill(x, dt[:, :2], p.A_log, B, C, p.D, p.dt_bias, limit, CHUNK, ssm_state, md)
    with pytest.raises(ValueError, match="one state index per row"):
        ssd_decode(x[:3], dt[:3], p.A_log, B[:3], C[:3], p.D, p.dt_bias, limit, ssm_state,
                   torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_prefill(conv_x, p.conv_weight, p.conv_bias, conv_state, md,
                              activation="gelu")


# ----------------------------------------------------------- mixed steps, split

def _metadata(lens, has_initial, slots):
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(lens), 0)
    has_initial = torch.tensor(has_initial)
    slots = torch.tensor(slots, dtype=torch.int32)
    return MambaMetadata(num_reqs=len(lens), num_tokens=int(qsl[-1]), query_start_loc=qsl,
                         state_indices=slots, has_initial_state=has_initial,
                         max_query_len=max(lens), query_start_loc_cpu=qsl,
                         has_initial_state_cpu=has_initial, state_indices_cpu=slots)


@pytest.mark.parametrize("first", [True, False])
def test_a_mixed_step_splits_into_decode_rows_and_prefills(first):
    from spindle.layers.mamba.mixer import decode_prefill_split

    if first:  # decodes first (the usual order): slices
        lens, init, slots = [1, 1, 3, 1, 2], [True, True, False, False, True], [4, 0, 2, 3, 1]
    else:
        lens, init, slots = [3, 1, 2, 1], [True, True, False, True], [4, 0, 2, 3]
    md = _metadata(lens, init, slots)
    split = decode_prefill_split(md)
    assert decode_prefill_split(md) is split  # made once per step
    assert split.contiguous is first
    tokens = torch.arange(md.num_tokens * 2, dtype=torch.float32).reshape(md.num_tokens, 2)
    decode_rows = [i for i, (n, h) in enumerate(zip(lens, init)) if n == 1 and h]
    starts = md.query_start_loc_cpu.tolist()
    assert split.take_decode(tokens)[:, 0].tolist() == [2.0 * starts[i] for i in decode_rows]
    assert split.decode_slots.tolist() == [slots[i] for i in decode_rows]
    pre = split.prefill_md
    prefill_rows = [i for i in range(len(lens)) if i not in decode_rows]
    assert pre.state_indices.tolist() == [slots[i] for i in prefill_rows]
    assert pre.has_initial_state.tolist() == [init[i] for i in prefill_rows]
    assert (pre.query_start_loc[1:] - pre.query_start_loc[:-1]).tolist() == \
        [lens[i] for i in prefill_rows]
    # Taking both parts and merging them back gives the step's rows in order.
    merged = split.merge(split.take_decode(tokens), split.take_prefill(tokens))
    assert torch.equal(merged, tokens)


def test_a_step_that_is_not_mixed_is_not_split():
    from spindle.layers.mamba.mixer import decode_prefill_split

    assert decode_prefill_split(_metadata([1, 1], [True, True], [0, 1])) is None
    assert decode_prefill_split(_metadata([3, 2], [False, True], [0, 1])) is None
