"""Llama-family decoder models: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM, Phi3ForCausalLM.

They share one implementation; they differ only in attention details, captured by
AttentionOptions, and in which layers attend within a sliding window (sliding_windows):

* Llama: q/k/v/o bias = config.attention_bias (False in practice); no window;
* Mistral: no bias; every layer has the window config.sliding_window (null: none);
* Qwen2: q/k/v bias always, o_proj without;
* Qwen3: bias = config.attention_bias, plus a per-head RMSNorm on q and k (q_norm,
  k_norm) applied before the rotary embedding; head_dim is explicit in the config.
* Phi-3: as Mistral (no bias; config.sliding_window on every layer), its checkpoints
  holding q/k/v as one qkv_proj and gate/up as one gate_up_proj tensor;
* Qwen2 and Qwen3: the layers config.layer_types names "sliding_attention" have the
  window config.sliding_window, which transformers sets to null unless
  use_sliding_window; without layer_types, layers from max_window_layers on slide.

Tokens of all requests of a step arrive flattened ([T] ids, [T] positions); attention
finds how they split into requests in the forward context (see spindle.attention).
Parameters use merged tensor-parallel layers (qkv_proj, gate_up_proj); load_weights
maps HF checkpoint names onto them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from spindle.attention import Attention
from spindle.attention.backends.torch_sdpa import TorchSDPABackend
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import IntermediateTensors, PipelineStage
from spindle.forward_context import current_lora, get_forward_context
from spindle.layers import cpu_kernels
from spindle.layers.activation import SiluAndMul
from spindle.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                   RowParallelLinear, default_weight_loader, set_weight_loader)
from spindle.layers.norm import Float32WeightRMSNorm, RMSNorm, fp32_residual_stream
from spindle.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters_from_config
from spindle.models.causal_lm import (DecoderForCausalLM, MissingLayer, embedded, stage_embedding,
                                      stage_layers)


@dataclass(frozen=True)
class AttentionOptions:
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    scale: float | None = None  # None: head_dim ** -0.5
    logits_soft_cap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    qk_norm_class: type = RMSNorm  # the per-head q/k norm (Gemma 3: GemmaRMSNorm)
    sinks: bool = False  # a learned logit per head in each softmax (gpt-oss's "sinks")
    # (beta, length, offset): queries times 1 + beta * log(1 + floor((position + offset)
    # / length)) (Llama 4's attention temperature: offset 1; Ministral 3's: 0); None:
    # no scaling.
    query_scaling: tuple[float, int, int] | None = None


def require_activation(hf_config: Any, expected: str, default: str | None = None) -> None:
    """Refuse a config whose hidden_act (default: expected) is not the one this model
    implements."""
    act = getattr(hf_config, "hidden_act", default or expected)
    if act != expected:
        raise ValueError(f"hidden_act {act!r} is not supported (only {expected!r})")


def check_activation(hf_config: Any, field: str, known: Any,
                     default: str | None = None) -> None:
    """Refuse a config whose activation (the field named, default where absent) is not
    one of known."""
    value = getattr(hf_config, field, default)
    if value not in known:
        raise ValueError(f"{field} {value!r} is not supported (known: {sorted(known)})")


def head_dim_of(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def check_supported_config(hf_config: Any) -> None:
    """Reject config features this implementation would silently get wrong."""
    require_activation(hf_config, "silu")


def checked_window(window: Any) -> int | None:
    """config.sliding_window as a layer's window: a positive integer, or None."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"config sliding_window must be a positive integer or null, "
                         f"got {window!r}")
    return window


def qwen_sliding_windows(hf_config: Any) -> list[int | None]:
    """Per-layer windows of a Qwen2/Qwen3 config, as transformers 5.17 derives them:
    Qwen2Config/Qwen3Config set sliding_window to None unless use_sliding_window, and
    default layer_types to "sliding_attention" for layers i >= max_window_layers when a
    window is left (else "full_attention"); Qwen2Attention then uses sliding_window on
    its layer iff layer_types[i] == "sliding_attention"."""
    num_layers = hf_config.num_hidden_layers
    use_window = bool(getattr(hf_config, "use_sliding_window", False))
    window = checked_window(getattr(hf_config, "sliding_window", None)) if use_window else None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        first_sliding = getattr(hf_config, "max_window_layers", num_layers)
        layer_types = ["sliding_attention" if window is not None and i >= first_sliding
                       else "full_attention" for i in range(num_layers)]
    return windows_by_layer_type(layer_types, window, num_layers)


def windows_by_layer_type(layer_types: list[str], window: int | None,
                          num_layers: int) -> list[int | None]:
    """window on the layers layer_types names "sliding_attention", None on the
    "full_attention" ones; anything else is refused by name."""
    if len(layer_types) != num_layers:
        raise ValueError(f"config layer_types has {len(layer_types)} entries for "
                         f"{num_layers} layers")
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"config layer_types {unknown} are not supported (only "
                         "'full_attention' and 'sliding_attention')")
    if "sliding_attention" in layer_types and window is None:
        raise ValueError("config layer_types names sliding_attention layers but there is no "
                         "window (sliding_window is null or use_sliding_window is false)")
    return [window if kind == "sliding_attention" else None for kind in layer_types]


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=bias, tp_group=tp_group)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias,
                                           tp_group=tp_group)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, defer_merge: bool = False):
        """defer_merge: an RMSNorm reads the output next, so it may be the down
        projection's unsummed split-K partials (RowParallelLinear.forward)."""
        gate_up = self.gate_up_proj(x)
        fused = self.down_proj.silu_and_mul_forward(gate_up, defer_merge)  # (CUDA decode)
        return fused if fused is not None else self.down_proj(self.act_fn(gate_up),
                                                              defer_merge)


def head_sinks(num_heads: int, tp_group: TensorParallelGroup) -> nn.Parameter:
    """Attention sinks of this rank's num_heads heads: a float32 logit each (checkpoint
    name ``sinks``, split with the heads under tensor parallelism)."""
    from spindle.layers.mamba.mixer import rows_loader

    param = nn.Parameter(torch.empty(num_heads, dtype=torch.float32), requires_grad=False)
    set_weight_loader(param, rows_loader([(tp_group.rank * num_heads, num_heads)]))
    return param


class LlamaAttention(nn.Module):
    def __init__(self, hf_config: Any, options: AttentionOptions,
                 tp_group: TensorParallelGroup, sliding_window: int | None = None,
                 rotate: bool = True, attention_chunk_size: int | None = None) -> None:
        """rotate: False for a layer without positions (SmolLM3's NoPE layers).
        attention_chunk_size: chunked local attention (Llama 4's; attention/chunked.py)."""
        super().__init__()
        hidden_size = hf_config.hidden_size
        self.head_dim = head_dim_of(hf_config)
        if not rotate and options.qk_norm:
            raise ValueError("attention without rotary but with q/k norms is not supported")
        self.rotate = rotate
        self.qkv_proj = QKVParallelLinear(
            hidden_size, self.head_dim, hf_config.num_attention_heads,
            hf_config.num_key_value_heads, bias=options.qkv_bias, tp_group=tp_group)
        self.num_heads = self.qkv_proj.num_heads  # rank-local
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(hf_config.num_attention_heads * self.head_dim,
                                        hidden_size, bias=options.o_bias, tp_group=tp_group)
        if options.qk_norm:
            self.q_norm = options.qk_norm_class(self.head_dim, eps=hf_config.rms_norm_eps)
            self.k_norm = options.qk_norm_class(self.head_dim, eps=hf_config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.query_scaling = options.query_scaling
        scale = options.scale if options.scale is not None else self.head_dim ** -0.5
        self.sinks = self._sinks(tp_group) if options.sinks else None
        self.attn = Attention(self.num_heads, self.head_dim, scale, self.num_kv_heads,
                              sliding_window=sliding_window,
                              logits_soft_cap=options.logits_soft_cap, sinks=self.sinks,
                              attention_chunk_size=attention_chunk_size)

    def _sinks(self, tp_group: TensorParallelGroup) -> nn.Parameter:
        return head_sinks(self.num_heads, tp_group)

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor,
                cos: torch.Tensor | None, sin: torch.Tensor | None,
                defer_merge: bool = False):
        """cos/sin None: the fused path (CUDA, and bf16 on the CPU). The q/k norms and
        the rotary embedding (reading the tables, rope_tables, by position) are handed
        to the attention layer unapplied, so its backend can fuse them with the KV
        store (and, on CUDA decode steps, with attention itself). defer_merge: as
        LlamaMLP.forward's, for o_proj."""
        qkv = self.qkv_proj(hidden_states)
        q, k, v = self.qkv_proj.split_qkv(qkv)
        if self.query_scaling is not None:  # (a scalar a token: before or after the rotation)
            q = q * self._query_scales(positions, q.dtype)
            qkv = None  # (q is not the projection's view any more)
        if not self.rotate and self.q_norm is None:
            out = self.attn(q, k, v)
        elif cos is None:
            out = self.attn(q, k, v, qk_transform=self._qk_norm_rope(positions))
        else:
            num_tokens = hidden_states.shape[0]
            if self.q_norm is None and qkv is not None:  # q and k side by side: one rotation
                heads = self.num_heads + self.num_kv_heads
                qk = qkv[:, :heads * self.head_dim].view(num_tokens, heads, self.head_dim)
                qk = apply_rotary(qk, cos, sin)
                q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
            else:
                q = q.reshape(num_tokens, self.num_heads, self.head_dim)
                k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
                if self.q_norm is not None:
                    q, k = self.q_norm(q), self.k_norm(k)
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v)
        return self.o_proj(out, defer_merge)

    def _query_scales(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[T, 1]: 1 + beta * log(1 + floor((position + offset) / length))."""
        beta, length, offset = self.query_scaling
        scales = 1 + beta * torch.log1p(torch.floor((positions.to(torch.float32) + offset)
                                                    / length))
        return scales.to(dtype)[:, None]

    def _qk_norm_rope(self, positions: torch.Tensor):
        """This layer's q/k norms and rotary embedding, as a rotary.QKNormRope."""
        from spindle.layers.rotary import QKNormRope

        norm = self.q_norm is not None
        return QKNormRope(positions, *self.rope_tables,
                          self.q_norm.weight if norm else None,
                          self.k_norm.weight if norm else None,
                          self.q_norm.variance_epsilon if norm else 0.0)


def dense_mlp(hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup) -> nn.Module:
    """The feed-forward block of a dense Llama-family layer (every layer alike)."""
    return LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size,
                    getattr(hf_config, "mlp_bias", False), tp_group)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, options: AttentionOptions,
                 tp_group: TensorParallelGroup, sliding_window: int | None = None,
                 mlp: nn.Module | None = None, rotate: bool = True,
                 norm_class: type[RMSNorm] = RMSNorm,
                 attention_chunk_size: int | None = None) -> None:
        """mlp: the feed-forward block (default: the dense SwiGLU MLP; a mixture of
        experts in the MoE models). rotate, attention_chunk_size: as LlamaAttention's.
        norm_class: the two norms' (Llama's numerics, or an UnfusedRMSNorm's: Helium's)."""
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.self_attn = LlamaAttention(hf_config, options, tp_group, sliding_window, rotate,
                                        attention_chunk_size)
        self.mlp = mlp if mlp is not None else dense_mlp(hf_config, 0, tp_group)
        self.input_layernorm = norm_class(hf_config.hidden_size, eps=eps)
        self.post_attention_layernorm = norm_class(hf_config.hidden_size, eps=eps)
        # Only the fused norm kernels read a skinny GEMM's unsummed partials.
        self.defer_merge = norm_class.fused

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                positions: torch.Tensor, cos: torch.Tensor | None,
                sin: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block with the residual stream carried separately: returns the MLP
        output and the residual it must be added to (the next norm does the add). On a
        CUDA decode step the MLP output may be the down projection's unsummed split-K
        partials (skinny_gemm.SplitKPartials), which that norm sums: o_proj's and
        down_proj's GEMMs then end without a merge of their own."""
        if (cos is None and isinstance(hidden_states, torch.Tensor)  # (not partials)
                and not hidden_states.is_cuda):  # (bf16 on the CPU)
            fused = self.cpu_decode(hidden_states, residual, positions)
            if fused is not None:
                return fused
        # With the fused norms, a one-request CUDA step leaves each norm to the linear
        # layer after it (norm.RMSNorm.deferred): qkv_proj and gate_up_proj read the
        # normalized rows, and only they.
        dense_mlp = isinstance(self.mlp, LlamaMLP)
        hidden_states, residual = self.input_layernorm.pre_norm(hidden_states, residual,
                                                                defer=self.defer_merge)
        hidden_states = self.self_attn(hidden_states, positions, cos, sin,
                                       defer_merge=self.defer_merge)
        hidden_states, residual = self.post_attention_layernorm(
            hidden_states, residual, defer=self.defer_merge and dense_mlp)
        if dense_mlp:
            return self.mlp(hidden_states, defer_merge=self.defer_merge), residual
        return self.mlp(hidden_states), residual

    def cpu_decode(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This layer on a decode step as one C++ call (cpu_kernels.decode_layer: the
        modules' own operations, without some forty Python-level calls, which cost as
        much as the layer's math on a small model), or None where that does not apply:
        a prefill or mixed step, tensor parallelism, another attention backend, a
        mixture of experts, weights other than int4 or dense bf16, a step with LoRA
        adapters."""
        layer = self.self_attn.attn
        cache = layer.kv_cache
        if (cache is None or type(layer.impl) is not TorchSDPABackend
                or current_lora() is not None):
            return None
        md = get_forward_context().for_group(layer.cache_group)
        plan = layer.impl.step_plan(md, cache.shape[2])
        if not plan.decode_only:
            return None
        static = self._cpu_decode_args(cache, hidden_states.dtype)
        if static is None:
            return None
        weights, geometry = static
        out, residual = cpu_kernels.kernels().decode_layer(
            hidden_states, residual, *weights, positions, *self.self_attn.rope_tables, cache,
            plan.store_slots, md.block_tables, md.seq_lens, *geometry)
        return out, residual

    def _cpu_decode_args(self, cache: torch.Tensor, dtype: torch.dtype) -> tuple | None:
        """decode_layer's arguments that stay the same from step to step (tensors written
        in place by reloads and weight updates), or None if this layer cannot run
        there. Made once, and again if the qkv weight or the cache tensor is replaced."""
        attn = self.self_attn
        weight = attn.qkv_proj._parameters["weight"]
        cached = self.__dict__.get("_cpu_decode_cache")  # (weak: a replaced cache is freed)
        if cached is not None and cached[0]() is weight and cached[1]() is cache:
            return cached[2]
        static = None
        linears = [cpu_kernels.linear_args(m) for m in (attn.qkv_proj, attn.o_proj,
                                                         self.mlp.gate_up_proj,
                                                         self.mlp.down_proj)] \
            if isinstance(self.mlp, LlamaMLP) else [None]
        if (cache.dtype == dtype and attn.o_proj.tp_group.size == 1 and attn.rotate
                and attn.query_scaling is None and self.input_layernorm.fused
                and attn.attn.attention_chunk_size is None
                and all(args is not None for args in linears)):
            layer, q_norm = attn.attn, attn.q_norm
            weights = (self.input_layernorm.weight, self.post_attention_layernorm.weight,
                       self.input_layernorm.variance_epsilon, *linears,
                       None if q_norm is None else q_norm.weight,
                       None if q_norm is None else attn.k_norm.weight,
                       0.0 if q_norm is None else q_norm.variance_epsilon)
            geometry = (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scale,
                        layer.sliding_window or 0, layer.logits_soft_cap or 0.0)
            static = (weights, geometry)
        self.__dict__["_cpu_decode_cache"] = (weakref.ref(weight), weakref.ref(cache), static)
        return static


class LlamaModel(nn.Module):
    def __init__(self, hf_config: Any,
                 options: AttentionOptions | Callable[[int], AttentionOptions],
                 tp_group: TensorParallelGroup, stage: PipelineStage | None = None,
                 sliding_windows: list[int | None] | None = None,
                 mlp_for_layer=dense_mlp, rotary_layers: list[bool] | None = None,
                 norm_class: type[RMSNorm] = RMSNorm,
                 attention_chunks: list[int | None] | None = None) -> None:
        """options: the attention's, or each layer's (options(i)). sliding_windows: each
        layer's window (None: full attention; default all). mlp_for_layer(hf_config,
        layer_idx, tp_group): each layer's feed-forward block. rotary_layers: whether
        each layer rotates q and k (default: all). norm_class: every RMSNorm's
        (LlamaDecoderLayer's). attention_chunks: each layer's attention chunk size (None:
        not chunked; default none)."""
        super().__init__()
        windows = sliding_windows or [None] * hf_config.num_hidden_layers
        rotates = rotary_layers or [True] * hf_config.num_hidden_layers
        chunks = attention_chunks or [None] * hf_config.num_hidden_layers
        options_of = options if callable(options) else (lambda i: options)
        self.stage = stage = stage or PipelineStage.single()
        # A pipeline stage builds only what it runs.
        self.embed_tokens = stage_embedding(hf_config, stage, tp_group)
        self.layers = stage_layers(stage, hf_config.num_hidden_layers, lambda i: LlamaDecoderLayer(
            hf_config, options_of(i), tp_group, windows[i], mlp_for_layer(hf_config, i, tp_group),
            rotates[i], norm_class, chunks[i]))
        self.norm = norm_class(hf_config.hidden_size, eps=hf_config.rms_norm_eps) \
            if stage.is_last else None
        self.rotary_emb = RotaryEmbedding.from_config(hf_config, head_dim_of(hf_config))
        for layer in self.own_layers():  # plain tensor references, not submodules
            layer.self_attn.rope_tables = (self.rotary_emb.cos_cache, self.rotary_emb.sin_cache)

    def own_layers(self) -> list["LlamaDecoderLayer"]:
        return [layer for layer in self.layers if not isinstance(layer, MissingLayer)]

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                intermediate_tensors: IntermediateTensors | None = None,
                ) -> torch.Tensor | IntermediateTensors:
        """-> final-normed hidden states on the last stage; on any other stage the
        hidden states and residual for the next one."""
        if self.stage.is_first:
            hidden_states = embedded(self.embed_tokens, input_ids, inputs_embeds)
            residual = None
            if self.stage.size == 1 and fp32_residual_stream(hidden_states):
                # (the first norm adds zeros: the stream starts as the embeddings, exactly)
                residual = torch.zeros(hidden_states.shape, dtype=torch.float32)
        else:
            if intermediate_tensors is None:
                raise ValueError(f"pipeline stage {self.stage.rank} needs the previous "
                                 "stage's intermediate_tensors")
            hidden_states = intermediate_tensors.hidden_states
            residual = intermediate_tensors.residual
        if hidden_states.is_cuda or cpu_kernels.applies(hidden_states):
            cos = sin = None  # the fused kernels read the tables themselves
        else:
            cos, sin = self.rotary_emb(positions, hidden_states.dtype)  # shared by all layers
        for layer in self.own_layers():
            hidden_states, residual = layer(hidden_states, residual, positions, cos, sin)
        if not self.stage.is_last:
            from spindle.layers.skinny_gemm import merged

            return IntermediateTensors(merged(hidden_states), residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


# HF checkpoint projection name -> (merged parameter name, shard id).
_STACKED_PARAMS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _to_param_name(hf_name: str) -> tuple[str, Any]:
    """model.layers.0.self_attn.q_proj.weight -> (model.layers.0.self_attn.qkv_proj.weight, "q")."""
    parts = hf_name.split(".")
    if len(parts) >= 2 and parts[-2] in _STACKED_PARAMS:
        merged, shard_id = _STACKED_PARAMS[parts[-2]]
        return ".".join(parts[:-2] + [merged, parts[-1]]), shard_id
    return hf_name, None


def ungated_param_name(hf_name: str) -> tuple[str, Any]:
    """_to_param_name for a model whose MLP has no gate: its up_proj is a parameter of
    its own, not a shard of gate_up_proj (Arcee, Apertus, Jais 2)."""
    if ".mlp.up_proj." in hf_name:
        return hf_name, None
    return _to_param_name(hf_name)


class LlamaForCausalLM(DecoderForCausalLM):
    supports_pipeline_parallel = True
    # Every RMSNorm's class (Helium's multiplies its weight in float32).
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.check_config(hf_config)
        self.config = hf_config
        self.tp_group = tp_group
        self.stage = stage or PipelineStage.single()
        self.model = LlamaModel(hf_config, self.attention_options(hf_config), tp_group,
                                self.stage, self.sliding_windows(hf_config), self.mlp_for_layer,
                                self.rotary_layers(hf_config), self.norm_class,
                                self.attention_chunks(hf_config))
        self.build_lm_head(hf_config, tp_group)

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        """Refuse config features this model would get wrong (an activation but SiLU)."""
        check_supported_config(hf_config)

    @classmethod
    def rotary_layers(cls, hf_config: Any) -> list[bool] | None:
        """Whether each layer rotates q and k (None: every layer does)."""
        return None

    @classmethod
    def attention_chunks(cls, hf_config: Any) -> list[int | None] | None:
        """Each layer's attention chunk size (None: no layer attends in chunks)."""
        return None

    @classmethod
    def attention_options(cls, hf_config: Any) -> AttentionOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=False)

    @classmethod
    def mlp_for_layer(cls, hf_config: Any, layer_idx: int,
                      tp_group: TensorParallelGroup) -> nn.Module:
        """Layer layer_idx's feed-forward block (the MoE models override it)."""
        return dense_mlp(hf_config, layer_idx, tp_group)

    @classmethod
    def sliding_windows(cls, hf_config: Any) -> list[int | None]:
        """Each layer's sliding window (None: full attention). transformers' Llama has
        none (its attention ignores sliding-window config fields)."""
        return [None] * hf_config.num_hidden_layers


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3: Llama's layers, every no_rope_layer_interval-th without rotary (NoPE:
    ``no_rope_layers[i] == 0``), windows where use_sliding_window and layer_types say."""

    @classmethod
    def rotary_layers(cls, hf_config: Any) -> list[bool]:
        flags = getattr(hf_config, "no_rope_layers", None)
        if flags is None:
            interval = getattr(hf_config, "no_rope_layer_interval", 4)
            flags = [int((i + 1) % interval != 0) for i in range(hf_config.num_hidden_layers)]
        if len(flags) != hf_config.num_hidden_layers:
            raise ValueError(f"no_rope_layers has {len(flags)} entries for "
                             f"{hf_config.num_hidden_layers} layers")
        return [bool(flag) for flag in flags]

    @classmethod
    def sliding_windows(cls, hf_config: Any) -> list[int | None]:
        num_layers = hf_config.num_hidden_layers
        if not getattr(hf_config, "use_sliding_window", False):
            return [None] * num_layers
        window = checked_window(getattr(hf_config, "sliding_window", None))
        return windows_by_layer_type(list(hf_config.layer_types), window, num_layers)


class InternLM3ForCausalLM(LlamaForCausalLM):
    """Shanghai AI Lab's InternLM3: Llama itself (transformers serves it with its Llama
    model; ``qkv_bias`` and ``bias`` are attention_bias and mlp_bias)."""


class SeedOssForCausalLM(LlamaForCausalLM):
    """ByteDance's Seed-OSS: Llama's layers, q/k/v biases (attention_bias) apart from
    o_proj's (attention_out_bias)."""

    @classmethod
    def attention_options(cls, hf_config: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
                                o_bias=bool(getattr(hf_config, "attention_out_bias", False)),
                                qk_norm=False)


class ArceeForCausalLM(LlamaForCausalLM):
    """Arcee's AFM: Llama's layers with an MLP of two projections, down(relu(up(x))^2)
    (NemotronH's), mlp_bias on both."""

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        require_activation(hf_config, "relu2")

    @classmethod
    def mlp_for_layer(cls, hf_config: Any, layer_idx: int,
                      tp_group: TensorParallelGroup) -> nn.Module:
        from spindle.models.nemotron_h import NemotronHMLP

        return NemotronHMLP(hf_config, tp_group)

    @classmethod
    def param_name(cls, hf_name: str) -> tuple[str, Any]:
        return ungated_param_name(hf_name)


class XIELU(nn.Module):
    """xIELU (Apertus's activation): alpha_p * x^2 + beta * x for x > 0, else
    alpha_n * (expm1(min(x, eps)) - x) + beta * x, with alpha_p = softplus(a_p) and
    alpha_n = beta + softplus(a_n) from the learned a_p, a_n (checkpoint ``alpha_p``,
    ``alpha_n``, one each); beta and eps are constants the checkpoint may carry too."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.empty(1), requires_grad=False)
        self.alpha_n = nn.Parameter(torch.empty(1), requires_grad=False)
        for param in (self.alpha_p, self.alpha_n):
            set_weight_loader(param, default_weight_loader)
        self.register_buffer("beta", torch.tensor(0.5), persistent=False)
        self.register_buffer("eps", torch.tensor(-1e-6), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = torch.nn.functional.softplus(self.alpha_p).to(x.dtype)
        beta = self.beta.to(x.dtype)
        alpha_n = beta + torch.nn.functional.softplus(self.alpha_n).to(x.dtype)
        negative = (torch.expm1(torch.minimum(x, self.eps.to(x.dtype))) - x) * alpha_n
        return torch.where(x > 0, alpha_p * x * x + beta * x, negative + beta * x)


class ApertusMLP(nn.Module):
    """down(xIELU(up(x))): two projections, no gate."""

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        from spindle.layers.linear import ColumnParallelLinear

        super().__init__()
        bias = bool(getattr(hf_config, "mlp_bias", False))
        self.up_proj = ColumnParallelLinear(hf_config.hidden_size, hf_config.intermediate_size,
                                            bias=bias, tp_group=tp_group)
        self.down_proj = RowParallelLinear(hf_config.intermediate_size, hf_config.hidden_size,
                                           bias=bias, tp_group=tp_group)
        self.act_fn = XIELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


class ApertusForCausalLM(LlamaForCausalLM):
    """Swiss AI's Apertus: Llama's layers with per-head q/k norms (before the rotation,
    Qwen3's), an xIELU MLP without a gate, and the norms named attention_layernorm /
    feedforward_layernorm."""

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        require_activation(hf_config, "xielu")

    @classmethod
    def attention_options(cls, hf_config: Any) -> AttentionOptions:
        from dataclasses import replace

        return replace(super().attention_options(hf_config), qk_norm=True)

    @classmethod
    def mlp_for_layer(cls, hf_config: Any, layer_idx: int,
                      tp_group: TensorParallelGroup) -> nn.Module:
        return ApertusMLP(hf_config, tp_group)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._constants_kept(weights))

    def _constants_kept(self, weights: Iterable[tuple[str, torch.Tensor]]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """xIELU's beta and eps, where the checkpoint carries them, into the buffers."""
        buffers = dict(self.named_buffers())
        for name, tensor in weights:
            if name.endswith((".act_fn.beta", ".act_fn.eps")):
                if name in buffers:
                    buffers[name].copy_(tensor.reshape(()))
                continue
            yield name, tensor

    @classmethod
    def param_name(cls, hf_name: str) -> tuple[str, Any]:
        hf_name = hf_name.replace(".attention_layernorm.", ".input_layernorm.")
        hf_name = hf_name.replace(".feedforward_layernorm.", ".post_attention_layernorm.")
        return ungated_param_name(hf_name)


class InterleavedRotaryRows:
    """A Llama-family model whose rotary turns interleaved pairs (features 2i, 2i + 1):
    each q/k head's rows are permuted at load (rotary.interleaved_rows_as_halves), so
    that Llama's rotation of the two halves computes the same."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from spindle.layers.rotary import interleaved_rows_as_halves
        from spindle.models.cohere import QK_TENSORS

        head_dim = head_dim_of(self.config)
        return super().load_weights(
            (name, interleaved_rows_as_halves(t, head_dim) if name.endswith(QK_TENSORS) else t)
            for name, t in weights)


class Ernie4_5ForCausalLM(InterleavedRotaryRows, LlamaForCausalLM):
    """Baidu's ERNIE 4.5 (dense): Llama's layers with biases everywhere or nowhere
    (use_bias), rotating interleaved pairs (InterleavedRotaryRows)."""

    @classmethod
    def attention_options(cls, hf_config: Any) -> AttentionOptions:
        bias = bool(getattr(hf_config, "use_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=False)

    @classmethod
    def mlp_for_layer(cls, hf_config: Any, layer_idx: int,
                      tp_group: TensorParallelGroup) -> nn.Module:
        return LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size,
                        bool(getattr(hf_config, "use_bias", False)), tp_group)


class HeliumForCausalLM(InterleavedRotaryRows, LlamaForCausalLM):
    """Kyutai's Helium 1 (2B): Llama's layers rotating interleaved pairs
    (InterleavedRotaryRows), RMSNorms that multiply their weight in float32
    (Float32WeightRMSNorm: the same as Llama's in float32, one rounding fewer in bf16),
    q/k/v biases where attention_bias says and none on o_proj."""

    norm_class = Float32WeightRMSNorm

    @classmethod
    def attention_options(cls, hf_config: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
                                o_bias=False, qk_norm=False)


# EXAONE 3's tensor names (prefix or infix) and Llama's, in the order transformers
# applies them.
_EXAONE_NAMES = (("transformer.wte.", "model.embed_tokens."), ("transformer.h.", "model.layers."),
                 ("transformer.ln_f.", "model.norm."), (".attn.attention.", ".self_attn."),
                 (".self_attn.out_proj.", ".self_attn.o_proj."),
                 (".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."),
                 (".mlp.c_fc_0.", ".mlp.gate_proj."), (".mlp.c_fc_1.", ".mlp.up_proj."),
                 (".mlp.c_proj.", ".mlp.down_proj."))


class ExaoneForCausalLM(LlamaForCausalLM):
    """LG AI's EXAONE 3.0 / 3.5: Llama's layers under GPT-2-style tensor names
    (``transformer.h.*.attn.attention.*``, ``mlp.c_fc_0`` / ``c_fc_1`` / ``c_proj``),
    renamed at load; checkpoints already in Llama's names load as they are."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((_exaone_to_llama(name), t) for name, t in weights)


def _exaone_to_llama(name: str) -> str:
    for theirs, ours in _EXAONE_NAMES:
        if theirs.startswith("transformer."):
            if name.startswith(theirs):
                name = ours + name[len(theirs):]
        else:
            name = name.replace(theirs, ours)
    return name


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, hf_config: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=False, o_bias=False, qk_norm=False)

    @classmethod
    def sliding_windows(cls, hf_config: Any) -> list[int | None]:
        """transformers' Mistral: config.sliding_window (null: none) on every layer (it
        ignores layer_types; Ministral is the architecture that alternates)."""
        window = checked_window(getattr(hf_config, "sliding_window", None))
        return [window] * hf_config.num_hidden_layers


class Ministral3ForCausalLM(MistralForCausalLM):
    """Ministral 3: Mistral's layers with each query scaled by its position, 1 + beta *
    log(1 + floor(position / original_max_position_embeddings)) (rope_parameters'
    llama_4_scaling_beta; Llama 4's attention temperature), and YaRN."""

    @classmethod
    def attention_options(cls, hf_config: Any) -> AttentionOptions:
        from dataclasses import replace

        params = rope_parameters_from_config(hf_config)
        beta = params.get("llama_4_scaling_beta")
        scaling = None
        if beta:
            scaling = (float(beta), int(params["original_max_position_embeddings"]), 0)
        return replace(super().attention_options(hf_config), query_scaling=scaling)


class MinistralForCausalLM(MistralForCausalLM):
    """Ministral (8B): Mistral's layers, the window on the layers layer_types calls
    sliding (transformers' Ministral alternates them; its default: every layer)."""

    @classmethod
    def sliding_windows(cls, hf_config: Any) -> list[int | None]:
        window = checked_window(getattr(hf_config, "sliding_window", None))
        num_layers = hf_config.num_hidden_layers
        kinds = getattr(hf_config, "layer_types", None) or [
            "sliding_attention" if window is not None else "full_attention"] * num_layers
        return windows_by_layer_type(list(kinds), window, num_layers)


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, hf_config: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False, qk_norm=False)

    @classmethod
    def sliding_windows(cls, hf_config: Any) -> list[int | None]:
        return qwen_sliding_windows(hf_config)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, hf_config: Any) -> AttentionOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)

    @classmethod
    def sliding_windows(cls, hf_config: Any) -> list[int | None]:
        return qwen_sliding_windows(hf_config)


class Phi3ForCausalLM(MistralForCausalLM):
    """Mistral's layers; the checkpoint's fused qkv_proj and gate_up_proj tensors are
    split into the q/k/v and gate/up shards the merged layers load (so tensor
    parallelism shards each part on its own). A rotary over part of each head
    (``partial_rotary_factor``: Phi-4-mini's 0.75, with LongRoPE) takes the same layers
    with the rotation in torch (phi3_partial.py): Llama's fused kernels turn whole
    heads. That form runs in one pipeline stage."""

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        from spindle.models.phi3_partial import phi3_partial_model, rotates_part_of_each_head

        if not rotates_part_of_each_head(hf_config):
            super().__init__(hf_config, tp_group, stage)
            return
        DecoderForCausalLM.__init__(self)
        self.check_config(hf_config)
        windows = self.sliding_windows(hf_config)
        self.build_single_stage(hf_config, tp_group, stage,
                                lambda config, group: phi3_partial_model(config, group, windows))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterable[tuple[str, torch.Tensor]]:
        config = self.config
        head_dim = head_dim_of(config)
        q_size = config.num_attention_heads * head_dim
        kv_size = config.num_key_value_heads * head_dim
        for name, tensor in weights:
            if name.endswith(".self_attn.qkv_proj.weight"):
                parts = tensor.split([q_size, kv_size, kv_size], dim=0)
                for part, tensor_part in zip(("q_proj", "k_proj", "v_proj"), parts):
                    yield name.replace(".qkv_proj.", f".{part}."), tensor_part
            elif name.endswith(".mlp.gate_up_proj.weight"):
                gate, up = tensor.chunk(2, dim=0)
                yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                yield name.replace(".gate_up_proj.", ".up_proj."), up
            else:
                yield name, tensor
