"""Activations of the MLPs: gated (SwiGLU, GeGLU) and the squared ReLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spindle.layers import cpu_kernels


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up (the SwiGLU MLP)."""

    def __init__(self) -> None:
        super().__init__()
        # Row by row on CPU (batch_invariant.py); the CUDA kernel is element-wise already.
        self.batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2:
            from spindle.layers.fused_kernels import silu_and_mul

            return silu_and_mul(x)
        if x.dim() == 2 and cpu_kernels.applies(x):  # (element-wise: batch-invariant too)
            return cpu_kernels.silu_and_mul(x)
        if self.batch_invariant:
            from spindle.layers.batch_invariant import rowwise

            return rowwise(_silu_and_mul, x)
        return _silu_and_mul(x)


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (NemotronH's MLPs and experts; transformers' "relu2")."""
    return torch.square(torch.relu(x))


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


class GeluTanhAndMul(nn.Module):
    """x = [gate | up] -> gelu_tanh(gate) * up (Gemma's GeGLU MLP; torch code)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]
