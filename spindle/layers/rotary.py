"""Rotary position embedding, numerically identical to HF Llama/Qwen.

Neox style: the head dim is split in two halves that rotate together
(``x * cos + rotate_half(x) * sin``, computed as apply_rotary says). The cos/sin
table is computed once in float32 exactly as HF computes it on the fly (inv_freq *
position, then duplicated), and cast to the activation dtype at use, like HF does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_DEFAULT_THETA = 10000.0


def rope_parameters_from_config(hf_config: Any) -> dict[str, Any]:
    """The rope settings of an HF config as one flat dict with at least rope_type and
    rope_theta.

    transformers >= 5 keeps them in ``config.rope_parameters``; older versions in
    ``config.rope_theta`` plus an optional ``config.rope_scaling`` dict whose type key
    is ``rope_type`` (or ``type`` in older still).
    """
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        params = dict(params)
        if params and all(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"per-layer-type rope parameters ({sorted(params)}) are not supported")
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    if "rope_type" not in params:
        params["rope_type"] = params.pop("type", "default")
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or _DEFAULT_THETA
    if params["rope_type"] == "longrope" and not params.get("original_max_position_embeddings"):
        # (Phi-3's configs keep it beside the rope parameters, as transformers reads it.)
        params["original_max_position_embeddings"] = getattr(
            hf_config, "original_max_position_embeddings", None)
    return _with_context_defaults(params, hf_config.max_position_embeddings)


def longrope_original_length(hf_config: Any) -> int | None:
    """The original length of a LongRoPE config (None for any other rope, or a config
    with rope parameters per layer type). A sequence up to it rotates by the short
    factors; a longer one by the long factors, every position of it (transformers
    re-encodes a sequence once when it grows past this length; the engine does the same,
    see Scheduler)."""
    stated = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling",
                                                                    None)
    if not isinstance(stated, dict) \
            or (stated.get("rope_type") or stated.get("type")) != "longrope":
        return None
    return int(rope_parameters_from_config(hf_config)["original_max_position_embeddings"])


def long_rope_rows(model: nn.Module, original: int) -> int:
    """Where the long factors' rows start in model's LongRoPE tables, for a model served
    past the original length (`original`): the row its positions input takes for
    position p of a sequence encoded long is p + this. A ValueError if the model reads
    no such table (it rotates some other way), or tables with different offsets."""
    offsets = {m.long_rows for m in model.modules()
               if isinstance(m, RotaryEmbedding) and m.long_rows is not None}
    if len(offsets) != 1:
        raise ValueError(f"{type(model).__name__} does not rotate through one LongRoPE table "
                         f"with its long factors' rows: serve it with max_model_len <= "
                         f"{original}, LongRoPE's original length")
    return offsets.pop()


def _with_context_defaults(params: dict[str, Any], max_position: int) -> dict[str, Any]:
    """llama3 and yarn read the context the model was trained on: the config's own
    length where the parameters do not say; yarn's factor, where not given, is the
    ratio of the two lengths (DeepSeek-V3's way, as transformers reads it)."""
    if params["rope_type"] in ("llama3", "yarn", "longrope") \
            and params.get("original_max_position_embeddings") is None:
        params["original_max_position_embeddings"] = max_position
    if params["rope_type"] == "yarn" and params.get("factor") is None:
        params["factor"] = max_position / params["original_max_position_embeddings"]
    return params


def compute_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, as HF's rope init functions."""
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {params['partial_rotary_factor']} is not supported")
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, params)
    if rope_type == "linear":  # positions divided by factor (Gemma 3's global layers)
        inv_freq = inv_freq / float(params["factor"])
    if rope_type == "yarn":
        inv_freq = _yarn_scale(head_dim, base, params)
    if rope_type == "longrope":  # (the short factors; RotaryEmbedding adds the long ones)
        inv_freq = longrope_inv_freq(head_dim, params, "short_factor")
    return inv_freq


def longrope_inv_freq(head_dim: int, params: dict[str, Any], key: str) -> torch.Tensor:
    """LongRoPE's frequencies with the factors params[key] ("short_factor" or
    "long_factor"), computed as transformers computes them."""
    if params.get(key) is None:
        raise ValueError(f"longrope needs {key} (head_dim / 2 values) in its rope parameters")
    factors = torch.tensor(params[key], dtype=torch.float32)
    if factors.shape != (head_dim // 2,):
        raise ValueError(f"longrope {key} must hold head_dim / 2 = {head_dim // 2} values, "
                         f"got {factors.numel()}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (factors * float(params["rope_theta"]) ** exponents)


def attention_scaling(params: dict[str, Any], max_position: int | None = None) -> float:
    """The factor on the cos/sin table (YaRN's and LongRoPE's attention factor; 1 for the
    others). LongRoPE's default reads the stretch max_position / original length."""
    rope_type = params.get("rope_type", "default")
    if rope_type == "longrope":
        if params.get("attention_factor") is not None:
            return float(params["attention_factor"])
        original = params["original_max_position_embeddings"]
        factor = params.get("factor") or (max_position or original) / original
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    if rope_type != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor, mscale, mscale_all_dim = (params["factor"], params.get("mscale"),
                                      params.get("mscale_all_dim"))
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_scale(head_dim: int, base: float, params: dict[str, Any]) -> torch.Tensor:
    """YaRN: each frequency interpolated (divided by factor) or kept, by how many turns
    it makes over the original context, with a linear ramp between beta_slow and
    beta_fast turns (computed as transformers does, for the same float32 table)."""
    factor = float(params["factor"])
    original = params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(turns: float) -> float:
        return (head_dim * math.log(original / (turns * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # (no zero-width ramp)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def _llama3_scale(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths are slowed down by `factor`, short
    ones kept, and the band in between interpolated smoothly."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def interleaved_rows_as_halves(weight: torch.Tensor, head_dim: int,
                              rotary_dim: int | None = None) -> torch.Tensor:
    """A q or k projection's rows (weight [heads * head_dim, ...] or its bias) with each
    head's first rotary_dim (default: all) features reordered from interleaved rotary
    pairs (x0, x1), (x2, x3), ... to halves (0, 2, 4, ..., then 1, 3, 5, ...), the rest
    in place. Rotating the result the rotate-half way (apply_rotary, the fused kernels)
    gives the interleaved rotation's features in that order, for q and k alike, so every
    q . k is the same: how models that rotate interleaved pairs (Cohere, GLM-4, ERNIE
    4.5) are served by the one rotary path."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    order = torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                       torch.arange(rotary_dim, head_dim)])
    return weight.unflatten(0, (-1, head_dim))[:, order].flatten(0, 1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, num_heads, head_dim]; cos, signed_sin: [T, head_dim] in x's dtype, as
    RotaryEmbedding.forward gives them (the sine with its first half negated).

    HF's ``x * cos + rotate_half(x) * sin`` in fewer operations: rotate_half(x) * sin
    is x rolled by half a head times the signed sine, bit for bit (a negation is
    exact, so where it happens does not matter)."""
    return x * cos.unsqueeze(1) + x.roll(x.shape[-1] // 2, -1) * signed_sin.unsqueeze(1)


class RotaryEmbedding(nn.Module):
    """Holds the float32 cos/sin table for positions [0, max_position) (LongRoPE: two
    tables, the short factors' and then the long factors', see _longrope_rows).

    Call it once per forward pass with the step's positions to get (cos, sin) in the
    activation dtype, then rotate each layer's q and k with apply_rotary.
    """

    def __init__(self, head_dim: int, max_position: int, rope_parameters: dict[str, Any]) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        self.rope_parameters = dict(rope_parameters)
        inv_freq = compute_inv_freq(head_dim, rope_parameters)
        cos, sin = self._cos_sin(inv_freq, max_position)
        # LongRoPE: where the long factors' rows start (None: one table).
        self.long_rows: int | None = None
        if rope_parameters.get("rope_type") == "longrope":
            cos, sin = self._longrope_rows(cos, sin, head_dim, max_position, rope_parameters)
            self.long_rows = max_position
        scaling = attention_scaling(rope_parameters, max_position)
        if scaling != 1.0:  # (as transformers scales its cos and sin)
            cos, sin = cos * scaling, sin * scaling
        # Not persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        half = head_dim // 2
        self.register_buffer("signed_sin_cache", torch.cat((-sin[:, :half], sin[:, half:]), -1),
                             persistent=False)  # (what apply_rotary takes)

    @classmethod
    def from_config(cls, hf_config: Any, head_dim: int,
                    layer_type: str | None = None) -> "RotaryEmbedding":
        """The table of hf_config; layer_type picks one entry of rope parameters given
        per layer type (Gemma 3: "sliding_attention", "full_attention")."""
        if layer_type is None:
            params = rope_parameters_from_config(hf_config)
        else:
            params = dict(hf_config.rope_parameters[layer_type])
            params.setdefault("rope_type", params.pop("type", "default"))
            params.setdefault("rope_theta", _DEFAULT_THETA)
            params = _with_context_defaults(params, hf_config.max_position_embeddings)
        return cls(head_dim, hf_config.max_position_embeddings, params)

    @classmethod
    def _longrope_rows(cls, cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                       max_position: int, params: dict[str, Any]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """LongRoPE's two tables one after the other: rows [0, max_position) rotate by
        the short factors (the table given), rows [max_position, 2 * max_position) by the
        long ones. A sequence longer than the original length reads the long rows, at
        its position + long_rows (StepBatch.rope_positions)."""
        long_cos, long_sin = cls._cos_sin(longrope_inv_freq(head_dim, params, "long_factor"),
                                          max_position)
        return torch.cat([cos, long_cos]), torch.cat([sin, long_sin])

    @staticmethod
    def _cos_sin(inv_freq: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = inv_freq.to(torch.float32)
        positions = torch.arange(max_position, dtype=torch.int64, device=inv_freq.device)
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> (cos, signed sin), each [T, head_dim] in dtype: the two
        tables apply_rotary takes."""
        return self.cos_cache[positions].to(dtype), self.signed_sin_cache[positions].to(dtype)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, max_position={self.max_position}, "
                f"rope_type={self.rope_parameters.get('rope_type')}, "
                f"rope_theta={self.rope_parameters.get('rope_theta')}")


@dataclass(frozen=True)
class QKNormRope:
    """What a Llama-family layer does to q and k before attention: a per-head RMSNorm
    (when the weights are given), then the rotary embedding at `positions`.

    The model hands it to the attention layer unapplied, so that a backend can fuse it
    into its own kernels (the Triton decode kernel does; on the CPU the torch backend
    rotates and stores in one call); apply_ is the stand-alone version: the Triton
    kernel on CUDA, the C++ one on the CPU (layers/cpu_kernels.py)."""

    positions: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float

    def apply_(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None,
               kv_cache: torch.Tensor | None = None,
               slot_mapping: torch.Tensor | None = None) -> None:
        from spindle.layers import cpu_kernels

        if cpu_kernels.applies(q):
            qk_norm_rope_ = cpu_kernels.qk_norm_rope_
        else:  # (CUDA; on CPU tensors only the kernel tests, under Triton's interpreter)
            from spindle.layers.fused_kernels import qk_norm_rope_
        qk_norm_rope_(q, k, self.positions, self.cos_cache, self.sin_cache, self.q_weight,
                      self.k_weight, self.eps, v, kv_cache, slot_mapping)
