"""The cross-attention decode kernel (attention/cross_triton.py) against a float32 torch
reference on fresh random inputs: each query over its own slot's keys and values, GQA,
padding rows (slot -1), positions that are no multiple of the tile, and a slot layout
that is not the batch order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_utils import DEVICE, HALF, INTERPRETED, pick

pytestmark = [pytest.mark.gpu, pytest.mark.kernel]


def _reference(q, key_cache, value_cache, slots, scale):
    out = torch.zeros(q.shape, dtype=torch.float32)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        k = key_cache[slot].float().cpu().transpose(0, 1)  # [H_kv, L, D]
        v = value_cache[slot].float().cpu().transpose(0, 1)
        out[i] = F.scaled_dot_product_attention(
            q[i].float().cpu().unsqueeze(1), k, v, scale=scale,
            enable_gqa=q.shape[1] != k.shape[0]).squeeze(1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("heads, kv_heads, head_dim, length", pick(
    [(20, 20, 64, 1500), (8, 2, 128, 100), (6, 3, 48, 77)],
    [(4, 4, 16, 70), (4, 2, 32, 33)]))
def test_cross_decode_matches_reference(dtype, heads, kv_heads, head_dim, length):
    from spindle.attention.cross_triton import cross_decode_attention

    gen = torch.Generator().manual_seed(heads * 1000 + length)
    num_slots, batch = 7, 5
    to = dict(dtype=dtype, device=DEVICE)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(**to)
    key_cache = torch.randn(num_slots, length, kv_heads, head_dim, generator=gen).to(**to)
    value_cache = torch.randn(num_slots, length, kv_heads, head_dim, generator=gen).to(**to)
    slots = torch.tensor([5, 0, -1, 3, 6], dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    out = cross_decode_attention(q, key_cache, value_cache, slots, scale)
    ref = _reference(q, key_cache, value_cache, slots, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float().cpu(), ref, atol=tol, rtol=tol)
    assert bool((out[2] == 0).all())  # the padding row
