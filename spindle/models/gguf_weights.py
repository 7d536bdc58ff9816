"""A GGUF file's weights read as they are stored: quantization="gguf" (the default for a
GGUF file on the CPU).

models/gguf.py turns a GGUF file into a float32 Hugging Face directory; that directory
still gives the config and the tokenizer. With quantization="gguf" the weights come
from the GGUF file itself instead: each 4-bit and 8-bit matrix (Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, Q4_K, Q5_K) as its integer codes with a scale and an offset per 32 values
(layers/int4.GroupQuantized, the same numbers the gguf package dequantizes), which the
linear layers and the LM head keep in torch's int4 CPU layout (layers/int4.py). Other
tensors (norms, float matrices, and the types with scales per 16 values: Q2_K, Q3_K,
Q6_K) are dequantized to the model's dtype, as is the token embedding, which is read
one row per token (a tied LM head gets its own int4 copy of it).

Architectures: the Llama family as GGUF names it (llama, mistral, qwen2, qwen3), with
transformers' tensor names and its un-permuting of llama's q and k rows.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from spindle.layers.int4 import GROUP, ROW_MULTIPLE, GroupQuantized

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
GROUP_QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K")

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}
_IN_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Tensors the model recomputes from its config.
_SKIPPED = ("rope_freqs.weight",)
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


# GGUF value types (the format's numbering) -> struct format of a scalar; 8 is a string,
# 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
            11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAGIC = b"GGUF"


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: the row length first
    type_name: str
    data: np.ndarray  # the raw bytes (memory-mapped)


class GGUFIndex:
    """A GGUF file's scalar metadata and its tensors' places, read from the header
    without decoding the arrays (the tokenizer's vocabulary is skipped: the converted
    directory has the tokenizer), the tensor bytes memory-mapped. Little-endian files
    (versions 2 and 3)."""

    def __init__(self, path: str | Path, stop_at_key: str | None = None) -> None:
        """stop_at_key: read the metadata only up to that key (and no tensors)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file
                raise ValueError(f"{self.path.name} is not a GGUF file ({e})") from e
        self._pos = 0
        if self._buf[:4] != _MAGIC:
            raise ValueError(f"{self.path.name} is not a GGUF file (no GGUF magic)")
        self._pos = 4
        version, tensor_count, kv_count = self._take("<IQQ")
        if version not in (2, 3):
            raise ValueError(f"{self.path.name}: GGUF version {version} is not read (2 or 3; "
                             "a big-endian file reads as a huge version)")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            (kind,) = self._take("<I")
            value = self._value(kind)
            if value is not None:
                self.metadata[key] = value
            if key == stop_at_key:
                self.tensors = {}
                self._buf.close()
                return
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            (dims,) = self._take("<I")
            shape = self._take(f"<{dims}Q")
            kind, offset = self._take("<IQ")
            infos.append((name, shape, GGMLQuantizationType(kind), offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        # Copy-on-write: writable arrays (torch.from_numpy shares them, no copy), the
        # file itself never written.
        mapped = np.memmap(self.path, dtype=np.uint8, mode="c")
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, qtype, offset in infos:
            block_values, block_bytes = GGML_QUANT_SIZES[qtype]
            size = int(np.prod(shape)) // block_values * block_bytes
            start = data_start + offset
            if start + size > mapped.shape[0]:
                raise ValueError(f"{self.path.name}: tensor {name} runs past the end of the file")
            self.tensors[name] = GGUFTensorInfo(name, tuple(int(d) for d in shape), qtype.name,
                                                mapped[start:start + size])
        self._buf.close()

    def _take(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._take("<Q")
        text = self._buf[self._pos:self._pos + length].decode("utf-8", "replace")
        self._pos += length
        return text

    def _value(self, kind: int) -> Any:
        """A scalar or string; None for an array (skipped)."""
        if kind in _SCALARS:
            return self._take("<" + _SCALARS[kind])[0]
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"{self.path.name}: unknown GGUF value type {kind}")
        item, count = self._take("<IQ")
        if item in _SCALARS:
            self._pos += count * struct.calcsize(_SCALARS[item])
        elif item == _STRING:  # (the vocabulary: a tight loop over the lengths)
            buf, pos, length_of = self._buf, self._pos, struct.Struct("<Q").unpack_from
            for _ in range(count):
                pos += 8 + length_of(buf, pos)[0]
            self._pos = pos
        else:
            for _ in range(count):
                self._value(item)
        return None


def architecture_of(path: str | Path) -> str | None:
    """The file's general.architecture (from its header, read up to that key)."""
    return GGUFIndex(path, stop_at_key="general.architecture").metadata.get(
        "general.architecture")


class GGUFWeights:
    """The tensors of one GGUF file, by Hugging Face name (read lazily, memory-mapped)."""

    def __init__(self, path: str | Path, hf_config: Any) -> None:
        self.path = Path(path)
        index = GGUFIndex(self.path)
        self.arch = index.metadata.get("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"{self.path.name}: keeping GGUF weights quantized reads the "
                             f"architectures {', '.join(ARCHITECTURES)}, this file is "
                             f"{self.arch!r} (quantization='none' reads it dequantized)")
        self.hf_config = hf_config
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, tensor in index.tensors.items():
            if name not in _SKIPPED:
                self.tensors[hf_name_of(name)] = tensor

    def type_of(self, hf_name: str) -> str:
        return self.tensors[hf_name].type_name

    def is_group_quantized(self, hf_name: str) -> bool:
        tensor = self.tensors[hf_name]
        return tensor.type_name in GROUP_QUANTIZED_TYPES and len(tensor.shape) == 2

    def items(self, dtype: torch.dtype) -> Iterator[tuple[str, GroupQuantized | torch.Tensor]]:
        """(hf name, tensor): GroupQuantized for the group-quantized matrices, else the
        dequantized tensor in dtype. q and k rows un-permuted for llama files."""
        for name in self.tensors:
            yield name, self.read(name, dtype)

    def read(self, hf_name: str, dtype: torch.dtype) -> GroupQuantized | torch.Tensor:
        tensor = self.tensors[hf_name]
        shape = tuple(reversed(tensor.shape))  # [rows, row length]
        if self.is_group_quantized(hf_name):
            value: GroupQuantized | torch.Tensor = decode_groups(tensor.data, tensor.type_name,
                                                                 *shape)
        else:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            array = dequantize(tensor.data, GGMLQuantizationType[tensor.type_name])
            value = torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape)).to(dtype)
        return self._unpermute(hf_name, value)

    def _unpermute(self, hf_name: str, value):
        """llama.cpp stores llama's q and k rows interleaved for its rotary; transformers
        undoes that for arch 'llama' (LlamaTensorProcessor), and so does this."""
        if self.arch != "llama" or not hf_name.endswith((".q_proj.weight", ".k_proj.weight",
                                                        ".q_proj.bias", ".k_proj.bias")):
            return value
        heads = self.hf_config.num_attention_heads
        if ".k_proj." in hf_name:
            heads = getattr(self.hf_config, "num_key_value_heads", None) or heads
        rows = value.shape[0]
        order = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2)
        order = order.reshape(rows)
        if isinstance(value, GroupQuantized):
            return value.permute_rows(order)
        return value[order]


def hf_name_of(gguf_name: str) -> str:
    """token_embd.weight -> model.embed_tokens.weight, blk.3.attn_q.weight ->
    model.layers.3.self_attn.q_proj.weight; ValueError for a name outside the map."""
    match = _LAYER_NAME.match(gguf_name)
    if match:
        layer, part, kind = match.groups()
        if part in _IN_LAYER:
            return f"model.layers.{layer}.{_IN_LAYER[part]}.{kind}"
    else:
        stem, _, kind = gguf_name.rpartition(".")
        if stem in _TOP_LEVEL:
            return f"{_TOP_LEVEL[stem]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name} has no place in a Llama-family model")


# ------------------------------------------------------------------ block decoding
def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[B, 2] uint8 -> [B] float32 (the blocks' float16 scales)."""
    return raw.contiguous().view(torch.float16).reshape(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[B, 16] bytes -> [B, 32] values: the low nibbles first, then the high ones."""
    return torch.cat([qs & 15, qs >> 4], dim=1)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 6-bit scales and minimums of a K-quant block's 8 sub-blocks ([B, 12] bytes ->
    2 x [B, 8]), as the gguf package's Q4_K.get_scale_min unpacks them."""
    d, m, m_d = scales.reshape(-1, 3, 4).unbind(1)
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mins


def _k_low_bits(qs: torch.Tensor) -> torch.Tensor:
    """[B, 128] bytes -> [B, 8, 32]: each 32-byte run holds sub-block 2i in its low
    nibbles and 2i + 1 in its high ones."""
    runs = qs.reshape(-1, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    return (runs & 15).reshape(-1, 8, 32)


def _high_bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Bit j of each block's little-endian bit field -> [B, count] (0 or 1)."""
    bits = torch.arange(8, dtype=torch.uint8)
    return ((qh[..., None] >> bits) & 1).reshape(qh.shape[0], -1)[:, :count]


def decode_groups(data: np.ndarray, type_name: str, rows: int, cols: int) -> GroupQuantized:
    """The blocks of a group-quantized GGUF matrix [rows, cols] -> GroupQuantized."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[type_name]
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    if cols % block_values:
        raise ValueError(f"a {type_name} matrix needs rows of a multiple of {block_values} "
                         f"values, got {cols}")
    blocks = torch.from_numpy(data.reshape(-1, block_bytes))  # (no copy)
    if type_name == "Q8_0":
        scale = _f16(blocks[:, :2])
        codes = blocks[:, 2:].contiguous().view(torch.int8).to(torch.int16)
        offset = torch.zeros_like(scale)
    elif type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        # _0: a scale, codes centred on zero; _1: a scale and an offset (the group min).
        centred = type_name.endswith("_0")
        head = 2 if centred else 4
        scale = _f16(blocks[:, :2])
        if type_name.startswith("Q4"):
            codes = _nibbles(blocks[:, head:]).to(torch.int16)
        else:  # a fifth bit per value, packed in 4 bytes before the nibbles
            high = _high_bits(blocks[:, head:head + 4], 32)
            codes = (_nibbles(blocks[:, head + 4:]) | (high << 4)).to(torch.int16)
        if centred:
            codes -= 8 if type_name == "Q4_0" else 16
            offset = torch.zeros_like(scale)
        else:
            offset = _f16(blocks[:, 2:4])
    elif type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, mins = _k_scales(blocks[:, 4:16])
        scale = (d[:, None] * sc.float()).reshape(-1)
        offset = -(dmin[:, None] * mins.float()).reshape(-1)
        if type_name == "Q4_K":
            codes = _k_low_bits(blocks[:, 16:144])
        else:
            high = blocks[:, 16:48].reshape(-1, 1, 32) >> \
                torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
            codes = _k_low_bits(blocks[:, 48:176]) | ((high & 1) << 4)
        codes = codes.to(torch.int16)
    else:
        raise ValueError(f"GGUF type {type_name} is not group-quantized in groups of {GROUP}")
    return GroupQuantized(codes.reshape(rows, cols), scale.reshape(rows, cols // GROUP),
                          offset.reshape(rows, cols // GROUP))


# ------------------------------------------------------------------ the model's side
def use_int4_where_quantized(model: nn.Module, weights: GGUFWeights) -> list[str]:
    """Give each linear layer (and the LM head) whose every checkpoint tensor is
    group-quantized an int4 weight (before loading); returns the names of the layers
    that stay dense, with the reason."""
    from spindle.layers.embedding import ParallelLMHead
    from spindle.layers.linear import _ParallelLinearBase

    sources: dict[str, list[str]] = {}
    for hf_name in weights.tensors:
        if not hf_name.endswith(".weight"):
            continue
        param, _ = model.param_name(hf_name)
        sources.setdefault(param.rpartition(".")[0], []).append(hf_name)
    head = getattr(model, "lm_head", None)
    if head is not None and head.tied and "model.embed_tokens.weight" in weights.tensors:
        sources[_module_name(model, head)] = ["model.embed_tokens.weight"]
    dense = []
    for name, module in model.named_modules():
        if not isinstance(module, (_ParallelLinearBase, ParallelLMHead)) or name not in sources:
            continue
        kinds = sorted({weights.type_of(n) for n in sources[name]
                        if not weights.is_group_quantized(n)})
        rows, cols = module.weight.shape
        if kinds:
            dense.append(f"{name} ({', '.join(kinds)})")
        elif rows % ROW_MULTIPLE or cols % GROUP:
            dense.append(f"{name} (rank-local shape [{rows}, {cols}] is not a multiple of "
                         f"[{ROW_MULTIPLE}, {GROUP}])")
        else:
            module.use_int4_weight()
    return dense


def _module_name(model: nn.Module, target: nn.Module) -> str:
    return next(name for name, module in model.named_modules() if module is target)
