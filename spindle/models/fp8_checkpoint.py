"""Checkpoints whose weights are stored in float8, as two formats write them:

* transformers' ``quant_method: "fp8"`` (FineGrainedFP8: DeepSeek-V3, Qwen3-*-FP8): a
  float8 ``X.weight`` with a float32 ``X.weight_scale_inv`` per ``weight_block_size``
  block (despite its name, multiplied in: W = weight * scale);
* ``quant_method: "compressed-tensors"`` with 8-bit float weights (llm-compressor's
  FP8 / FP8_DYNAMIC schemes): ``X.weight`` with ``X.weight_scale`` per tensor, per
  output channel ([N, 1]), per group or per block, and ``X.input_scale`` for static
  activation scales.

The checkpoint stream dequantizes every float8 weight with its scale to float32
(``Fp8CheckpointReader``), so models load it like any other; under quantization="fp8"
(the default for these checkpoints) the linear layers quantize it again per output
channel as they copy it (spindle.layers.fp8). A per-channel checkpoint whose rows
reach 448 (llm-compressor's min-max scales) comes back to the very same float8
values; per-tensor and block scales are re-rounded to per-channel ones. Static input
scales are not used: activations are always scaled per token.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
WEIGHT_SCALE_NAMES = ("weight_scale_inv", "weight_scale")
# Companions of a float8 weight that the dequantized stream leaves out.
_SKIPPED_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale")
SUPPORTED = ("quant_method 'fp8' (transformers' FineGrainedFP8)",
             "quant_method 'compressed-tensors' with 8-bit float weights",
             "quant_method 'mxfp4' on gpt-oss's experts",
             "GGUF files (spindle.models.gguf)")


@dataclass(frozen=True)
class Fp8Checkpoint:
    """A float8 checkpoint's scale layout: block (rows, columns) of one scale, or None
    for per-tensor / per-channel scales (read off the scale's shape)."""
    block: tuple[int, int] | None = None


def fp8_checkpoint_format(hf_config: Any) -> Fp8Checkpoint | None:
    """The float8 layout hf_config's quantization_config declares; None when there is
    none; ValueError naming what is supported for any other quantization."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        return Fp8Checkpoint(tuple(int(b) for b in block) if block else None)
    if method == "compressed-tensors":
        return _compressed_tensors_format(qc)
    if method == "mxfp4" and "GptOssForCausalLM" in (getattr(hf_config, "architectures", None)
                                                     or []):
        return None  # (gpt-oss's experts: dequantized as they load, models/gpt_oss.py)
    raise ValueError(f"checkpoint quantization {method!r} is not supported; spindle reads "
                     f"{'; '.join(SUPPORTED)}")


def _compressed_tensors_format(qc: dict) -> Fp8Checkpoint:
    blocks = set()
    for name, group in (qc.get("config_groups") or {}).items():
        weights = (group or {}).get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(f"compressed-tensors group {name!r} stores "
                             f"{weights.get('num_bits')}-bit {weights.get('type')} weights; "
                             f"spindle reads 8-bit float weights only ({'; '.join(SUPPORTED)})")
        strategy = weights.get("strategy", "tensor")
        if strategy == "block":
            blocks.add(tuple(int(b) for b in weights["block_structure"]))
        elif strategy == "group":
            blocks.add((1, int(weights["group_size"])))
        elif strategy in ("tensor", "channel"):
            blocks.add(None)
        else:
            raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not "
                             "supported (tensor, channel, group or block)")
    if len(blocks) > 1:
        raise ValueError(f"compressed-tensors groups mix weight scale layouts "
                         f"{sorted(map(str, blocks))}; spindle reads one layout per checkpoint")
    return Fp8Checkpoint(blocks.pop() if blocks else None)


def dequantize(weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None, name: str = "weight") -> torch.Tensor:
    """weight (float8 [N, K]) times its scale, in float32: one scale for the tensor, one
    per row ([N] or [N, 1]), or one per block ([ceil(N / rows), ceil(K / cols)])."""
    w, s = weight.float(), scale.float()
    if w.dim() != 2:
        raise ValueError(f"float8 tensor {name} has shape {tuple(w.shape)}; spindle reads "
                         "2-D float8 weights only")
    n, k = w.shape
    if block is not None and s.dim() == 2:
        rows, cols = block
        if s.shape != (-(-n // rows), -(-k // cols)):
            raise ValueError(f"{name}: block scales of shape {tuple(s.shape)} do not fit a "
                             f"[{n}, {k}] weight in {rows}x{cols} blocks")
        s = s.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
        return w * s
    if s.numel() == 1:
        return w * s.reshape(())
    if s.numel() == n and s.shape in ((n,), (n, 1)):
        return w * s.reshape(n, 1)
    raise ValueError(f"{name}: a scale of shape {tuple(s.shape)} fits no per-tensor, "
                     f"per-channel or block layout of a [{n}, {k}] weight")


class Fp8CheckpointReader:
    """Looks up the scale of a float8 weight in any file of the checkpoint (a sharded
    checkpoint need not keep the two together)."""

    def __init__(self, files: list[Path], layout: Fp8Checkpoint,
                 stack: contextlib.ExitStack) -> None:
        from safetensors import safe_open

        self.layout = layout
        self.handles = [stack.enter_context(safe_open(str(p), framework="pt", device="cpu"))
                         for p in files]
        self._where = {name: h for h in self.handles for name in h.keys()}

    @staticmethod
    def skipped(name: str) -> bool:
        """Scales are read with their weight, not passed on."""
        return name.endswith(_SKIPPED_SUFFIXES)

    def dequantized(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        base = name[: -len("weight")] if name.endswith("weight") else None
        for scale_name in WEIGHT_SCALE_NAMES:
            handle = self._where.get(f"{base}{scale_name}") if base is not None else None
            if handle is not None:
                scale = handle.get_tensor(f"{base}{scale_name}")
                return dequantize(tensor, scale, self.layout.block, name)
        raise ValueError(f"float8 tensor {name} has no scale in the checkpoint (looked for "
                         f"{', '.join((base or name + '.') + s for s in WEIGHT_SCALE_NAMES)})")


def iter_dequantized(files: list[Path], layout: Fp8Checkpoint,
                     dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a float8 checkpoint with its scales folded in: float8 weights
    come as float32, other floating tensors in dtype."""
    with contextlib.ExitStack() as stack:
        reader = Fp8CheckpointReader(files, layout, stack)
        for handle in reader.handles:
            for name in handle.keys():
                if reader.skipped(name):
                    continue
                tensor = handle.get_tensor(name)
                if tensor.dtype in FLOAT8_DTYPES:
                    yield name, reader.dequantized(name, tensor)
                elif tensor.is_floating_point() and tensor.dtype != dtype:
                    yield name, tensor.to(dtype)
                else:
                    yield name, tensor
