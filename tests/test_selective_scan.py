"""Mamba (version 1) selective scan (spindle/layers/mamba/selective_scan.py, Jamba's
mixer) against transformers' Jamba functions (``mamba_selective_scan``'s token-by-token
path and ``mamba_selective_state_update``, run in float64), on fresh random inputs:
packed requests of ragged lengths, some continuing a stored state, padding rows that
must leave every state alone; and the Triton kernels against the torch ops.

Tolerance: 1e-5 relative to the largest reference value (float32 against float64)."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, HALF, pick

from spindle.layers.mamba import selective_scan
from spindle.layers.mamba.metadata import MambaMetadata

TOL = 1e-5
NUM_SLOTS = 6


def _inputs(tokens, channels, state_size, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype)

    return dict(x=randn(tokens, channels), dt=randn(tokens, channels),
                A_log=torch.log(1 + 15 * torch.rand(channels, state_size, generator=g)),
                B=randn(tokens, state_size), C=randn(tokens, state_size), D=randn(channels),
                dt_bias=randn(channels, scale=0.5), z=randn(tokens, channels))


def _reference(x, rows, initial):
    """transformers' Jamba step over rows (a slice), float64, from initial [D, N]: token
    by token through its state update (its sequence scan cannot start from a state)."""
    from transformers.models.jamba.modeling_jamba import mamba_selective_state_update

    d = {k: v.double() for k, v in x.items()}
    A = -torch.exp(d["A_log"])
    state = initial.double().clone()[None]
    outs = []
    for t in range(rows.start, rows.stop):
        outs.append(mamba_selective_state_update(
            state, d["x"][t][None], d["dt"][t][None], A, d["B"][t][None], d["C"][t][None],
            d["D"], dt_bias=d["dt_bias"], dt_softplus=True, z=d["z"][t][None])[0])
    return torch.stack(outs), state[0]


def test_the_reference_agrees_with_transformers_full_sequence_scan():
    """(The token-by-token reference above against transformers' sequence scan, which
    starts from zeros.)"""
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan

    x = _inputs(9, 6, 4, seed=1)
    d = {k: v.double() for k, v in x.items()}
    out, state = mamba_selective_scan(
        d["x"].t()[None], d["dt"].t()[None], -torch.exp(d["A_log"]), d["B"].t()[None],
        d["C"].t()[None], D=d["D"], z=d["z"].t()[None], delta_bias=d["dt_bias"],
        delta_softplus=True, return_last_state=True)
    ref_out, ref_state = _reference(x, slice(0, 9), torch.zeros(6, 4))
    torch.testing.assert_close(out[0].t(), ref_out)
    torch.testing.assert_close(state[0], ref_state)


def _close(out, ref, what):
    scale = max(ref.abs().max().item(), 1e-6)
    torch.testing.assert_close(out.double().cpu(), ref.double().cpu(), atol=TOL * scale,
                               rtol=TOL, msg=lambda m: f"{what}: {m}")


def _metadata(lens, slots, has_init, device="cpu"):
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    idx, init = torch.tensor(slots, dtype=torch.int32), torch.tensor(has_init)
    return MambaMetadata(num_reqs=len(lens), num_tokens=sum(lens),
                         query_start_loc=qsl.to(device), state_indices=idx.to(device),
                         has_initial_state=init.to(device), max_query_len=max(lens),
                         query_start_loc_cpu=qsl, has_initial_state_cpu=init,
                         state_indices_cpu=idx)


LENS, SLOTS, HAS_INIT = [1, 4, 19, 7], [3, 0, 5, -1], [True, False, True, False]


def test_prefill_equals_transformers():
    x = _inputs(sum(LENS), 12, 5, seed=2)
    state = torch.randn(NUM_SLOTS, 12, 5)
    before = state.clone()
    out = selective_scan.selective_scan_prefill(**x, ssm_state=state,
                                                md=_metadata(LENS, SLOTS, HAS_INIT))
    start = 0
    for n, slot, init in zip(LENS, SLOTS, HAS_INIT):
        initial = before[slot] if init else torch.zeros(12, 5)
        ref_out, ref_state = _reference(x, slice(start, start + n), initial)
        _close(out[start:start + n], ref_out, f"output of the request at slot {slot}")
        if slot >= 0:
            _close(state[slot], ref_state, f"state of slot {slot}")
        start += n
    for untouched in (1, 2, 4):
        assert torch.equal(state[untouched], before[untouched])


def test_decode_equals_transformers():
    slots = [4, -1, 0]
    x = _inputs(len(slots), 10, 3, seed=3)
    state = torch.randn(NUM_SLOTS, 10, 3)
    before = state.clone()
    out = selective_scan.selective_scan_decode(
        **x, ssm_state=state, state_indices=torch.tensor(slots, dtype=torch.int32))
    for row, slot in enumerate(slots):
        initial = before[slot] if slot >= 0 else torch.zeros(10, 3)
        ref_out, ref_state = _reference(x, slice(row, row + 1), initial)
        _close(out[row], ref_out[0], f"row {row}")
        if slot >= 0:
            _close(state[slot], ref_state, f"state of slot {slot}")
    for untouched in (1, 2, 3, 5):
        assert torch.equal(state[untouched], before[untouched])


def test_bad_shapes_are_refused():
    x = _inputs(3, 4, 2, seed=0)
    x["B"] = x["B"][:, :1]
    with pytest.raises(ValueError, match="B and C must be"):
        selective_scan.selective_scan_decode(**x, ssm_state=torch.zeros(2, 4, 2),
                                             state_indices=torch.zeros(3, dtype=torch.int32))


def _half_tol(dtype):
    return TOL if dtype == torch.float32 else 2 ** -7 if dtype == torch.bfloat16 else 2 ** -9


@pytest.mark.gpu
@pytest.mark.kernel
@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (HALF, HALF),
                                               (HALF, torch.float32)])  # (Mamba's state)
@pytest.mark.parametrize("channels,state_size,block_d", pick(
    [(8192, 16, 32), (72, 16, 32), (40, 5, 32), (8192, 16, 128), (72, 16, 16)],
    [(40, 5, 32), (8, 16, 32), (40, 5, 16), (72, 16, 64)]))
def test_triton_prefill_and_decode_equal_torch(dtype, state_dtype, channels, state_size,
                                               block_d):
    """block_d: channels per program (the default, 32, and others the benchmark sweeps)."""
    from spindle.layers.mamba import selective_scan_triton as triton_scan

    x = _inputs(sum(LENS), channels, state_size, seed=4, dtype=dtype)
    for name in ("A_log", "D", "dt_bias"):
        x[name] = x[name].float()
    state = torch.randn(NUM_SLOTS, channels, state_size).to(state_dtype)
    expected_state = state.clone()
    expected = selective_scan.selective_scan_prefill(**x, ssm_state=expected_state,
                                                     md=_metadata(LENS, SLOTS, HAS_INIT))
    got_state = state.to(DEVICE)
    got = triton_scan.selective_scan_prefill(
        **{k: v.to(DEVICE) for k, v in x.items()}, ssm_state=got_state,
        md=_metadata(LENS, SLOTS, HAS_INIT, DEVICE), block_d=block_d)
    tol = _half_tol(dtype)
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float().cpu(), expected.float(), atol=tol * scale, rtol=tol)
    torch.testing.assert_close(got_state.float().cpu(), expected_state.float(), atol=tol,
                               rtol=tol)

    rows = _inputs(5, channels, state_size, seed=5, dtype=dtype)
    for name in ("A_log", "D", "dt_bias"):
        rows[name] = rows[name].float()
    indices = torch.tensor([4, -1, 0, 2, 5], dtype=torch.int32)
    expected = selective_scan.selective_scan_decode(**rows, ssm_state=expected_state,
                                                    state_indices=indices)
    got = triton_scan.selective_scan_decode(**{k: v.to(DEVICE) for k, v in rows.items()},
                                            ssm_state=got_state,
                                            state_indices=indices.to(DEVICE),
                                            block_d=block_d)
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float().cpu(), expected.float(), atol=tol * scale, rtol=tol)
    torch.testing.assert_close(got_state.float().cpu(), expected_state.float(), atol=tol,
                               rtol=tol)
