"""The one-launch LoRA kernel (spindle/lora/kernels.py) against the masked torch form
(lora/layers.py LoRASlots.delta) on fresh random slots: one, two and three parts of
unequal rows, ranks below the slots' (and not a power of two), tokens without an
adapter, more tokens than programs along the columns, float32 and bf16 (fp16 under
the interpreter: kernel_utils)."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, HALF, pick

pytestmark = [pytest.mark.gpu, pytest.mark.kernel]

TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4),
             torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
             torch.float16: dict(atol=3e-3, rtol=3e-3)}


class _Layer:
    def __init__(self, input_size: int, output_size: int) -> None:
        self.input_size, self.output_size = input_size, output_size


def _slots(part_rows, k, loras, rank, used_rank, dtype):
    """LoRASlots of random adapters in every slot, each of rank used_rank <= rank (each
    part's B is the layer's output rows, zero outside the part's, as the loaders write)."""
    from spindle.lora.layers import LoRASlots

    slots = LoRASlots(_Layer(k, sum(part_rows)), part_rows, loras, rank, dtype,
                      torch.device(DEVICE))
    for slot in range(loras):
        start = 0
        for part, rows in enumerate(part_rows):
            b = torch.zeros(sum(part_rows), used_rank)
            b[start:start + rows] = torch.randn(rows, used_rank)
            slots.write(slot, part, (torch.randn(used_rank, k) / k ** 0.5).to(dtype),
                        b.to(dtype))
            start += rows
    return slots


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("part_rows,k,loras,rank,used_rank", [
    ([200], 96, 3, 8, 8),
    ([64, 136], 160, 2, 16, 12),
    ([128, 32, 32], 72, 4, 4, 3),
    pytest.param([2048, 512, 512], 1024, 4, 16, 16, marks=pytest.mark.skipif(
        DEVICE == "cpu", reason="full Qwen3 shape: too slow under the interpreter")),
])
@pytest.mark.parametrize("num_tokens", [1, 7, pick(300, 40)])
def test_lora_add_equals_the_masked_form(dtype, part_rows, k, loras, rank, used_rank,
                                         num_tokens):
    from spindle.lora.kernels import lora_add_
    from spindle.lora.layers import lora_columns, lora_mask

    torch.manual_seed(num_tokens * 1000 + k)
    slots = _slots(part_rows, k, loras, rank, used_rank, dtype)
    token_slots = torch.randint(-1, loras, (num_tokens,), device=DEVICE)
    token_slots[0] = loras - 1  # (at least one token with an adapter)
    x = torch.randn(num_tokens, k, dtype=dtype, device=DEVICE)
    y = torch.randn(num_tokens, sum(part_rows), dtype=dtype, device=DEVICE)
    mask = lora_mask(token_slots, lora_columns(loras, rank, torch.device(DEVICE)), dtype)
    expected = y + slots.delta(x, mask)
    before = y.clone()
    lora_add_(y, x, token_slots, slots.a, slots.b, part_rows, loras, rank)
    torch.testing.assert_close(y.float(), expected.float(), **TOLERANCE[dtype])
    none = token_slots < 0
    assert torch.equal(y[none], before[none])  # tokens without an adapter: untouched
    assert not torch.equal(y[~none], before[~none])


def test_lora_add_refuses_parts_that_do_not_cover_the_output():
    from spindle.lora.kernels import lora_add_

    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"LoRA parts of \[4, 4\] rows for an output of 9"):
        lora_add_(torch.zeros(2, 9, device=DEVICE), x, torch.zeros(2, dtype=torch.int64,
                  device=DEVICE), torch.zeros(8, 8, device=DEVICE),
                  torch.zeros(9, 8, device=DEVICE), [4, 4], 1, 4)
