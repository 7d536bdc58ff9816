"""The one-row TMA GEMV (layers/tma_gemv.py): its tiles and what it applies to; its
compiled code's order (every weight copy asked for before the PDL wait), checked by
compiling for sm_90 without a GPU; and on a Hopper GPU, its products against a float32
torch reference on fresh random inputs with poisoned outputs, in CUDA graphs under PDL,
and as the skinny GEMM's one-row path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from spindle.layers import tma_gemv

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
hopper = pytest.mark.skipif(
    not HOPPER, reason="TMA needs a CUDA device of compute capability 9.0 or later")
needs_gluon = pytest.mark.skipif(not tma_gemv.HAVE_GLUON, reason="this Triton has no Gluon")


def test_pick_config_fits_two_programs_in_an_sm():
    """16 rows a program where its whole share of W fits MAX_SHARED_BYTES, else 8, else
    None; K chunks of 256 (the next power of two below that); 8 warps with SiLU."""
    pick = tma_gemv.pick_config
    assert pick(1024, 2) == tma_gemv.GemvConfig(16, 256, 4)  # Qwen3-0.6B qkv, gate_up
    assert pick(3072, 2, silu_and_mul=True) == tma_gemv.GemvConfig(16, 256, 8)  # down
    assert pick(4096, 2) == tma_gemv.GemvConfig(8, 256, 4)  # 16 rows: 128 KB
    assert pick(14336, 2) is None  # a Llama-3-8B down projection: 229 KB at 8 rows
    assert pick(100, 2) == tma_gemv.GemvConfig(16, 128, 4)
    assert pick(8, 2).block_k == 16  # (a TMA copy's row is at least 16 bytes)
    for k in (16, 1000, 3072, 6000):
        config = pick(k, 2)
        assert config is None or config.shared_bytes(k, 2) <= tma_gemv.MAX_SHARED_BYTES
    assert 2 * pick(3072, 2, True).shared_bytes(3072, 2) <= 227 << 10


def test_applies_only_to_cuda_tensors():
    x, w = torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    assert not tma_gemv.tma_gemv_applies(x, w)


_COMPILE = """
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from spindle.layers import tma_gemv

k, silu, norm = json.loads(sys.argv[1])
config = tma_gemv.pick_config(k, 2, silu)
chunks = triton.cdiv(k, config.block_k)
layout = tma_gemv._shared_layout(config.block_n, config.block_k, torch.bfloat16)
names = tma_gemv._tma_gemv_kernel.arg_names
types = [f"tensordesc<bf16[{config.block_n}, {config.block_k}],{layout!r}>"] \\
    + ["*bf16"] * 6 + ["fp32", "i32"]
signature = dict(zip(names, types + ["constexpr"] * (len(names) - len(types))))
values = dict(K=k, BLOCK_N=config.block_n, BLOCK_K=config.block_k, CHUNKS=chunks,
              X_ROWS=triton.next_power_of_2(chunks), HAS_BIAS=False, SILU_MUL=silu,
              NORM=norm, HAS_RESIDUAL=norm, PDL=True)
source = GluonASTSource(tma_gemv._tma_gemv_kernel, signature,
                        {(names.index(name),): v for name, v in values.items()})
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": config.num_warps, "launch_pdl": True})
print(json.dumps([chunks, compiled.metadata.shared, compiled.asm["ptx"]]))
"""


def _compile_for_sm90(k: int, silu: bool, norm: bool) -> tuple[str, int, int]:
    """The kernel's PTX for an H100/H200, its K chunks and its shared memory bytes,
    compiled by Triton's own ptxas without a GPU: in a fresh interpreter, since the
    tests' Triton may be in interpreter mode (conftest), which Gluon does not have."""
    env = {name: v for name, v in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps([k, silu, norm])],
                          capture_output=True, text=True, env=env, timeout=300)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    chunks, shared, ptx = json.loads(done.stdout.strip().splitlines()[-1])
    return ptx, chunks, shared


@needs_gluon
@pytest.mark.parametrize("k,silu,norm", [(1024, False, False), (3072, True, False),
                                         (1024, False, True)])
def test_every_weight_copy_is_asked_for_before_the_pdl_wait(k, silu, norm):
    """The design in the compiled code: let the next kernel launch, issue the TMA copies
    of every chunk of the program's W, and only then wait for the kernel before; read x
    (and the residual) after the wait, the norm's weight before it. Its shared memory
    is what pick_config planned, so two programs fit an SM."""
    ptx, chunks, shared = _compile_for_sm90(k, silu, norm)
    assert shared == tma_gemv.pick_config(k, 2, silu).shared_bytes(k, 2)
    assert shared <= tma_gemv.MAX_SHARED_BYTES
    lines = [line.strip() for line in ptx.splitlines()]
    release = next(i for i, line in enumerate(lines) if "launch_dependents" in line)
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    copies = [i for i, line in enumerate(lines) if "cp.async.bulk.tensor" in line]
    # (A chunk of 256 columns is two 128-byte-swizzled copies, issued by two warps.)
    assert len(copies) == chunks and release < min(copies) and max(copies) < wait
    global_loads = [i for i, line in enumerate(lines) if "ld.global" in line]
    after = [i for i in global_loads if i > wait]
    assert after and len(global_loads) - len(after) == (len(after) // 2 if norm else 0)


def _inputs(n, k, dtype, with_bias, seed, silu=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2 * k if silu else k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    b = torch.randn(n, generator=gen) if with_bias else None
    to = dict(dtype=dtype, device="cuda")
    return x.to(**to), w.to(**to), (b.to(**to) if b is not None else None)


def _reference(x, w, b, silu=False):
    """float32 product on the CPU; with silu, of x's activation rounded as
    fused_kernels.silu_mul rounds it."""
    x = x.float().cpu()
    if silu:
        k = w.shape[1]
        gate, up = x[:, :k], x[:, k:]
        act = (gate * torch.sigmoid(gate)).to(w.dtype).float()
        x = (act * up).to(w.dtype).float()
    ref = x @ w.float().cpu().T
    return ref + b.float().cpu() if b is not None else ref


def _check(out, ref, dtype):
    out = out.float().cpu()
    assert not out.isnan().any(), "unwritten (NaN-poisoned) outputs"
    torch.testing.assert_close(out, ref.to(dtype).float(), rtol=1.6e-2, atol=1e-2)
    assert (out - ref).norm() / ref.norm() < 1e-2


def _run(x, w, b=None, silu=False):
    out = torch.full((1, w.shape[0]), float("nan"), dtype=w.dtype, device=w.device)
    assert tma_gemv.tma_gemv_applies(x, w, silu)
    assert tma_gemv.tma_gemv(x, w, b, out, silu_and_mul=silu) is out
    return out


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n,k", [(4096, 1024), (6144, 1024), (1024, 2048), (1000, 2048),
                                 (200, 520), (37, 16), (64, 4096)])
def test_tma_gemv_matches_torch(n, k, dtype, with_bias):
    """Qwen3-0.6B's shapes; N not a multiple of the program's rows (its copies zero-fill
    past N, its stores are masked); K not a multiple of the chunk (zeros past K); the
    smallest K; 8 rows a program (K 4096)."""
    x, w, b = _inputs(n, k, dtype, with_bias, seed=n + k)
    _check(_run(x, w, b), _reference(x, w, b), dtype)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("n,k", [(1024, 3072), (300, 520)])
def test_silu_and_mul_applied_to_x(n, k):
    """x = [gate | up]: the product is of silu(gate) * up, rounded as the engine's
    activation kernel rounds it (bf16 throughout)."""
    x, w, _ = _inputs(n, k, torch.bfloat16, False, seed=k, silu=True)
    _check(_run(x, w, silu=True), _reference(x, w, None, silu=True), torch.bfloat16)


@pytest.mark.gpu
@hopper
def test_what_it_applies_to(monkeypatch):
    """One half-precision row and a weight of its dtype whose rows are 16-byte aligned
    and whose share fits shared memory; the switch turns it off."""
    monkeypatch.delenv(tma_gemv.SWITCH_ENV, raising=False)
    applies = tma_gemv.tma_gemv_applies
    x, w, _ = _inputs(256, 1024, torch.bfloat16, False, seed=1)
    assert applies(x, w)
    assert not applies(x.expand(2, -1), w)  # two rows: the skinny GEMM's
    assert not applies(x.float(), w.float())  # float32
    assert not applies(x, w.half())  # another dtype
    assert not applies(x[:, :100], w[:, :100].contiguous())  # 200-byte rows
    assert not applies(x, w.t().contiguous().t())  # not contiguous
    assert not applies(*_inputs(8, 14336, torch.bfloat16, False, seed=2)[:2])  # too wide
    assert not applies(x, w.to(torch.float8_e4m3fn), weight_scale=torch.ones(256))
    monkeypatch.setenv(tma_gemv.SWITCH_ENV, "0")
    assert not applies(x, w)


@pytest.mark.gpu
@hopper
def test_cuda_graph_chain_under_pdl():
    """Three GEMVs that each read the one before, captured in one CUDA graph (launched
    with PDL, so each program asks for its weights before the previous kernel ends):
    replays on new inputs give the eager bits, which match the reference."""
    from spindle.layers import pdl

    torch.manual_seed(0)
    ws = [(torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
          for n, k in ((4096, 1024), (1024, 2048), (3072, 4096))]
    x = torch.zeros(1, 1024, dtype=torch.bfloat16, device="cuda")

    def chain():
        h = tma_gemv.tma_gemv(x, ws[0])[:, :2048]
        h = tma_gemv.tma_gemv(h, ws[1])
        return tma_gemv.tma_gemv(h.repeat(1, 4), ws[2])

    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = chain()
    assert pdl.enabled(x.device) or not tma_gemv.HAVE_GLUON
    for seed in range(3):
        x.copy_(torch.randn(1, 1024, generator=torch.Generator().manual_seed(seed)))
        y.fill_(float("nan"))
        graph.replay()
        eager = chain()
        assert torch.equal(y, eager)
        h = (x.float().cpu() @ ws[0].float().cpu().T).to(torch.bfloat16)[:, :2048]
        h = (h.float() @ ws[1].float().cpu().T).to(torch.bfloat16)
        _check(y, h.float().repeat(1, 4) @ ws[2].float().cpu().T, torch.bfloat16)


@pytest.mark.gpu
@hopper
def test_the_skinny_gemm_hands_it_one_row(monkeypatch):
    """skinny_linear at one row gives tma_gemv's bits (its deferred merge then has no
    partials to defer); SPINDLE_TMA_GEMV=0 gives the skinny kernel's, also correct."""
    from spindle.layers.skinny_gemm import new_split_counters, skinny_linear

    monkeypatch.delenv(tma_gemv.SWITCH_ENV, raising=False)
    x, w, b = _inputs(1024, 3072, torch.bfloat16, True, seed=5)
    counters = new_split_counters(1024, x.device)
    y = skinny_linear(x, w, b, counters=counters, defer_merge=True)
    assert isinstance(y, torch.Tensor) and torch.equal(y, _run(x, w, b))
    monkeypatch.setenv(tma_gemv.SWITCH_ENV, "0")
    _check(skinny_linear(x, w, b, counters=counters), _reference(x, w, b), torch.bfloat16)


def _norm_reference(x, residual, norm_weight, eps=1e-6):
    """(rows the product reads, x + residual): fused_kernels.rms_norm's roundings in
    float32 torch on the CPU."""
    x = x.cpu()
    summed = x if residual is None else (x.float() + residual.cpu().float()).to(x.dtype)
    h = summed.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (norm_weight.cpu().float() * normed.float()).to(x.dtype), summed


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("n,k", [(4096, 1024), (6144, 1024), (200, 520)])
def test_a_pending_norm_is_applied_as_x_loads(n, k, with_residual):
    """A PendingNorm as x: the product is of its normalized rows (against torch doing the
    norm kernel's roundings), and every program of the launch sees them; the first
    stores x + residual into residual_out, bit for bit."""
    from spindle.layers.fused_kernels import PendingNorm

    x, w, _ = _inputs(n, k, torch.bfloat16, False, seed=n + k + with_residual)
    gen = torch.Generator().manual_seed(k)
    residual = torch.randn(1, k, generator=gen).to(torch.bfloat16).cuda()
    norm_weight = (1 + torch.randn(k, generator=gen) / 4).to(torch.bfloat16).cuda()
    out_residual = torch.full_like(x, float("nan"))
    pending = PendingNorm(x, norm_weight, 1e-6, residual if with_residual else None,
                          out_residual if with_residual else None)
    rows, summed = _norm_reference(x, residual if with_residual else None, norm_weight)
    _check(_run(pending, w), rows.float() @ w.float().cpu().T, torch.bfloat16)
    if with_residual:
        assert torch.equal(out_residual.cpu(), summed)
    else:
        assert out_residual.isnan().all()


@pytest.mark.gpu
@hopper
def test_a_linear_layer_takes_a_deferred_norm(monkeypatch):
    """RMSNorm(defer=True) on one CUDA row gives a PendingNorm and the residual stream's
    tensor; a column-parallel layer reading it applies the norm in its TMA GEMV (the norm
    never runs alone), or, where the GEMV does not apply (SPINDLE_TMA_GEMV=0), runs the
    norm first. Both match the norm then the product, and the stream holds x + residual."""
    from spindle.distributed.parallel_state import TensorParallelGroup
    from spindle.layers import fused_kernels
    from spindle.layers.linear import MergedColumnParallelLinear
    from spindle.layers.norm import RMSNorm

    monkeypatch.delenv(tma_gemv.SWITCH_ENV, raising=False)
    with torch.device("cuda"):
        norm = RMSNorm(1024)
        gate_up = MergedColumnParallelLinear(1024, [3072, 3072], bias=False,
                                             tp_group=TensorParallelGroup(rank=0, size=1))
    for p in (norm.weight, gate_up.weight):
        p.data = (1 + torch.randn_like(p, dtype=torch.float32) / 8).to(torch.bfloat16)
    gate_up.weight.data /= 32
    runs = []
    real = fused_kernels.PendingNorm.materialized
    monkeypatch.setattr(fused_kernels.PendingNorm, "materialized",
                        lambda self: runs.append(1) or real(self))
    x = torch.randn(1, 1024, dtype=torch.bfloat16, device="cuda")
    residual = torch.randn(1, 1024, dtype=torch.bfloat16, device="cuda")
    rows, summed = _norm_reference(x, residual, norm.weight)
    reference = rows.float() @ gate_up.weight.float().cpu().T
    pending, stream = norm(x, residual, defer=True)
    assert isinstance(pending, fused_kernels.PendingNorm)
    _check(gate_up(pending), reference, torch.bfloat16)
    assert not runs and torch.equal(stream.cpu(), summed)
    monkeypatch.setenv(tma_gemv.SWITCH_ENV, "0")
    pending, stream = norm(x, residual, defer=True)
    _check(gate_up(pending), reference, torch.bfloat16)
    assert runs == [1] and torch.equal(stream.cpu(), summed)
    two_rows = torch.cat([x, x])
    assert isinstance(norm(two_rows, torch.cat([residual, residual]), defer=True)[0],
                      torch.Tensor)  # (only one row defers)


@pytest.mark.kernel
def test_a_pending_norm_run_alone_is_the_norm_kernel():
    """Where no GEMV takes it, a PendingNorm runs fused_kernels.rms_norm, writing the
    residual stream's tensor it was given (and nothing, without a residual); on the CPU
    a norm never defers."""
    from kernel_utils import DEVICE, HALF

    from spindle.layers.fused_kernels import PendingNorm, materialized, rms_norm
    from spindle.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(1, 64, generator=gen).to(HALF).to(DEVICE) for _ in range(2))
    weight = (1 + torch.randn(64, generator=gen) / 4).to(HALF).to(DEVICE)
    out = torch.full_like(x, float("nan"))
    y = PendingNorm(x, weight, 1e-6, residual, out).materialized()
    expected, summed = rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(y, expected) and torch.equal(out, summed)
    assert torch.equal(materialized(PendingNorm(x, weight, 1e-6)), rms_norm(x, weight, 1e-6))
    assert materialized(x) is x
    norm = RMSNorm(64).to(HALF)
    assert not norm.deferrable(x.cpu(), residual.cpu())
    assert isinstance(norm.pre_norm(x.cpu(), residual.cpu(), defer=True)[0], torch.Tensor)
