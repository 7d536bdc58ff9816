"""Make tiny, real Hugging Face checkpoints (Llama, Qwen2, Qwen3, Mistral, Bamba, Mamba2,
NemotronH, ...) for tests and demos.

The checkpoint is what transformers itself builds and loads: config.json,
generation_config.json, safetensors weights (optionally sharded with an index),
a byte-level BPE tokenizer.json trained on the fly, and a tokenizer_config.json with
a ChatML-style chat template. Everything is deterministic for a given seed and runs
offline (the tokenizer corpus is the source of a few standard-library modules).

Weights: transformers' own random init, then rescaled. With the default init
(std 0.02) a tiny model's logits are almost flat (std ~0.15), so the top-1/top-2 gap
is often below float32 noise between two correct implementations and greedy outputs
flip. Here every linear/embedding weight is scaled to std ``WEIGHT_STD`` (attention
gets sharp and the residual stream depends on the context, not only on the last
token) and the LM head is scaled so logits have a std of about ``logit_std``
(default ``TARGET_LOGIT_STD``).
Norm weights and biases are randomised too, so that a loader mixing them up fails
tests instead of passing on all-ones / all-zeros tensors; so are the per-head
parameters of Mamba2 layers (A_log, D, dt_bias), around Mamba's own init.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID, PAD_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Standard-library modules whose source is the tokenizer's training corpus.
CORPUS_MODULES = ("textwrap", "string", "heapq", "bisect", "functools", "json.decoder",
                  "json.encoder", "fractions")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "ministral": "MinistralForCausalLM",
    "ministral3": "Ministral3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "arcee": "ArceeForCausalLM",
    "apertus": "ApertusForCausalLM",
    "dots1": "Dots1ForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "helium": "HeliumForCausalLM",
    "llama4": "Llama4ForCausalLM",
    "bamba": "BambaForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "mamba": "MambaForCausalLM",
    "falcon_mamba": "FalconMambaForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "zamba2": "Zamba2ForCausalLM",
    "granite_hybrid": "GraniteMoeHybridForCausalLM",
    "granite": "GraniteForCausalLM",
    "granite_moe": "GraniteMoeForCausalLM",
    "granite_moe_shared": "GraniteMoeSharedForCausalLM",
    "granite_swa": "GraniteSWAForCausalLM",
    "granite_moe_swa": "GraniteMoeSWAForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2_moe": "Lfm2MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "jamba": "JambaForCausalLM",
    "olmo_hybrid": "OlmoHybridForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "glm": "GlmForCausalLM",
    "exaone": "ExaoneForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "hunyuan": "HunYuanDenseV1ForCausalLM",
    "hunyuan_moe": "HunYuanMoEV1ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "minicpm3": "MiniCPM3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "phimoe": "PhimoeForCausalLM",
    "gemma": "GemmaForCausalLM",
    "cohere": "CohereForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "phi": "PhiForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "bloom": "BloomForCausalLM",
    "mpt": "MptForCausalLM",
    "gpt_bigcode": "GPTBigCodeForCausalLM",
    "opt": "OPTForCausalLM",
    "gptj": "GPTJForCausalLM",
    "codegen": "CodeGenForCausalLM",
    "falcon": "FalconForCausalLM",
    "gpt_neo": "GPTNeoForCausalLM",
    "olmo": "OlmoForCausalLM",
    "nemotron": "NemotronForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "jais2": "Jais2ForCausalLM",
    "internlm3": "InternLM3ForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                  "mistral": "MistralConfig", "bamba": "BambaConfig",
                  "smollm3": "SmolLM3Config", "seed_oss": "SeedOssConfig",
                  "ministral": "MinistralConfig", "ministral3": "Ministral3Config",
                  "arcee": "ArceeConfig", "dots1": "Dots1Config", "apertus": "ApertusConfig",
                  "ernie4_5_moe": "Ernie4_5_MoeConfig",
                  "ernie4_5": "Ernie4_5Config", "helium": "HeliumConfig",
                  "llama4": "Llama4TextConfig",
                  "mamba2": "Mamba2Config", "mamba": "MambaConfig",
                  "falcon_mamba": "FalconMambaConfig", "nemotron_h": "NemotronHConfig",
                  "zamba2": "Zamba2Config",
                  "granite_hybrid": "GraniteMoeHybridConfig", "falcon_h1": "FalconH1Config",
                  "granite": "GraniteConfig", "granite_moe": "GraniteMoeConfig",
                  "granite_moe_shared": "GraniteMoeSharedConfig",
                  "granite_swa": "GraniteSWAConfig", "granite_moe_swa": "GraniteMoeSWAConfig",
                  "lfm2": "Lfm2Config", "lfm2_moe": "Lfm2MoeConfig",
                  "qwen3_next": "Qwen3NextConfig", "qwen3_5": "Qwen3_5TextConfig",
                  "jamba": "JambaConfig", "olmo_hybrid": "OlmoHybridConfig",
                  "kimi_linear": "KimiLinearConfig",
                  "olmo2": "Olmo2Config", "olmo3": "Olmo3Config",
                  "qwen3_5_moe": "Qwen3_5MoeTextConfig",
                  "qwen3_moe": "Qwen3MoeConfig",
                  "mixtral": "MixtralConfig", "minimax_m2": "MiniMaxM2Config",
                  "glm4_moe": "Glm4MoeConfig", "deepseek_v3": "DeepseekV3Config",
                  "gpt_oss": "GptOssConfig", "deepseek_v2": "DeepseekV2Config",
                  "glm4": "Glm4Config", "glm": "GlmConfig",
                  "exaone": "ExaoneConfig", "exaone4": "Exaone4Config",
                  "minicpm3": "MiniCPM3Config", "hunyuan": "HunYuanDenseV1Config",
                  "hunyuan_moe": "HunYuanMoEV1Config",
                  "qwen2_moe": "Qwen2MoeConfig", "olmoe": "OlmoeConfig",
                  "phi3": "Phi3Config", "phimoe": "PhimoeConfig",
                  "gemma": "GemmaConfig", "gemma2": "Gemma2Config",
                  "cohere": "CohereConfig", "cohere2": "Cohere2Config",
                  "starcoder2": "Starcoder2Config", "jais2": "Jais2Config",
                  "gpt_neox": "GPTNeoXConfig", "phi": "PhiConfig", "gpt2": "GPT2Config",
                  "bloom": "BloomConfig", "mpt": "MptConfig",
                  "gpt_bigcode": "GPTBigCodeConfig", "opt": "OPTConfig",
                  "gptj": "GPTJConfig", "codegen": "CodeGenConfig", "falcon": "FalconConfig",
                  "gpt_neo": "GPTNeoConfig", "olmo": "OlmoConfig",
                  "nemotron": "NemotronConfig",
                  "stablelm": "StableLmConfig",
                  "internlm3": "InternLM3Config", "gemma3": "Gemma3TextConfig"}
# Where the MoE architectures' checkpoints keep each expert (the hub layout, which
# transformers writes and reads; its modules hold the experts stacked instead): the
# block's name, and the names of an expert's gate, up and down projections.
MOE_CHECKPOINT_NAMES = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                        "qwen3_next": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                        "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
                        "minimax_m2": ("block_sparse_moe", ("w1", "w3", "w2")),
                        "phimoe": ("block_sparse_moe", ("w1", "w3", "w2")),
                        "glm4_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                        "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                        "deepseek_v2": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                        "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                        "olmoe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                        "dots1": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                        "ernie4_5_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                        "hunyuan_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
# GPT-4-style pre-tokenization split (the one Qwen2 uses).
PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                     r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Fields of the Llama-style config that a family's configs do not have (GPT-NeoX: every
# head has its keys and values; GPT-NeoX, Phi, StableLM: the head size is hidden / heads,
# the norms are LayerNorms; GPT-2 names its activation and MLP width otherwise).
FIELDS_NOT_IN = {"gpt_neox": ("num_key_value_heads", "head_dim", "rms_norm_eps"),
                 "phi": ("head_dim", "rms_norm_eps"),
                 "stablelm": ("head_dim", "rms_norm_eps"),
                 **{arch: ("num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act",
                           "intermediate_size")
                    for arch in ("gpt2", "gpt_bigcode", "opt", "gptj", "codegen", "falcon",
                                 "gpt_neo")},
                 # (ALiBi: no position table; the head size is hidden / heads)
                 **{arch: ("num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act",
                           "intermediate_size", "max_position_embeddings")
                    for arch in ("bloom", "mpt")}}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_config_extra(arch: str, num_layers: int, num_heads: int = 4,
                         hidden_size: int = 64) -> dict[str, Any]:
    """Config fields an architecture needs to be tiny (config_extra overrides them).
    Bamba's own defaults (128 SSM heads, state 256) do not fit a 64-wide model: here 4
    heads of 2 * hidden / 4 features, state 16, chunks of 16 tokens, and attention in
    the middle layer."""
    if arch == "bamba":
        return {"mamba_n_heads": 4, "mamba_n_groups": 1, "mamba_d_state": 16,
                "mamba_chunk_size": 16, "attn_layer_indices": (num_layers // 2,)}
    if arch == "mamba2":  # no attention: num_heads are the SSM heads, of 2 * hidden / heads
        return {"num_heads": num_heads, "head_dim": 2 * hidden_size // num_heads,
                "n_groups": 1, "state_size": 16, "chunk_size": 16}
    if arch in ("mamba", "falcon_mamba"):  # Mamba1 mixers only; a dt rank of 5
        return {"state_size": 16, "conv_kernel": 4, "expand": 2, "time_step_rank": 5,
                **({"mixer_rms_eps": 1e-5} if arch == "falcon_mamba" else {})}
    if arch == "nemotron_h":  # Mamba2 layers, MLPs between them, attention in the middle
        kinds = ["mlp" if i % 2 else "linear_attention" for i in range(num_layers)]
        kinds[num_layers // 2] = "full_attention"
        return {"layers_block_type": kinds, "mamba_num_heads": num_heads,
                "mamba_head_dim": 2 * hidden_size // num_heads, "n_groups": 1,
                "ssm_state_size": 16, "chunk_size": 16,
                # for "moe" layers: 4 experts of 32, 2 per token, a shared one of 48
                "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "moe_shared_expert_intermediate_size": 48}
    if arch == "zamba2":  # Mamba2 layers, every other one hybrid (a shared transformer
        # block first); two shared blocks with adapters, rotary, GELU, heads of 2 * hidden / 4
        kinds = ["hybrid" if i % 2 else "linear_attention" for i in range(num_layers)]
        return {"layers_block_type": kinds, "n_mamba_heads": num_heads, "mamba_ngroups": 1,
                "mamba_d_state": 16, "chunk_size": 16, "num_key_value_heads": num_heads,
                "head_dim": 2 * hidden_size // num_heads,
                "num_mem_blocks": 2, "use_shared_attention_adapter": True, "adapter_rank": 8,
                "use_mem_rope": True, "hidden_act": "gelu"}
    if arch == "granite_hybrid":  # Bamba's layout, dense (no experts), Granite's scalings
        kinds = ["mamba"] * num_layers
        kinds[num_layers // 2] = "attention"
        return {"layer_types": kinds, "mamba_n_heads": num_heads, "mamba_n_groups": 1,
                "mamba_d_state": 16, "mamba_chunk_size": 16, "num_local_experts": 0,
                "shared_intermediate_size": 96, "embedding_multiplier": 1.5,
                "residual_multiplier": 0.5, "attention_multiplier": 0.2,
                "logits_scaling": 1.25, "position_embedding_type": "nope"}
    if arch in ("granite_swa", "granite_moe_swa"):  # Granite's (MoE: with a shared MLP),
        # a window of 8 on all but every third layer, a rotary base per layer (none on one)
        fields = default_config_extra("granite" if arch == "granite_swa"
                                      else "granite_moe_shared", num_layers)
        fields.update(sliding_window=8, layer_types=[
            "full_attention" if i % 3 == 0 else "sliding_attention" for i in range(num_layers)],
            layer_rope_theta=[10000.0 if i % 2 else (0 if i == 2 else 500.0)
                              for i in range(num_layers)])
        return fields
    if arch in ("granite", "granite_moe", "granite_moe_shared"):  # Granite's scalings away
        # from 1; (MoE) 4 experts of the intermediate size, 2 per token, (shared) one of 48
        fields = {"embedding_multiplier": 1.5, "residual_multiplier": 0.5,
                  "attention_multiplier": 0.2, "logits_scaling": 1.25}
        if arch != "granite":
            fields.update(num_local_experts=4, num_experts_per_tok=2)
        if arch == "granite_moe_shared":
            fields.update(shared_intermediate_size=48)
        return fields
    if arch == "falcon_h1":  # attention and a Mamba2 mixer in every layer; multipliers
        # away from 1 (each one a test can catch), the mixer's norm before its gate
        return {"mamba_n_heads": num_heads, "mamba_d_ssm": 2 * hidden_size,
                "mamba_n_groups": 1, "mamba_d_state": 16, "mamba_chunk_size": 16,
                "mamba_rms_norm": True, "mamba_norm_before_gate": True,
                "embedding_multiplier": 1.25, "lm_head_multiplier": 0.8,
                "key_multiplier": 0.7, "attention_in_multiplier": 1.2,
                "attention_out_multiplier": 0.9, "ssm_in_multiplier": 0.8,
                "ssm_out_multiplier": 1.1, "ssm_multipliers": [0.9, 1.1, 0.8, 1.2, 0.7],
                "mlp_multipliers": [1.3, 0.75]}
    if arch == "lfm2":  # short convolutions, attention in the middle layer; LFM2's own
        # MLP width rule (2/3 of intermediate_size, times 1.5, to a multiple of 32)
        kinds = ["conv"] * num_layers
        kinds[num_layers // 2] = "full_attention"
        return {"layer_types": kinds, "conv_L_cache": 3, "conv_bias": False,
                "norm_eps": 1e-5, "block_auto_adjust_ff_dim": True,
                "block_ffn_dim_multiplier": 1.5, "block_multiple_of": 32}
    if arch == "lfm2_moe":  # LFM2 with 4 experts of 32 (2 per token) after one dense layer
        kinds = ["conv"] * num_layers
        kinds[num_layers // 2] = "full_attention"
        return {"layer_types": kinds, "conv_L_cache": 3, "conv_bias": False,
                "norm_eps": 1e-5, "num_dense_layers": 1, "num_experts": 4,
                "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "use_expert_bias": True, "norm_topk_prob": True,
                "routed_scaling_factor": 1.5}
    if arch == "olmo3":  # a sliding-window layer (a small window) then a full one
        return {"sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"] * (num_layers // 2)
                + ["sliding_attention"] * (num_layers % 2)}
    if arch == "olmo_hybrid":  # Gated DeltaNet layers, attention in the middle layer
        kinds = ["linear_attention"] * num_layers
        kinds[num_layers // 2] = "full_attention"
        return {"layer_types": kinds, "linear_num_key_heads": 2,
                "linear_num_value_heads": num_heads, "linear_key_head_dim": 16,
                "linear_value_head_dim": hidden_size // num_heads, "linear_conv_kernel_dim": 4}
    if arch == "kimi_linear":  # Kimi delta attention layers (heads of 16), latent
        # attention without positions in the middle layer (a latent of 32, heads of 16 + 8
        # shared features, values of 16); a dense first layer, then 4 experts of 32 in 2
        # groups, 2 per token, and a shared one
        kinds = ["linear_attention"] * num_layers
        kinds[num_layers // 2] = "full_attention"
        return {"layer_types": kinds, "mlp_layer_types": ["dense"] + ["sparse"] * (num_layers - 1),
                "linear_num_heads": num_heads, "linear_head_dim": 16, "linear_conv_kernel_dim": 4,
                "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
                "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": None,
                "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                "v_head_dim": 16, "num_key_value_heads": num_heads}
    if arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):  # Gated DeltaNet layers,
        # attention in the middle layer; (but Qwen3.5's dense MLP) 4 experts of 32, 2 per
        # token, and a shared one of 48 in every layer
        kinds = ["linear_attention"] * num_layers
        kinds[num_layers // 2] = "full_attention"
        fields = {"layer_types": kinds, "linear_num_key_heads": 2,
                  "linear_num_value_heads": num_heads, "linear_key_head_dim": 16,
                  "linear_value_head_dim": hidden_size // num_heads,
                  "linear_conv_kernel_dim": 4}
        if arch == "qwen3_5":
            return fields
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48)
        if arch == "qwen3_next":
            fields.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
        return fields
    if arch == "jamba":  # Mamba1 layers, attention in the middle layer, 4 experts (2 per
        # token) in every other layer
        return {"attn_layer_period": num_layers, "attn_layer_offset": num_layers // 2,
                "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 4,
                "num_experts_per_tok": 2, "mamba_d_state": 16, "mamba_d_conv": 4,
                "mamba_expand": 2, "mamba_dt_rank": "auto"}
    if arch == "qwen3_moe":  # 4 experts of 32, 2 per token, every layer sparse
        return {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    if arch == "mixtral":
        return {"num_local_experts": 4, "num_experts_per_tok": 2}
    if arch == "phimoe":  # 4 experts, 2 per token (sparsemixer, a jitter wide enough to
        # weigh several experts), biases on q/k/v/o and the LM head, LongRoPE with an
        # original length of 64 and a scale of its own on each table
        half = hidden_size // num_heads // 2
        return {"num_local_experts": 4, "num_experts_per_tok": 2, "router_jitter_noise": 0.3,
                "attention_bias": True, "lm_head_bias": True, "sliding_window": None,
                "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                    "original_max_position_embeddings": 64,
                                    "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                    "long_factor": [1.0 + 0.9 * i for i in range(half)],
                                    "short_mscale": 1.1, "long_mscale": 1.3}}
    if arch == "glm4_moe":  # a dense first layer, then 4 experts of 32 (2 per token, in
        # 2 groups of which the best one counts) and a shared one; half of each head
        # rotated, biases on q/k/v, per-head q/k norms
        return {"first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32, "n_shared_experts": 1, "n_group": 2,
                "topk_group": 1, "routed_scaling_factor": 1.5, "norm_topk_prob": True,
                "use_qk_norm": True, "attention_bias": True, "partial_rotary_factor": 0.5}
    if arch == "deepseek_v3":  # GLM-4.5's experts and routing; latent attention: queries
        # through a rank-24 q_a/q_b pair, a latent of 32, heads of 16 + 8 rotated
        # (interleaved) features, values of 16
        return {"first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32, "n_shared_experts": 1, "n_group": 2,
                "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8, "head_dim": 8, "v_head_dim": 16, "rope_interleave": True,
                # (transformers' MLA repeats its per-head keys num_heads / num_kv_heads times)
                "num_key_value_heads": num_heads}
    if arch == "olmoe":  # 4 experts of 32 (2 per token), q/k/v clamped at 2
        return {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                "norm_topk_prob": False, "clip_qkv": 2.0}
    if arch == "qwen2_moe":  # 4 experts of 32 (2 per token) and a shared one of 48
        return {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 48, "norm_topk_prob": False}
    if arch == "minicpm3":  # latent attention (rotate-half), scalings away from 1
        return {"q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8, "head_dim": 8, "v_head_dim": 16,
                "num_key_value_heads": num_heads, "scale_emb": 3.0, "scale_depth": 1.4,
                "dim_model_base": 32}
    if arch == "deepseek_v2":  # DeepSeek-V2-Lite's kind: no low-rank query pair, softmax
        # routing of 4 experts in 2 groups (the best group only), scaled, a shared expert
        return {"first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32, "n_shared_experts": 1, "n_group": 2,
                "topk_group": 1, "topk_method": "group_limited_greedy",
                "routed_scaling_factor": 1.5, "q_lora_rank": None, "kv_lora_rank": 32,
                "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "head_dim": 8,
                "v_head_dim": 16, "num_key_value_heads": num_heads}
    if arch == "gpt_oss":  # 4 experts of the intermediate size (2 per token), a window of
        # 8 on every other layer, sinks; a clamp low enough to bite; YaRN as released
        return {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                "swiglu_limit": 1.0, "attention_bias": True,
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0,
                                    "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False,
                                    "original_max_position_embeddings": 64}}
    if arch == "minimax_m2":  # 4 experts of 32 (2 per token), half of each head rotated
        return {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                "partial_rotary_factor": 0.5}
    if arch in ("hunyuan", "hunyuan_moe"):  # q/k normed after the rotation; NTK alpha on
        # the base; (MoE) 4 experts, 2 per token, beside the shared MLP
        moe = {"num_experts": 4, "moe_topk": 2} if arch == "hunyuan_moe" else {}
        return {**moe, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0,
                                           "alpha": 50.0, "factor": 1.0}}
    if arch == "exaone4":  # a window of 8 on two of every three layers, the third global
        return {"sliding_window": 8, "sliding_window_pattern": 3}
    if arch == "ernie4_5_moe":  # a dense first layer, then 4 experts of 32 (2 per token)
        # and a shared one, a correction bias (randomised below)
        return {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "moe_num_shared_experts": 1, "moe_layer_start_index": 1,
                "moe_layer_interval": 1, "use_bias": False}
    if arch == "apertus":  # the xIELU MLP, q/k norms
        return {"hidden_act": "xielu"}
    if arch == "arcee":  # relu^2 MLP without a gate, biases on it
        return {"hidden_act": "relu2", "mlp_bias": True}
    if arch == "dots1":  # GLM-4.5's experts and routing, Qwen3's attention
        return {"first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32, "n_shared_experts": 1, "n_group": 2,
                "topk_group": 1, "routed_scaling_factor": 1.5, "norm_topk_prob": True}
    if arch == "seed_oss":  # q/k/v biases, none on o
        return {"attention_bias": True, "attention_out_bias": False}
    if arch == "ernie4_5":  # biases everywhere, interleaved rotary pairs
        return {"use_bias": True}
    if arch in ("glm4", "glm"):  # q/k/v biases, half of each head rotated (interleaved)
        return {"attention_bias": True, "partial_rotary_factor": 0.5}
    if arch == "ministral":  # a window of 8 on every other layer
        return {"sliding_window": 8, "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]}
    if arch == "ministral3":  # YaRN, and queries scaled from position 16 on (of 2048)
        return {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 16,
                                    "beta_fast": 32.0, "beta_slow": 1.0,
                                    "llama_4_scaling_beta": 0.5}}
    if arch == "jais2":  # LayerNorms, biases, a relu^2 MLP without a gate
        return {"hidden_act": "relu2", "attention_bias": True, "mlp_bias": True,
                "layer_norm_eps": 1e-5}
    if arch == "internlm3":  # Llama with biases on attention and MLP (qkv_bias / bias)
        return {"attention_bias": True, "mlp_bias": True}
    if arch == "starcoder2":  # LayerNorms, biases, a plain GELU MLP, a window of 8
        return {"hidden_act": "gelu_pytorch_tanh", "use_bias": True, "sliding_window": 8,
                "norm_epsilon": 1e-5}
    if arch == "gpt_neox":  # Pythia's: parallel residual, a quarter of each head rotated
        return {"hidden_act": "gelu", "use_parallel_residual": True,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.25}}
    if arch == "stablelm":  # StableLM 2 1.6B's: q/k/v biases, a quarter of each head
        # rotated
        return {"use_qkv_bias": True, "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}
    if arch == "llama4":  # 4 experts (top 1) on every other layer, chunks of 8, NoPE on
        # every third layer with the temperature acting from position 7 on
        return {"num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size": 32,
                "intermediate_size_mlp": 96, "interleave_moe_layer_step": 2,
                "no_rope_layer_interval": 3, "attention_chunk_size": 8, "floor_scale": 8,
                "attn_scale": 0.5, "use_qk_norm": True}
    if arch == "mpt":  # (no max_position_embeddings: its own field)
        return {"max_seq_len": 2048}
    if arch == "gpt2":  # GPT-2's own: the tanh GELU, an MLP of 4 x hidden
        return {"activation_function": "gelu_new", "n_inner": None}
    if arch == "olmo":  # q, k and v clamped (tightly, so that the clamp acts)
        return {"clip_qkv": 1.0}
    if arch == "nemotron":  # Nemotron's: squared ReLU, half of each head rotated
        return {"hidden_act": "relu2", "norm_eps": 1e-5, "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}
    if arch == "gpt_neo":  # GPT-Neo's: global and local (a window of 8) layers in turn
        return {"activation_function": "gelu_new", "intermediate_size": None,
                "window_size": 8, "attention_types": [[["global", "local"], num_layers // 2]]
                + ([[["global"], 1]] if num_layers % 2 else [])}
    if arch == "falcon":  # Falcon 7B's: multi-query attention beside the MLP, one norm
        return {"new_decoder_architecture": False, "multi_query": True, "parallel_attn": True,
                "bias": False, "activation": "gelu", "ffn_hidden_size": 2 * hidden_size}
    if arch in ("gptj", "codegen"):  # GPT-J's: half of each head rotated, interleaved
        return {"activation_function": "gelu_new", "n_inner": None,
                "rotary_dim": hidden_size // num_heads // 2}
    if arch == "opt":  # OPT's: ReLU, LayerNorms first, an MLP of 2 x hidden
        return {"activation_function": "relu", "ffn_dim": 2 * hidden_size,
                "do_layer_norm_before": True}
    if arch == "gpt_bigcode":  # StarCoder 1's: one key/value head, an MLP of 4 x hidden
        return {"activation_function": "gelu_pytorch_tanh", "n_inner": None,
                "multi_query": True}
    if arch == "phi":  # phi-2's: a parallel layer after one LayerNorm, 0.4 of each head
        # rotated (here 0.5: an even count of a 16-wide head)
        return {"hidden_act": "gelu_new", "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}
    if arch in ("cohere", "cohere2"):  # parallel layers, a logit scale away from 1 (and
        # Cohere2: a window of 8 on the first two of every three layers, global ones unrotated)
        fields = {"logit_scale": 0.5, "use_qk_norm": False}
        if arch == "cohere2":
            fields.update(sliding_window=8, layer_types=[
                "full_attention" if (i + 1) % 3 == 0 else "sliding_attention"
                for i in range(num_layers)])
        return fields
    if arch == "gemma":  # the first Gemma: GeGLU with the tanh GELU
        return {"hidden_act": "gelu_pytorch_tanh"}
    if arch == "gemma2":  # small caps and window, so that both act on a tiny model
        return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 24,
                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
                "sliding_window": 8}
    if arch == "gemma3":  # a sliding then a global layer, each with its rotary table
        return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 24,
                "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"] * (num_layers // 2)
                + ["sliding_attention"] * (num_layers % 2),
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                       "rope_theta": 1000000.0}}}
    return {}
WEIGHT_STD = 0.2
TARGET_LOGIT_STD = 4.0
# Image-text checkpoints whose text model an arch above is: (that arch, transformers'
# config class, the architecture name). Their vision tower: one tiny block.
IMAGE_TEXT_MODELS = {
    "qwen3_5_vl": ("qwen3_5", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe_vl": ("qwen3_5_moe", "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
    "gemma3_vl": ("gemma3", "Gemma3Config", "Gemma3ForConditionalGeneration"),
    "mistral3_vl": ("mistral", "Mistral3Config", "Mistral3ForConditionalGeneration"),
    "ministral3_vl": ("ministral3", "Mistral3Config", "Mistral3ForConditionalGeneration"),
    "qwen2_5_vl": ("qwen2", "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": ("qwen3", "Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
    "llama4_vl": ("llama4", "Llama4Config", "Llama4ForConditionalGeneration"),
    "glm4v": ("glm4", "Glm4vConfig", "Glm4vForConditionalGeneration"),
    "glm4v_moe": ("glm4_moe", "Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration"),
    "llava": ("llama", "LlavaConfig", "LlavaForConditionalGeneration"),
    "llava_next": ("mistral", "LlavaNextConfig", "LlavaNextForConditionalGeneration"),
}
# Each family's vision tower, one tiny block (Qwen3.5's own; Gemma 3's SigLIP, 4 image
# tokens; Mistral 3's Pixtral).
_QWEN_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
_GLM_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4,
                   spatial_merge_size=2, temporal_patch_size=2, image_size=16)
_CLIP_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, image_size=28, patch_size=14)
TINY_VISION = {
    "Qwen3_5Config": lambda text: dict(_QWEN_VISION, out_hidden_size=text["hidden_size"]),
    "Qwen3_5MoeConfig": lambda text: dict(_QWEN_VISION, out_hidden_size=text["hidden_size"]),
    "Gemma3Config": lambda text: dict(hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      image_size=28, patch_size=14),
    "Mistral3Config": lambda text: dict(hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        head_dim=16, image_size=28, patch_size=14),
    "Qwen2_5_VLConfig": lambda text: dict(_QWEN_VISION, out_hidden_size=text["hidden_size"],
                                          fullatt_block_indexes=[0], window_size=8),
    "Qwen3VLConfig": lambda text: dict(_QWEN_VISION, out_hidden_size=text["hidden_size"],
                                       deepstack_visual_indexes=[0]),
    "Glm4vConfig": lambda text: dict(_GLM_VISION, out_hidden_size=text["hidden_size"]),
    "Glm4vMoeConfig": lambda text: dict(_GLM_VISION, out_hidden_size=text["hidden_size"]),
    "LlavaConfig": lambda text: dict(_CLIP_VISION),
    "LlavaNextConfig": lambda text: dict(_CLIP_VISION),
    "Llama4Config": lambda text: dict(hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      image_size=28, patch_size=14, vision_output_dim=32,
                                      projector_input_dim=32, projector_output_dim=32),
}
IMAGE_TEXT_OPTIONS = {"Gemma3Config": dict(mm_tokens_per_image=4)}
# Text config fields an image-text family needs: Qwen-VL's multimodal rotary sections
# (of a 16-wide head).
IMAGE_TEXT_FIELDS = {
    "qwen2_5_vl": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                       "mrope_section": [2, 3, 3]}},
    "qwen3_vl": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                     "mrope_section": [2, 3, 3], "mrope_interleaved": True}},
    # (GLM-4.1V / 4.5V: half of each 16-feature head rotated, 4 frequencies in 3 sections)
    **{arch: {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]},
              **extra}
       for arch, extra in (("glm4v", {}), ("glm4v_moe", {"use_qk_norm": False}))},
}


def make_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0,
                    vocab_size: int = 512, hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                    max_position_embeddings: int = 2048, tie_word_embeddings: bool | None = None,
                    num_shards: int = 1, dtype: str = "float32",
                    head_dim: int | None = None, logit_std: float = TARGET_LOGIT_STD,
                    **config_extra: Any) -> Path:
    """Write a tiny random HF checkpoint to out_dir and return its path.

    tie_word_embeddings defaults to False for llama/qwen2 and True for qwen3 (like the
    small Qwen3 models). head_dim defaults to hidden_size // num_heads. logit_std sets
    the spread of the logits: larger means fewer near-ties but flatter sampling
    distributions (at 4: median top-1/top-2 gap ~0.9, ~0.1% of positions below 1e-3,
    top-1 probability ~0.47 on average). config_extra: further config fields of the
    architecture (sliding_window=8, attn_layer_indices=(1,), ...); tuples become lists.
    """
    if arch not in ARCHITECTURES and arch not in IMAGE_TEXT_MODELS:
        raise ValueError(f"arch must be one of {', '.join([*ARCHITECTURES, *IMAGE_TEXT_MODELS])}, "
                         f"got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if tie_word_embeddings is None:
        tie_word_embeddings = arch == "qwen3"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    text_arch = IMAGE_TEXT_MODELS.get(arch, (arch,))[0]
    config = _hf_config(text_arch, vocab_size=vocab_size, hidden_size=hidden_size,
                        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                        intermediate_size=intermediate_size,
                        max_position_embeddings=max_position_embeddings,
                        tie_word_embeddings=tie_word_embeddings, head_dim=head_dim,
                        extra={**default_config_extra(text_arch, num_layers, num_heads,
                                                      hidden_size),
                               **IMAGE_TEXT_FIELDS.get(arch, {}), **config_extra})
    auto_class = "AutoModelForCausalLM"
    if arch in IMAGE_TEXT_MODELS:
        config, auto_class = _image_text_config(arch, config), "AutoModelForImageTextToText"
    model = build_model(config, seed, logit_std, auto_class)
    config.dtype = dtype  # from_config rewrote it to the build dtype
    if arch in IMAGE_TEXT_MODELS:  # (transformers writes each family's hub names)
        if num_shards != 1:
            raise ValueError(f"{arch} checkpoints are written in one file, not {num_shards}")
        model.to(DTYPES[dtype]).save_pretrained(out)
    config.save_pretrained(out)
    _write_generation_config(out)
    if arch not in IMAGE_TEXT_MODELS:
        _write_weights(model, out, num_shards, DTYPES[dtype], tie_word_embeddings)
    _write_tokenizer(out, vocab_size, max_position_embeddings)
    return out


# ---------------------------------------------------------------------- config / weights
def _image_text_config(arch: str, text_config: Any) -> Any:
    """transformers' image-text config around text_config, with a one-block vision tower
    (IMAGE_TEXT_MODELS); the head is tied or not as the text config says."""
    import transformers

    _, config_class, architecture = IMAGE_TEXT_MODELS[arch]
    text = text_config.to_dict()
    config = getattr(transformers, config_class)(
        text_config=text, vision_config=TINY_VISION[config_class](text),
        tie_word_embeddings=text_config.tie_word_embeddings,
        **IMAGE_TEXT_OPTIONS.get(config_class, {}))
    config.architectures = [architecture]
    return config


def _hf_config(arch: str, *, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
               num_kv_heads: int, intermediate_size: int, max_position_embeddings: int,
               tie_word_embeddings: bool, head_dim: int | None,
               extra: dict[str, Any] | None = None) -> Any:
    import transformers

    config_class = getattr(transformers, CONFIG_CLASSES[arch])
    extra = {k: list(v) if isinstance(v, tuple) else v for k, v in (extra or {}).items()}
    fields = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
        head_dim=head_dim or hidden_size // num_heads, rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID, hidden_act="silu",
    )
    for name in FIELDS_NOT_IN.get(arch, ()):  # (as the family's real configs lack them)
        del fields[name]
    # An architecture's own meaning of a field wins (Mamba2's head_dim is its SSM heads').
    config = config_class(**{**fields, **extra})
    config.architectures = [ARCHITECTURES[arch]]
    return config


def build_model(config: Any, seed: int, logit_std: float = TARGET_LOGIT_STD,
                auto_class: str = "AutoModelForCausalLM") -> torch.nn.Module:
    """transformers' model for config (made by its auto_class), seeded, with the rescaled
    init (see module doc)."""
    import transformers

    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
        torch.manual_seed(seed)
        model = getattr(transformers, auto_class).from_config(
            config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    head_std = logit_std / math.sqrt(config.get_text_config().hidden_size)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(NORM_WEIGHTS):
                param.copy_(1.0 + 0.2 * _randn_like(param, generator))
            elif name.endswith(SSM_PARAMETERS):
                param.copy_(_ssm_parameter(name, param, generator))
            elif name.endswith((".bias", "_proj_bias", ".e_score_correction_bias")):
                # (gpt-oss's experts: *_proj_bias; ERNIE 4.5's correction bias: a parameter)
                param.copy_(0.1 * _randn_like(param, generator))
            elif name.endswith(".sinks"):  # gpt-oss's: a logit per head, some dominant
                param.copy_(_randn_like(param, generator))
            elif name.endswith((".alpha_p", ".alpha_n")):  # xIELU's (Apertus): around its init
                param.add_(0.2 * _randn_like(param, generator))
            else:  # linear / embedding weights, transformers' N(0, initializer_range)
                param.mul_(WEIGHT_STD / param.std())
        for name, buffer in model.named_buffers():
            if name.endswith((".e_score_correction_bias", ".expert_bias")):  # (zeros in HF)
                buffer.copy_(0.1 * _randn_like(buffer, generator))
        # The final norm outputs ~unit rms, so logit std ~ head std * sqrt(hidden).
        # Tied: scaling the head scales the embedding too, which only strengthens the
        # token signal in the residual stream.
        head = model.get_output_embeddings().weight
        head.mul_(head_std / head.std())
        if getattr(config, "model_type", None) == "zamba2":
            _tie_zamba2_blocks(model)
    return model


def _tie_zamba2_blocks(model: torch.nn.Module) -> None:
    """Give every hybrid layer of a Zamba2 model the weights of the shared block it uses
    (hybrid layer j: block j % num_mem_blocks, held by hybrid layer j % num_mem_blocks).
    transformers builds the copies untied, each with weights of its own; the released
    checkpoints hold one set per block."""
    config, layers = model.config, model.model.layers
    hybrid = config.hybrid_layer_ids
    for position, layer in enumerate(hybrid):
        source = hybrid[position % config.num_mem_blocks]
        if source != layer:
            layers[layer].shared_transformer.load_state_dict(
                layers[source].shared_transformer.state_dict())


# Norm weights (initialised as ones): "norm_f" is the final norm of Mamba2 / NemotronH,
# "ln_*" GPT-2's and Falcon's.
NORM_WEIGHTS = ("norm.weight", "norm_f.weight", ".ln_1.weight", ".ln_2.weight", "ln_f.weight",
                ".ln_attn.weight", ".ln_mlp.weight", ".norm_1.weight", ".norm_2.weight")
# Per-head parameters of Mamba2 layers, initialised as ones / log(1..H) by transformers:
# rescaling them by their std (0 for ones) would give NaN.
SSM_PARAMETERS = (".A_log", ".D", ".dt_bias")


def _ssm_parameter(name: str, param: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Mamba's own init, randomised per head: A = -exp(A_log) in [-16, -1]; dt_bias the
    inverse softplus of a step log-uniform in [1e-3, 1e-1]; D around 1. Per-step decays
    then range from ~0.2 to ~1, so some heads remember the whole prompt and others only
    the last few tokens."""
    uniform = torch.rand(param.shape, generator=generator, dtype=param.dtype)
    if name.endswith(".A_log"):
        return torch.log(1.0 + 15.0 * uniform)
    if name.endswith(".dt_bias"):
        step = torch.exp(math.log(1e-3) + uniform * (math.log(1e-1) - math.log(1e-3)))
        return step + torch.log(-torch.expm1(-step))
    return 0.5 + uniform  # D


def _randn_like(param: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(param.shape, generator=generator, dtype=param.dtype)


def _write_generation_config(out: Path) -> None:
    # Like Qwen chat models: stop at end-of-text or at the end of an assistant turn.
    generation = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID],
                  "pad_token_id": PAD_ID, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _write_weights(model: torch.nn.Module, out: Path, num_shards: int, dtype: torch.dtype,
                   tied: bool) -> None:
    """model.safetensors, or num_shards shards (balanced by bytes, names in order) plus
    model.safetensors.index.json, exactly as transformers names them."""
    from safetensors.torch import save_file

    state = {name: t.detach().to(dtype).contiguous().clone()
             for name, t in checkpoint_tensors(model)}
    if tied:
        state.pop("lm_head.weight", None)  # transformers does not store tied copies
    for stale in list(out.glob("*.safetensors")) + [out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    if num_shards == 1:
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(state)
    if num_shards > len(names):
        raise ValueError(f"num_shards ({num_shards}) exceeds the number of tensors ({len(names)})")
    shards = _split_balanced(names, [state[n].numel() * state[n].element_size() for n in names],
                             num_shards)
    weight_map = {}
    for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: state[n] for n in shard}, str(out / filename), metadata={"format": "pt"})
        weight_map.update({n: filename for n in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def checkpoint_tensors(model: torch.nn.Module):
    """(name, tensor) in the checkpoint layout: the state dict, with the stacked experts
    of an MoE model written one expert at a time under the hub's names."""
    arch = next((a for a, cls in ARCHITECTURES.items()
                 if cls == model.config.architectures[0]), None)
    if arch == "kimi_linear":  # (transformers' own mapping back to the hub's names: the
        # forget gate's tensors on the layer, q/k/v convs apart, experts one by one)
        from transformers.core_model_loading import revert_weight_conversion

        yield from revert_weight_conversion(model, model.state_dict()).items()
        return
    for name, tensor in model.state_dict().items():
        if arch in ("granite_hybrid", "granite_moe", "granite_moe_shared"):
            yield _granite_hub_name(name), tensor
            continue
        if arch == "jamba":  # the hub's experts one by one (experts.E.gate_proj / ...)
            from spindle.models.moe import stacked_experts_one_by_one

            yield from stacked_experts_one_by_one([(name, tensor)], ".feed_forward.experts.",
                                                  ("gate_proj", "up_proj", "down_proj"))
            continue
        if arch == "lfm2_moe":  # the hub's experts one by one (experts.E.w1 / w3 / w2)
            from spindle.models.lfm2 import experts_one_by_one

            yield from experts_one_by_one([(name, tensor)])
            continue
        if arch == "nemotron_h" and name.endswith((".experts.up_proj", ".experts.down_proj")):
            from spindle.models.moe import one_per_expert

            yield from one_per_expert(*name.rsplit(".", 1), tensor)  # (the hub's layout)
            continue
        if arch not in MOE_CHECKPOINT_NAMES or ".mlp." not in name:
            yield name, tensor
            continue
        block, (gate, up, down) = MOE_CHECKPOINT_NAMES[arch]
        prefix = name.split(".mlp.")[0] + f".{block}."
        if name.endswith(".mlp.experts.gate_up_proj"):
            for e, expert in enumerate(tensor):
                half = expert.shape[0] // 2
                yield f"{prefix}experts.{e}.{gate}.weight", expert[:half]
                yield f"{prefix}experts.{e}.{up}.weight", expert[half:]
        elif name.endswith(".mlp.experts.down_proj"):
            for e, expert in enumerate(tensor):
                yield f"{prefix}experts.{e}.{down}.weight", expert
        elif name.endswith((".mlp.gate.weight", ".mlp.router.weight")):
            yield f"{prefix}gate.weight", tensor
        else:  # a dense layer's MLP, or the block's other tensors (a correction bias)
            yield prefix + name.split(".mlp.", 1)[1], tensor


# transformers' names of a GraniteMoeHybrid expert block's tensors -> the hub's (experts
# stacked either way).
GRANITE_HUB_NAMES = {"experts.gate_up_proj": "input_linear.weight",
                     "experts.down_proj": "output_linear.weight",
                     "router.weight": "router.layer.weight"}


def _granite_hub_name(name: str) -> str:
    stem, sep, leaf = name.rpartition(".block_sparse_moe.")
    return stem + sep + GRANITE_HUB_NAMES.get(leaf, leaf) if sep else name


def _split_balanced(names: list[str], sizes: list[int], parts: int) -> list[list[str]]:
    """Exactly `parts` consecutive, non-empty groups of names (len(names) >= parts),
    each closed once the running size reaches its share of the total."""
    target = sum(sizes) / parts
    groups: list[list[str]] = [[]]
    filled = 0
    for i, (name, size) in enumerate(zip(names, sizes)):
        names_left = len(names) - i
        must_open = parts - len(groups) >= names_left  # one name per remaining group
        want_open = len(groups) < parts and filled >= target * len(groups)
        if groups[-1] and (must_open or want_open):
            groups.append([])
        groups[-1].append(name)
        filled += size
    return groups


# ---------------------------------------------------------------------- tokenizer
def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE tokenizer with SPECIAL_TOKENS, trained on texts (also used by
    tools/train_demo_model.py)."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers import models as tokenizer_models

    tokenizer = Tokenizer(tokenizer_models.BPE())
    # The pipeline transformers' Qwen2Tokenizer rebuilds around the vocab and merges
    # (transformers 5 forces that class on model_type qwen2): with the same pipeline
    # here, the raw tokenizer.json and every transformers tokenizer class agree.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


@functools.lru_cache(maxsize=8)
def _train_tokenizer_json(vocab_size: int) -> str:
    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be >= {minimum} (256 bytes + special tokens), "
                         f"got {vocab_size}")
    tokenizer = train_bpe_tokenizer(_corpus(), vocab_size)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"the tokenizer corpus only supports {tokenizer.get_vocab_size()} "
                         f"tokens, fewer than vocab_size={vocab_size}")
    return tokenizer.to_str()


def _corpus() -> list[str]:
    return [inspect.getsource(importlib.import_module(name)) for name in CORPUS_MODULES]


def _write_tokenizer(out: Path, vocab_size: int, max_length: int) -> None:
    (out / "tokenizer.json").write_text(_train_tokenizer_json(vocab_size))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "unk_token": None,  # byte-level: nothing is unknown (and no class default sneaks in)
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---------------------------------------------------------------------- CLI
def add_cli_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("out", help="Output directory.")
    parser.add_argument("--arch", choices=sorted([*ARCHITECTURES, *IMAGE_TEXT_MODELS]),
                        default="llama",
                        help="Architecture of the checkpoint.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the random weights.")
    parser.add_argument("--vocab-size", type=int, default=512,
                        help="Vocabulary of the byte-level BPE tokenizer trained for it.")
    parser.add_argument("--hidden-size", type=int, default=64, help="Model width.")
    parser.add_argument("--num-layers", type=int, default=2, help="Decoder layers.")
    parser.add_argument("--num-heads", type=int, default=4, help="Attention (query) heads.")
    parser.add_argument("--num-kv-heads", type=int, default=2, help="Key/value heads.")
    parser.add_argument("--intermediate-size", type=int, default=128, help="MLP width.")
    parser.add_argument("--max-position-embeddings", type=int, default=2048,
                        help="Context length (also the tokenizer's model_max_length).")
    parser.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="Share the embedding and LM head (default: tied for qwen3, "
                             "untied otherwise).")
    parser.add_argument("--num-shards", type=int, default=1,
                        help="Safetensors files to split the weights into.")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="Dtype of the stored weights.")
    parser.add_argument("--logit-std", type=float, default=TARGET_LOGIT_STD,
                        help="Spread of the logits (larger: fewer near-ties, flatter sampling).")
    return parser


def run_cli(args: argparse.Namespace) -> Path:
    path = make_tiny_model(
        args.out, arch=args.arch, seed=args.seed, vocab_size=args.vocab_size,
        hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads, intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=args.tie_word_embeddings, num_shards=args.num_shards,
        dtype=args.dtype, logit_std=args.logit_std)
    print(f"wrote tiny {args.arch} checkpoint to {path}")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spindle make-tiny-model",
                                     description="Write a tiny random HF checkpoint.")
    run_cli(add_cli_arguments(parser).parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
