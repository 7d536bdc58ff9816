"""The batch-invariant Triton GEMM (layers/invariant_gemm.py): against a float32 torch
reference on fresh random inputs, and each row the same bits whatever rows share its
launch and wherever it sits among them."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, HALF, pick

pytestmark = [pytest.mark.gpu, pytest.mark.kernel]
# Qwen3-0.6B's qkv, o_proj and down_proj; then N and K off the tile sizes.
SHAPES = pick([(4096, 1024), (1024, 2048), (1024, 3072), (1000, 200)],
              [(192, 96), (100, 72)])
# Across every tile configuration gemm_config picks (by rows: <= 64, <= 512, more).
ROWS = pick([1, 5, 64, 65, 300, 513, 1100], [1, 5, 33])


def _inputs(m, n, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    b = torch.randn(n, generator=gen)
    return x.to(dtype=dtype, device=DEVICE), w.to(dtype=dtype, device=DEVICE), \
        b.to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_equals_a_float32_reference(n, k, dtype):
    from spindle.layers.invariant_gemm import invariant_matmul

    for m in ROWS:
        x, w, b = _inputs(m, n, k, dtype, seed=m + n + k)
        out = invariant_matmul(x, w, b)
        ref = x.float().cpu() @ w.float().cpu().T + b.float().cpu()
        if dtype == torch.float32:
            torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
        else:  # one rounding of a float32 sum
            torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=1.6e-2)


@pytest.mark.parametrize("n,k", SHAPES[:2])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_a_row_is_the_same_bits_in_any_batch_at_any_place(n, k, dtype):
    from spindle.layers.invariant_gemm import invariant_matmul

    x, w, b = _inputs(max(ROWS), n, k, dtype, seed=1)
    row = x[:1]
    alone = invariant_matmul(row, w, b)
    for m in ROWS:
        mates, _, _ = _inputs(m, 1, k, dtype, seed=100 + m)
        for place in sorted({0, m // 2, m - 1}):
            batch = mates.clone()
            batch[place] = row[0]
            assert torch.equal(invariant_matmul(batch, w, b)[place], alone[0]), (m, place)
