"""The fused MoE Triton path (layers/fused_moe.py) against the torch expert loop
(layers/moe.py, transformers' computation) on fresh random inputs: routings with
unused experts and experts that take many tokens, float32 and half precision; and the
row alignment it runs on."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, HALF, pick

pytestmark = [pytest.mark.gpu, pytest.mark.kernel]
# (tokens, hidden, intermediate, experts, top_k)
CASES = pick([(1, 1024, 768, 128, 8), (37, 1024, 768, 128, 8), (300, 512, 256, 8, 2),
              (2048, 256, 128, 16, 4)],
             [(1, 64, 32, 4, 2), (9, 64, 48, 6, 3), (40, 32, 32, 4, 1)])


def _inputs(tokens, hidden, inter, experts, top_k, dtype, seed, gated=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, (2 if gated else 1) * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    # A skewed routing: expert 0 popular, the last one never chosen.
    scores = torch.randn(tokens, experts, generator=gen)
    scores[:, 0] += 2.0
    scores[:, -1] = -1e9
    weights, ids = torch.softmax(scores, -1).topk(top_k, dim=-1)
    to = dict(device=DEVICE)
    return (x.to(dtype=dtype, **to), w13.to(dtype=dtype, **to), w2.to(dtype=dtype, **to),
            ids.to(**to), weights.to(dtype=dtype, **to))


def _torch_experts(x, w13, w2, ids, weights, gated=True):
    from spindle.distributed.parallel_state import TensorParallelGroup
    from spindle.layers.moe import FusedExperts

    experts = FusedExperts(w13.shape[0], x.shape[1], w2.shape[2], TensorParallelGroup.single(),
                           gated=gated)
    experts.w13.data, experts.w2.data = w13.float().cpu(), w2.float().cpu()
    return experts(x.float().cpu(), ids.cpu(), weights.float().cpu())


@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("gated", [True, False], ids=["swiglu", "relu2"])
def test_fused_experts_equal_the_torch_loop(tokens, hidden, inter, experts, top_k, dtype,
                                            gated):
    """SwiGLU experts, and NemotronH's two-projection squared-ReLU ones."""
    from spindle.layers.fused_moe import fused_experts

    x, w13, w2, ids, weights = _inputs(tokens, hidden, inter, experts, top_k, dtype,
                                       seed=tokens + experts, gated=gated)
    out = fused_experts(x, w13, w2, ids, weights, gated)
    ref = _torch_experts(x, w13, w2, ids, weights, gated)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
    else:
        err = (out.float().cpu() - ref).norm() / ref.norm()
        assert err < 1e-2


def test_rows_are_grouped_by_expert_in_whole_blocks():
    from spindle.layers.fused_moe import align_by_expert

    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEVICE)
    rows, block_experts = align_by_expert(ids, num_experts=4, block_m=4)
    rows, block_experts = rows.cpu().tolist(), block_experts.cpu().tolist()
    # Expert 0: pairs 1 and 4; expert 1: pair 3; expert 2: pairs 0, 2, 5; expert 3: none.
    assert rows[:12] == [1, 4, -1, -1, 3, -1, -1, -1, 0, 2, 5, -1]
    assert all(r == -1 for r in rows[12:])
    assert block_experts[:3] == [0, 1, 2] and all(e == 4 for e in block_experts[3:])


@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_biased_experts_with_the_clamped_swiglu(tokens, hidden, inter, experts, top_k, dtype):
    """gpt-oss's experts: biases on both projections, (clamp(up) + 1) * g * sigmoid(1.702 g)
    with g = min(gate, limit); a limit low enough that the clamps bite."""
    from spindle.distributed.parallel_state import TensorParallelGroup
    from spindle.layers.fused_moe import fused_experts
    from spindle.layers.moe import ClampedSwiGLU, FusedExperts

    x, w13, w2, ids, weights = _inputs(tokens, hidden, inter, experts, top_k, dtype,
                                       seed=tokens + 7 * experts)
    gen = torch.Generator().manual_seed(tokens)
    b13 = torch.randn(experts, 2 * inter, generator=gen).to(dtype=dtype, device=DEVICE)
    b2 = torch.randn(experts, hidden, generator=gen).to(dtype=dtype, device=DEVICE)
    activation = ClampedSwiGLU(alpha=1.702, limit=1.5)
    out = fused_experts(x * 3, w13, w2, ids, weights, True, b13, b2, activation)
    ref_experts = FusedExperts(experts, hidden, inter, TensorParallelGroup.single(), bias=True,
                               activation=activation)
    for name, value in (("w13", w13), ("w2", w2), ("w13_bias", b13), ("w2_bias", b2)):
        getattr(ref_experts, name).data = value.float().cpu()
    ref = ref_experts((x * 3).float().cpu(), ids.cpu(), weights.float().cpu())
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
    else:
        assert (out.float().cpu() - ref).norm() / ref.norm() < 1e-2
