"""GPT2LMHeadModel (OpenAI's GPT-2 and DistilGPT2, and the many models fine-tuned from
them): learned absolute position embeddings added to the token embeddings, pre-norm
layers with LayerNorms, attention with biases and no rotary, a plain GELU MLP, a final
LayerNorm and an LM head tied to the embedding.

The checkpoint's projections are ``Conv1D``s, whose weights are stored [in, out]: they
are transposed at load, and the fused ``c_attn`` ([q | k | v] columns) is split into the
merged projection's shards. Older checkpoints name the tensors without the
``transformer.`` prefix and carry the causal mask (``attn.bias``, ``attn.masked_bias``):
both are read."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from spindle.attention.layer import Attention
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.layers.embedding import VocabParallelEmbedding
from spindle.layers.linear import QKVParallelLinear, RowParallelLinear
from spindle.models.causal_lm import DecoderForCausalLM, embedded
from spindle.models.gpt_neox import ACTIVATIONS
from spindle.models.llama import check_activation
from spindle.models.starcoder2 import Starcoder2MLP

_BUFFERS = (".attn.bias", ".attn.masked_bias")
# The Conv1D weights ([in, out] in the checkpoint) and the names they load as.
_CONV1D = {".attn.c_proj.": ".attn.o_proj.", ".mlp.c_fc.": ".mlp.c_fc.",
           ".mlp.c_proj.": ".mlp.c_proj."}


def kv_heads_of(hf_config: Any) -> int:
    """GPT-2: every head its own keys and values; GPTBigCode's ``multi_query``: one."""
    return 1 if getattr(hf_config, "multi_query", False) else hf_config.num_attention_heads


class GPT2Attention(nn.Module):
    def __init__(self, hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup,
                 bias: bool = True, o_bias: bool | None = None, scale: float | None = None,
                 sliding_window: int | None = None,
                 alibi: Callable[[int], torch.Tensor] | None = None,
                 clip_qkv: float | None = None) -> None:
        """bias: on every projection (OPT's ``enable_bias``), o_bias: on the output
        projection where it differs (GPT-Neo's); scale: the scores' (default: GPT-2's);
        sliding_window: this layer's window (GPT-Neo's local layers); alibi: the ALiBi
        slopes of all the model's heads, from their number (BLOOM's, MPT's), of which
        this rank takes its heads'; clip_qkv: q, k and v clamped to [-clip_qkv,
        clip_qkv] (MPT's option)."""
        super().__init__()
        heads, hidden = hf_config.num_attention_heads, hf_config.hidden_size
        head_dim = hidden // heads
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, kv_heads_of(hf_config),
                                          bias=bias, tp_group=tp_group)
        self.o_proj = RowParallelLinear(hidden, hidden, bias=bias if o_bias is None else o_bias,
                                        tp_group=tp_group)
        if scale is None:
            scale = head_dim ** -0.5 if getattr(hf_config, "scale_attn_weights", True) else 1.0
            if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False):
                scale /= layer_idx + 1
        self.clip_qkv = clip_qkv
        slopes = None
        if alibi is not None:
            local = self.qkv_proj.num_heads
            slopes = alibi(heads)[tp_group.rank * local:(tp_group.rank + 1) * local]
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, scale,
                              self.qkv_proj.num_kv_heads, sliding_window=sliding_window,
                              alibi_slopes=slopes)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        if self.clip_qkv:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = self.qkv_proj.split_qkv(qkv)
        return self.o_proj(self.attn(q, k, v))


class GPT2Block(nn.Module):
    def __init__(self, hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        eps = hf_config.layer_norm_epsilon
        hidden = hf_config.hidden_size
        inner = getattr(hf_config, self.inner_size_field, None) or 4 * hidden
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = self.make_attention(hf_config, layer_idx, tp_group)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = Starcoder2MLP(SimpleNamespace(hidden_size=hidden, intermediate_size=inner),
                                 tp_group, bias=True,
                                 act=ACTIVATIONS[hf_config.activation_function])

    # What GPT-Neo's block overrides: the MLP width's field and the attention.
    inner_size_field = "n_inner"

    @staticmethod
    def make_attention(hf_config: Any, layer_idx: int,
                       tp_group: TensorParallelGroup) -> nn.Module:
        return GPT2Attention(hf_config, layer_idx, tp_group)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.attn(self.ln_1(hidden_states)) + hidden_states
        return self.mlp(self.ln_2(hidden_states)) + hidden_states


class GPT2Model(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 block: type[nn.Module] | None = None) -> None:
        """block: the layer class (default GPT2Block; GPT-Neo's)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size,
                                                   tp_group=tp_group)
        # (Replicated on every rank: one row per position is read.)
        self.wpe = nn.Embedding(hf_config.max_position_embeddings, hf_config.hidden_size)
        self.layers = nn.ModuleList((block or GPT2Block)(hf_config, i, tp_group)
                                    for i in range(hf_config.num_hidden_layers))
        self.norm = nn.LayerNorm(hf_config.hidden_size, eps=hf_config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                intermediate_tensors: Any = None) -> torch.Tensor:
        hidden_states = embedded(self.embed_tokens, input_ids, inputs_embeds)
        hidden_states = hidden_states + self.wpe(positions).to(hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states)


class GPT2LMHeadModel(DecoderForCausalLM):
    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.check_config(hf_config)
        self.build_single_stage(hf_config, tp_group, stage, GPT2Model,
                                tie=bool(getattr(hf_config, "tie_word_embeddings", True)))

    @staticmethod
    def check_config(hf_config: Any) -> None:
        check_activation(hf_config, "activation_function", ACTIVATIONS)
        if getattr(hf_config, "add_cross_attention", False):
            raise ValueError("GPT-2 with cross-attention (add_cross_attention) is not "
                             "supported")

    # Whether the checkpoint's projections are Conv1Ds ([in, out]: transposed at load).
    conv1d = True

    def split_c_attn(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """c_attn's rows ([out, in] by now) as q, k and v: [q | k | v]."""
        return tensor.chunk(3, dim=0)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._our_names(weights))

    def _our_names(self, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        """GPT-2's checkpoint names (with or without ``transformer.``) as this model's;
        Conv1D weights transposed; c_attn split into q, k and v; the mask buffers
        skipped."""
        for name, tensor in weights:
            if name.endswith(_BUFFERS):
                continue
            if name.startswith("transformer."):
                name = name[len("transformer."):]
            if not name.startswith("lm_head."):
                name = "model." + (name.replace("wte.", "embed_tokens.", 1)
                                   .replace("ln_f.", "norm.", 1)
                                   .replace("h.", "layers.", 1) if name.startswith(
                                       ("wte.", "ln_f.", "h.")) else name)
            if ".attn.c_attn." in name:
                if self.conv1d and name.endswith(".weight"):
                    tensor = tensor.t()
                for part, piece in zip(("q_proj", "k_proj", "v_proj"), self.split_c_attn(tensor)):
                    yield name.replace(".attn.c_attn.", f".attn.{part}."), piece
                continue
            for theirs, ours in _CONV1D.items():
                if theirs in name:
                    name = name.replace(theirs, ours)
                    if self.conv1d and name.endswith(".weight"):
                        tensor = tensor.t()
                    break
            yield name, tensor


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    """GPTBigCode (BigCode's StarCoder 1, SantaCoder, and their fine-tunes): GPT-2's
    layers with ``nn.Linear`` projections and, with ``multi_query``, one key/value head
    shared by every query head (c_attn's rows: [q | k | v] with k and v one head wide);
    without it c_attn interleaves each head's q, k and v rows, as GPT-NeoX does. Its
    float32 softmax options change nothing here: attention's softmax is float32."""

    conv1d = False

    def split_c_attn(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        heads, hidden = self.config.num_attention_heads, self.config.hidden_size
        if getattr(self.config, "multi_query", False):
            head_dim = hidden // heads
            return tensor.split([hidden, head_dim, head_dim], dim=0)
        per_head = tensor.unflatten(0, (heads, 3, -1))
        return tuple(per_head[:, i].flatten(0, 1) for i in range(3))
