"""PhiForCausalLM (Microsoft's phi-1, phi-1.5 and phi-2): one LayerNorm per layer whose
output feeds attention and the MLP side by side (x + attn(n) + mlp(n)); attention with
biases rotating the first ``partial_rotary_factor`` of each head the rotate-half way
(optionally after a LayerNorm on each head of q and k, ``qk_layernorm``); a plain GELU
MLP (``fc1``, ``fc2``); a final LayerNorm; and an LM head with a bias, added to the
logits of every rank's gathered vocabulary (DecoderForCausalLM.lm_head_bias)."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.models.causal_lm import DecoderForCausalLM, RotaryDecoderModel
from spindle.models.gpt_neox import (ACTIVATIONS, PartialRotaryAttention, check_rotary_dim,
                                     partial_rotary_table)
from spindle.models.starcoder2 import Starcoder2MLP


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


def phi_model(hf_config: Any, tp_group: TensorParallelGroup) -> RotaryDecoderModel:
    return RotaryDecoderModel(
        hf_config, tp_group, lambda i: PhiLayer(hf_config, tp_group),
        nn.LayerNorm(hf_config.hidden_size, eps=hf_config.layer_norm_eps),
        rotary=partial_rotary_table(hf_config), with_positions=False)


class PhiForCausalLM(DecoderForCausalLM):
    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.check_config(hf_config)
        self.build_single_stage(hf_config, tp_group, stage, phi_model, head_bias=True)

    @staticmethod
    def check_config(hf_config: Any) -> None:
        if hf_config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported (known: "
                             f"{sorted(ACTIVATIONS)})")
        check_rotary_dim(hf_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._our_names(weights))

    @staticmethod
    def _our_names(weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            yield (name.replace("lm_head.bias", "lm_head_bias")
                   .replace("model.final_layernorm.", "model.norm.")
                   .replace(".self_attn.dense.", ".self_attn.o_proj.")
                   .replace(".self_attn.q_layernorm.", ".self_attn.q_norm.")
                   .replace(".self_attn.k_layernorm.", ".self_attn.k_norm.")
                   .replace(".mlp.fc1.", ".mlp.c_fc.")
                   .replace(".mlp.fc2.", ".mlp.c_proj.")), tensor
