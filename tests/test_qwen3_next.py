"""Qwen3-Next specifics beyond the end-to-end checks of test_hybrid_models.py (three
tiny shapes against transformers): the multi-token-prediction tensors of the hub's
checkpoints are left out, and what is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from checkpoint_utils import rewritten_checkpoint, same_tokens, spindle_greedy
from test_generate_vs_hf import hf_greedy

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.mamba.gated_delta_net import GatedDeltaNet
from spindle.models.qwen3_next import check_supported_config


def test_the_multi_token_prediction_head_is_not_loaded(tiny_model, tmp_path):
    """The hub's Qwen3-Next checkpoints carry an MTP block (mtp.*) that transformers
    skips too; its layers have the model's names below the prefix."""
    path = tiny_model("qwen3_next")

    def with_mtp(tensors):
        extra = {f"mtp.{name[len('model.'):]}": tensor.clone()
                 for name, tensor in tensors.items() if name.startswith("model.layers.1.")}
        extra["mtp.fc.weight"] = torch.zeros(64, 128)
        return {**tensors, **extra}

    changed = rewritten_checkpoint(path, tmp_path / "mtp", with_mtp)
    prompts = [[5, 6, 7], list(range(10, 40))]
    assert same_tokens(hf_greedy(path, prompts, 8), spindle_greedy(changed, prompts))


def _config(**change):
    config = SimpleNamespace(num_hidden_layers=2, hidden_act="silu",
                             layer_types=["linear_attention", "full_attention"])
    for key, value in change.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("change,message", [
    (dict(layer_types=["linear_attention"]), "names 1 layers, the model has 2"),
    (dict(layer_types=["linear_attention", "sliding_attention"]),
     r"unknown layer types \['sliding_attention'\]"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
])
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        check_supported_config(_config(**change))


def _layer(tp_group=None, **change):
    shape = dict(hidden_size=64, num_key_heads=2, num_value_heads=4, key_head_dim=16,
                 value_head_dim=16, conv_kernel=4, eps=1e-6)
    shape.update(change)
    return GatedDeltaNet(tp_group=tp_group or TensorParallelGroup.single(), **shape)


@pytest.mark.parametrize("change,message", [
    (dict(num_value_heads=3), r"linear_num_value_heads \(3\) must be a multiple of "
                              r"linear_num_key_heads \(2\)"),
    (dict(conv_kernel=1), "linear_conv_kernel_dim must be >= 2"),
])
def test_bad_layer_shapes_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        _layer(**change)


def test_key_heads_must_split_across_ranks():
    group = SimpleNamespace(size=4, rank=0)
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        _layer(tp_group=group)


def test_the_text_config_takes_the_outer_tie_dtype_and_quantization():
    from spindle.models.registry import text_model_config

    text = SimpleNamespace(architectures=None, tie_word_embeddings=False, dtype=None)
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    outer = SimpleNamespace(architectures=["Qwen3_5MoeForConditionalGeneration"],
                            text_config=text, tie_word_embeddings=True, dtype="bfloat16",
                            quantization_config=fp8)
    served = text_model_config(outer)
    assert served is text and served.architectures == ["Qwen3_5MoeForCausalLM"]
    assert (served.tie_word_embeddings, served.dtype, served.quantization_config) == (
        True, "bfloat16", fp8)
    assert served.text_model_of == "Qwen3_5MoeForConditionalGeneration"
    plain = SimpleNamespace(architectures=["Qwen3_5ForCausalLM"])
    assert text_model_config(plain) is plain
