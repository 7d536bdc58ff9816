"""Fused Triton norm / rotary / SiLU kernels against the plain-torch layers they
replace, on fresh random inputs, in float32 and bfloat16 (fp16 under the interpreter:
kernel_utils)."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, HALF

pytestmark = [pytest.mark.gpu, pytest.mark.kernel]
DTYPES = [torch.float32, HALF]


# bf16/fp16: at most one rounding step apart where fp32 reduction orders differ.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5),
             torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
             torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _close(out, ref, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 1024, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, hidden, with_residual):
    from spindle.layers.fused_kernels import rms_norm
    from spindle.layers.norm import RMSNorm

    norm = RMSNorm(hidden, eps=1e-6)
    norm.weight.data = torch.randn(hidden)
    norm = norm.to(dtype)
    x = torch.randn(37, hidden, dtype=dtype)
    residual = torch.randn(37, hidden, dtype=dtype) if with_residual else None
    ref = norm.cpu()(x, residual) if with_residual else norm.cpu()(x)
    out = rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), 1e-6,
                   residual.to(DEVICE) if with_residual else None)
    if with_residual:
        _close(out[0].cpu(), ref[0], dtype)
        assert torch.equal(out[1].cpu(), ref[1])  # the add rounds exactly like torch
    else:
        _close(out.cpu(), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,num_q,num_k", [(128, 16, 8), (64, 4, 1), (16, 4, 2)])
@pytest.mark.parametrize("with_norm", [False, True])
def test_qk_norm_rope(dtype, head_dim, num_q, num_k, with_norm):
    from spindle.layers.fused_kernels import qk_norm_rope_
    from spindle.layers.norm import RMSNorm
    from spindle.layers.rotary import RotaryEmbedding, apply_rotary

    rope = RotaryEmbedding(head_dim, 4096, {"rope_type": "default", "rope_theta": 10000.0})
    tokens = 29
    # q and k as strided views into one qkv buffer, as the model produces them.
    qkv = torch.randn(tokens, (num_q + 2 * num_k) * head_dim, dtype=dtype)
    positions = torch.randint(0, 4096, (tokens,))
    q = qkv[:, :num_q * head_dim].reshape(tokens, num_q, head_dim)
    k = qkv[:, num_q * head_dim:(num_q + num_k) * head_dim].reshape(tokens, num_k, head_dim)
    qn, kn = RMSNorm(head_dim).to(dtype), RMSNorm(head_dim).to(dtype)
    qn.weight.data = torch.randn(head_dim, dtype=dtype)
    kn.weight.data = torch.randn(head_dim, dtype=dtype)
    cos, sin = rope(positions, dtype)
    rq, rk = (qn(q), kn(k)) if with_norm else (q, k)
    ref_q, ref_k = apply_rotary(rq, cos, sin), apply_rotary(rk, cos, sin)

    dev_qkv = qkv.to(DEVICE)
    dq = dev_qkv[:, :num_q * head_dim].view(tokens, num_q, head_dim)
    dk = dev_qkv[:, num_q * head_dim:(num_q + num_k) * head_dim].view(tokens, num_k, head_dim)
    qk_norm_rope_(dq, dk, positions.to(DEVICE), rope.cos_cache.to(DEVICE),
                  rope.sin_cache.to(DEVICE),
                  qn.weight.to(DEVICE) if with_norm else None,
                  kn.weight.to(DEVICE) if with_norm else None, 1e-6)
    _close(dq.cpu(), ref_q, dtype)
    _close(dk.cpu(), ref_k, dtype)
    # v (the rest of the buffer) is untouched.
    assert torch.equal(dev_qkv[:, (num_q + num_k) * head_dim:].cpu(),
                       qkv[:, (num_q + num_k) * head_dim:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [128, 3072, 1000])
def test_silu_and_mul(dtype, width):
    from spindle.layers.activation import SiluAndMul
    from spindle.layers.fused_kernels import silu_and_mul

    x = torch.randn(19, 2 * width, dtype=dtype) * 3
    ref = SiluAndMul()(x)
    out = silu_and_mul(x.to(DEVICE)).cpu()
    _close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,num_q,num_k", [(128, 16, 8), (64, 8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_qk_norm_rope_stores_kv(dtype, head_dim, num_q, num_k, block_size):
    """With a cache, the same launch writes each token's rotated k and its v into its
    slot; padding tokens (slot -1) write nothing; q and k are rotated as without."""
    from spindle.layers.fused_kernels import qk_norm_rope_
    from spindle.layers.rotary import QKNormRope
    from spindle.layers.rotary import RotaryEmbedding

    tokens, num_blocks = 23, 5
    gen = torch.Generator().manual_seed(head_dim + num_k + block_size)
    rope = RotaryEmbedding(head_dim, 4096, {"rope_type": "default", "rope_theta": 10000.0})
    qkv = torch.randn(tokens, (num_q + 2 * num_k) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[3, 17]] = -1  # CUDA-graph padding tokens
    weights = [torch.randn(head_dim, generator=gen).to(dtype) for _ in range(2)]
    cache = torch.randn((2, num_blocks, block_size, num_k, head_dim), generator=gen).to(dtype)

    def split(buf):
        q = buf[:, :num_q * head_dim].view(tokens, num_q, head_dim)
        k = buf[:, num_q * head_dim:(num_q + num_k) * head_dim].view(tokens, num_k, head_dim)
        return q, k, buf[:, (num_q + num_k) * head_dim:].view(tokens, num_k, head_dim)

    to = lambda t: t.to(DEVICE, copy=True)  # noqa: E731
    unfused_qkv = to(qkv)
    uq, uk, _ = split(unfused_qkv)
    qk_norm_rope_(uq, uk, to(positions), to(rope.cos_cache), to(rope.sin_cache),
                  to(weights[0]), to(weights[1]), 1e-6)

    dev_qkv, dev_cache = to(qkv), to(cache)
    q, k, v = split(dev_qkv)
    transform = QKNormRope(to(positions), to(rope.cos_cache), to(rope.sin_cache),
                           to(weights[0]), to(weights[1]), 1e-6)
    transform.apply_(q, k, v, dev_cache, to(slots))
    # q and k as without the store (float32: the two compiled variants may contract
    # multiply-adds differently); v untouched.
    _close(q.cpu(), uq.cpu(), dtype)
    _close(k.cpu(), uk.cpu(), dtype)
    assert torch.equal(v.cpu(), split(qkv)[2])
    # The cache: exactly this launch's k and the v at the real tokens' slots, the
    # rest as it was.
    real = slots >= 0
    expect = cache.clone().view(2, -1, num_k, head_dim)
    expect[0, slots[real]], expect[1, slots[real]] = k.cpu()[real], v.cpu()[real]
    assert torch.equal(dev_cache.cpu().view(2, -1, num_k, head_dim), expect)
