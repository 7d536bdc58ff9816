"""RMSNorm with Hugging Face numerics, optionally fused with the residual add."""

from __future__ import annotations


import torch
from torch import nn

from spindle.layers import cpu_kernels
from spindle.layers.linear import set_weight_loader, default_weight_loader
from spindle.switches import on_off


# "0" keeps a bf16 model's residual stream in bf16 on the CPU, as transformers does.
FP32_RESIDUAL_ENV = "SPINDLE_CPU_FP32_RESIDUAL"


def fp32_residual_stream(hidden: torch.Tensor) -> bool:
    """Whether a bf16 model on the CPU carries its residual stream in float32: each
    layer's output is added to it in float32 and only the norms' outputs are rounded to
    bf16. Measured on SmolLM2-135M's GGUF types (docs/benchmarks.md), it keeps the
    model's greedy choices much closer to float32 (Q5_0: 0.966 -> 0.976 top-1) for a
    residual row of floats per token; llama.cpp keeps its residual in float32 too."""
    return (hidden.dtype == torch.bfloat16 and hidden.device.type == "cpu"
            and on_off(FP32_RESIDUAL_ENV, True))


def rms_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension, computed and returned in
    float32: the step every RMSNorm variant shares (they differ in where the weight
    joins and where the result is rounded)."""
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """y = weight * normalize(x), computed like HF's LlamaRMSNorm: the statistics and the
    scaling in float32, then a cast back to the input dtype *before* multiplying by the
    weight (so half-precision models round where HF rounds).

    forward(x) -> y, or forward(x, residual) -> (y, x + residual): the decoder layers
    keep the residual stream separate so the add and the norm sit in one call.
    """

    # Whether the fused kernels (which compute Llama's numerics) may run this norm.
    fused = True

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)
        # Row by row on CPU (batch_invariant.py); the CUDA kernel and the C++ one (bf16 on
        # the CPU) are row-wise already.
        self.batch_invariant = False

    def _norm(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """dtype: where the normalized rows are rounded before the weight (x's dtype, or
        the activations' for a float32 residual stream)."""
        return self.weight * rms_normalized(x, self.variance_epsilon).to(dtype or x.dtype)

    def forward(self, x, residual: torch.Tensor | None = None, defer: bool = False):
        """x: a tensor, or on CUDA a skinny GEMM's unsummed output (SplitKPartials,
        which only the fused kernel reads). defer: as deferred()'s, where it applies."""
        if defer and residual is not None and self.deferrable(x, residual):
            return self.deferred(x, residual)
        if self.fused:
            out = self._fused_forward(x, residual)
            if out is not None:
                return out
        if residual is None:
            return self._normalize(x)
        # HF adds in the activation dtype, as here; a float32 residual keeps the sum in
        # float32 (fp32_residual_stream), the normalized rows still rounded to x's dtype.
        summed = residual + x
        return self._normalize(summed, x.dtype), summed

    def _fused_forward(self, x, residual: torch.Tensor | None):
        """The fused CUDA or C++ kernel's result, or None where neither applies."""
        if not isinstance(x, torch.Tensor) or (x.is_cuda and x.dim() == 2):
            from spindle.layers.fused_kernels import rms_norm

            return rms_norm(x, self.weight, self.variance_epsilon, residual)
        if x.dim() == 2 and self.weight.dtype == x.dtype and cpu_kernels.applies(x):
            return cpu_kernels.rms_norm(x, self.weight, self.variance_epsilon, residual)
        return None

    def pre_norm(self, x, residual: torch.Tensor | None, defer: bool = False):
        """A decoder layer's input norm: (norm(x), x) at the first layer, which has no
        residual yet, else forward(x, residual). defer: as deferred()'s."""
        if defer and self.deferrable(x, residual):
            return self.deferred(x, residual)
        if residual is None:
            return self(x), x
        return self(x, residual)

    def deferrable(self, x, residual: torch.Tensor | None) -> bool:
        """Whether deferred() applies: the fused kernel's numerics, one row of a CUDA
        tensor (a decode step of one request), a residual of its dtype, and not
        batch-invariant."""
        return (self.fused and not self.batch_invariant and isinstance(x, torch.Tensor)
                and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
                and self.weight.dtype == x.dtype
                and (residual is None or residual.dtype == x.dtype))

    def deferred(self, x: torch.Tensor, residual: torch.Tensor | None):
        """(PendingNorm, residual stream): the norm left for the linear layer that reads
        it next to apply as it loads its input (a TMA GEMV; any other layer runs it
        first), the sum x + residual in a tensor that the one running it writes."""
        from spindle.layers.fused_kernels import PendingNorm

        if residual is None:
            return PendingNorm(x, self.weight, self.variance_epsilon), x
        summed = torch.empty_like(x)
        return PendingNorm(x, self.weight, self.variance_epsilon, residual, summed), summed

    def _normalize(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """_norm over x, row by row when batch-invariant (batch_invariant.py)."""
        if self.batch_invariant:
            from spindle.layers.batch_invariant import rowwise

            return rowwise(lambda rows: self._norm(rows, dtype), x)
        return self._norm(x, dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"


class UnfusedRMSNorm(RMSNorm):
    """An RMSNorm whose numerics differ from Llama's (a subclass's _norm), computed in
    torch on every device (the fused kernels have Llama's): forward(x) -> y, or
    forward(x, residual) -> (y, x + residual) as RMSNorm's."""

    fused = False


class GemmaRMSNorm(UnfusedRMSNorm):
    """Gemma's RMSNorm: the weight is an offset from one, and the scaling happens in
    float32 before the one cast back (transformers' Gemma2RMSNorm; Qwen3-Next's norms
    are the same). The weight loads as stored (zeros mean identity)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        with torch.no_grad():
            self.weight.zero_()

    def _norm(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        h = rms_normalized(x, self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).to(dtype or x.dtype)


class WeightlessRMSNorm(RMSNorm):
    """An RMSNorm without a learned weight (Llama 4's q/k norm): the weight is a buffer of
    ones outside the checkpoint, so Llama's numerics (and the fused kernels) apply as
    they are."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        del self.weight
        self.register_buffer("weight", torch.ones(hidden_size), persistent=False)


class Float32WeightRMSNorm(UnfusedRMSNorm):
    """The weight multiplies the normalized rows in float32, then one cast back
    (Llama's RMSNorm casts first): transformers' NemotronHRMSNorm and OLMo's."""

    def _norm(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (self.weight.float() * rms_normalized(x, self.variance_epsilon)).to(dtype or x.dtype)
