"""FP8 weights (EngineArgs.quantization="fp8"): per-channel float8 e4m3 weights and
dynamically quantized per-token activations.

A quantized linear layer keeps ``weight`` as float8_e4m3fn [N, K] and ``weight_scale``
as float32 [N], with W ~= weight * weight_scale[:, None]. Each output row's scale is
its largest magnitude over 448 (e4m3's largest finite value), so every row uses the
whole e4m3 range. The weight loaders quantize each rank-local shard as it arrives
(``quantize_rows``): the model is never held in high precision, a checkpoint reload
(sleep level 2, weight updates) writes into the same tensors, and under tensor
parallelism a row-parallel shard's rows are scaled over that rank's columns.

A matmul picks one of two paths:

* decode-sized batches on CUDA (at most skinny_gemm.max_rows(), 16, rows): the skinny GEMM
  reads the float8 weight and widens it to the activations' dtype in registers: half
  the bytes of a bf16 weight, and the activations stay exact;
* otherwise: the activations are quantized per token the same way (row max / 448) and
  ``torch._scaled_mm`` multiplies the two float8 operands, scaling the float32
  products by both scales (cuBLASLt on CUDA, compute capability 8.9 and up; oneDNN
  on the CPU).

Only the layers of spindle.layers.linear are quantized: embeddings, the LM head,
norms, routers and MoE experts keep the model's dtype.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
QUANTIZATION_METHODS = ("fp8",)
# float8 GEMMs on CUDA: Ada (8.9) and Hopper (9.0) onwards.
MIN_CUDA_CAPABILITY = (8, 9)

logger = logging.getLogger(__name__)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (q float8 [R, C], scale float32 [R]) with x ~= q * scale[:, None]:
    scale = max|row| / 448 (rows of zeros get scale 1), q = x / scale rounded to the
    nearest e4m3 value. Computed in float32."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows takes a 2-D tensor, got shape {tuple(x.shape)}")
    x = x.float()
    amax = x.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None,
               split_counters: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (weight * weight_scale[:, None])^T (+ bias), in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.is_cuda:
        from spindle.layers.skinny_gemm import skinny_linear, use_skinny_gemm

        if use_skinny_gemm(x2, weight, weight_scale):
            y = skinny_linear(x2, weight, bias, counters=split_counters,
                              weight_scale=weight_scale)
            return y.reshape(*lead, weight.shape[0])
    if x2.shape[0] == 0:
        return x.new_empty(*lead, weight.shape[0])
    xq, x_scale = quantize_rows(x2)
    if _cpu_kernel_applies(xq, weight):
        from spindle.layers import cpu_kernels

        y = cpu_kernels.fp8_matmul(xq.float(), weight.view(torch.uint8))
        y = y * (x_scale[:, None] * weight_scale[None, :])  # (as torch._scaled_mm scales)
        y = (y + bias if bias is not None else y).to(x.dtype)
    else:
        y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale[:, None],
                             scale_b=weight_scale[None, :], bias=bias, out_dtype=x.dtype)
    return y.reshape(*lead, weight.shape[0])


# Rows up to which a CPU product runs cpu_kernels.fp8_matmul (a decode step's batch);
# more go to torch's float8 GEMM.
CPU_KERNEL_MAX_ROWS = 32


def _cpu_kernel_applies(xq: torch.Tensor, weight: torch.Tensor) -> bool:
    """A CPU product of a few rows, K a multiple of 16, the fused CPU kernels on and
    built: cpu_kernels.fp8_matmul (the same products, summed exactly; about 6x faster
    than torch's float8 GEMM on a 2-core machine)."""
    from spindle.layers import cpu_kernels

    return (xq.device.type == "cpu" and xq.shape[0] <= CPU_KERNEL_MAX_ROWS
            and weight.shape[1] % 16 == 0 and weight.is_contiguous()
            and cpu_kernels.switched_on() and cpu_kernels.available())


def check_quantization(method: str, capability: tuple[int, int] | None = None) -> None:
    """ValueError unless spindle implements method (on a GPU of this CUDA capability)."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or "
                         f"none, got {method!r}")
    if capability is not None and capability < MIN_CUDA_CAPABILITY:
        raise ValueError(f"quantization='fp8' needs float8 GEMMs: CUDA compute capability "
                         f"{MIN_CUDA_CAPABILITY[0]}.{MIN_CUDA_CAPABILITY[1]} or newer, this "
                         f"GPU has {capability[0]}.{capability[1]}")


def quantize_linear_layers(model: nn.Module, device: torch.device) -> int:
    """Give every linear layer of model float8 weight storage (before its checkpoint is
    loaded: the loaders then quantize as they copy). Returns the number of layers.
    ValueError on a GPU without float8 GEMMs."""
    from spindle.layers.linear import _ParallelLinearBase

    if device.type == "cuda":
        check_quantization("fp8", torch.cuda.get_device_capability(device))

    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, _ParallelLinearBase)]
    for name, layer in layers:
        n, k = layer.weight.shape
        if n % 16 or k % 16:
            raise ValueError(f"quantization='fp8' needs linear layers whose rank-local sizes "
                             f"are multiples of 16 (float8 GEMM operands); {name} is "
                             f"[{n}, {k}]")
        layer.use_fp8_weight()
    logger.info("fp8: %d linear layers hold float8 e4m3 weights with per-channel scales",
                len(layers))
    return len(layers)
