"""GPTJForCausalLM (EleutherAI's GPT-J 6B and its fine-tunes; CodeGen's below): one
LayerNorm per layer feeding attention and the MLP side by side (x + attn(n) + mlp(n));
attention without biases whose rotary turns the first ``rotary_dim`` features of each
head in interleaved pairs (x0, x1), (x2, x3), ...; a GELU MLP with biases (``fc_in``,
``fc_out``); a final LayerNorm; and an LM head with a bias.

The interleaved pairs are served as Cohere's and GLM-4's are: each q/k head's rotated
rows are permuted at load into the rotate-half layout, which leaves every q . k the
same."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.layers.rotary import RotaryEmbedding, interleaved_rows_as_halves
from spindle.models.causal_lm import DecoderForCausalLM, RotaryDecoderModel, renamed
from spindle.models.gpt_neox import ACTIVATIONS, PartialRotaryAttention
from spindle.models.llama import check_activation
from spindle.models.starcoder2 import Starcoder2MLP

# Buffers of older checkpoints (the causal mask), and the q/k weights to permute.
_BUFFERS = (".attn.bias", ".attn.masked_bias")
_QK = (".attn.q_proj.weight", ".attn.k_proj.weight")
_RENAMES = (("transformer.wte.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
            ("transformer.h.", "model.layers."), (".attn.out_proj.", ".attn.o_proj."),
            (".mlp.fc_in.", ".mlp.c_fc."), (".mlp.fc_out.", ".mlp.c_proj."),
            ("lm_head.bias", "lm_head_bias"))


def rotary_dim_of(hf_config: Any) -> int:
    """GPT-J's ``rotary_dim`` (None: the whole head)."""
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    return getattr(hf_config, "rotary_dim", None) or head_dim


class GPTJBlock(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.ln_1 = nn.LayerNorm(hidden, eps=hf_config.layer_norm_epsilon)
        self.attn = PartialRotaryAttention(hf_config, tp_group, hf_config.num_attention_heads,
                                           bias=False)
        inner = getattr(hf_config, "n_inner", None) or 4 * hidden
        self.mlp = Starcoder2MLP(SimpleNamespace(hidden_size=hidden, intermediate_size=inner),
                                 tp_group, bias=True,
                                 act=ACTIVATIONS[hf_config.activation_function])

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        normed = self.ln_1(hidden_states)
        return self.attn(normed, cos, sin) + self.mlp(normed) + hidden_states


def gptj_model(hf_config: Any, tp_group: TensorParallelGroup) -> RotaryDecoderModel:
    rotary = RotaryEmbedding(rotary_dim_of(hf_config), hf_config.max_position_embeddings,
                             {"rope_type": "default", "rope_theta": 10000.0})
    return RotaryDecoderModel(
        hf_config, tp_group, lambda i: GPTJBlock(hf_config, tp_group),
        nn.LayerNorm(hf_config.hidden_size, eps=hf_config.layer_norm_epsilon),
        rotary=rotary, with_positions=False)


class GPTJForCausalLM(DecoderForCausalLM):
    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.check_config(hf_config)
        self.build_single_stage(hf_config, tp_group, stage, gptj_model, head_bias=True)

    @staticmethod
    def check_config(hf_config: Any) -> None:
        check_activation(hf_config, "activation_function", ACTIVATIONS)
        if rotary_dim_of(hf_config) % 2:
            raise ValueError(f"rotary_dim {rotary_dim_of(hf_config)} must be even")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._our_names(weights))

    def _our_names(self, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        """GPT-J's names as this model's; each q/k head's rotated rows from interleaved
        pairs to halves; the mask buffers skipped."""
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        rotated = rotary_dim_of(self.config)
        for name, tensor in renamed(weights, _RENAMES, skip=_BUFFERS):
            if name.endswith(_QK):
                tensor = interleaved_rows_as_halves(tensor, head_dim, rotated)
            yield name, tensor


class CodeGenForCausalLM(GPTJForCausalLM):
    """CodeGenForCausalLM (Salesforce's CodeGen 350M-16B, mono / multi / nl): GPT-J's
    layers, with q, k and v fused in ``qkv_proj`` across the four model-parallel shards
    CodeGen was trained on: the rows are four blocks of [q | v | k] quarters, split at
    load (then q and k permuted as GPT-J's)."""

    MP_SHARDS = 4

    def _our_names(self, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        return super()._our_names(self._split_qkv(weights))

    def _split_qkv(self, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if ".attn.qkv_proj." not in name:
                yield name, tensor
                continue
            shards = tensor.unflatten(0, (self.MP_SHARDS, 3, -1))
            for i, part in enumerate(("q_proj", "v_proj", "k_proj")):
                yield name.replace(".attn.qkv_proj.", f".attn.{part}."), shards[:, i].flatten(0, 1)
