"""PhiForCausalLM (Microsoft's phi-1, phi-1.5 and phi-2): one LayerNorm per layer whose
output feeds attention and the MLP side by side (x + attn(n) + mlp(n)); attention with
biases rotating the first ``partial_rotary_factor`` of each head the rotate-half way
(optionally after a LayerNorm on each head of q and k, ``qk_layernorm``); a plain GELU
MLP (``fc1``, ``fc2``); a final LayerNorm; and an LM head with a bias, added to the
logits of every rank's gathered vocabulary (DecoderForCausalLM.lm_head_bias)."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.models.causal_lm import DecoderForCausalLM, renamed
from spindle.models.gpt_neox import (ACTIVATIONS, PartialRotaryAttention, check_rotary_dim,
                                     layer_norm_rotary_model)
from spindle.models.llama import check_activation
from spindle.models.starcoder2 import Starcoder2MLP

_RENAMES = (("lm_head.bias", "lm_head_bias"), ("model.final_layernorm.", "model.norm."),
            (".self_attn.dense.", ".self_attn.o_proj."),
            (".self_attn.q_layernorm.", ".self_attn.q_norm."),
            (".self_attn.k_layernorm.", ".self_attn.k_norm."),
            (".mlp.fc1.", ".mlp.c_fc."), (".mlp.fc2.", ".mlp.c_proj."))


class PhiLayer(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        eps = hf_config.layer_norm_eps
        kv_heads = getattr(hf_config, "num_key_value_heads", None) \
            or hf_config.num_attention_heads
        self.input_layernorm = nn.LayerNorm(hf_config.hidden_size, eps=eps)
        self.self_attn = PartialRotaryAttention(
            hf_config, tp_group, kv_heads, bias=True,
            qk_norm_eps=eps if getattr(hf_config, "qk_layernorm", False) else None)
        self.mlp = Starcoder2MLP(hf_config, tp_group, bias=True,
                                 act=ACTIVATIONS[hf_config.hidden_act])

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm(hidden_states)
        return self.self_attn(normed, cos, sin) + self.mlp(normed) + hidden_states


class PhiForCausalLM(DecoderForCausalLM):
    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.check_config(hf_config)
        self.build_single_stage(hf_config, tp_group, stage,
                                layer_norm_rotary_model(PhiLayer), head_bias=True)

    @staticmethod
    def check_config(hf_config: Any) -> None:
        check_activation(hf_config, "hidden_act", ACTIVATIONS)
        check_rotary_dim(hf_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(renamed(weights, _RENAMES))
