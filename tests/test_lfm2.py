"""LFM2 and LFM2-MoE specifics beyond the end-to-end checks of test_hybrid_models.py
(three tiny shapes each against transformers: short convolutions of width 3 and 4,
with and without biases, a tied head, attention first or in the middle; experts with
and without the expert bias and renormalisation): LFM2's MLP width rule, transformers'
names of the experts, and what is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from checkpoint_utils import (rewritten_checkpoint, same_tokens, spindle_greedy,
                              stacked_experts)
from test_generate_vs_hf import hf_greedy

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.mamba.short_conv import ShortConv
from spindle.models.lfm2 import check_supported_config, layer_types, lfm2_layout, mlp_width


@pytest.mark.parametrize("fields", [
    dict(block_auto_adjust_ff_dim=False),
    dict(block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.25, block_multiple_of=64),
    dict(block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.5, block_multiple_of=32),
    dict(block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=256),
])
def test_the_mlp_width_is_transformers(fields):
    import transformers
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    config = transformers.Lfm2Config(hidden_size=64, intermediate_size=1000, **fields)
    assert mlp_width(config) == Lfm2MLP(config).w1.out_features


def _config(**change):
    config = SimpleNamespace(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                             head_dim=16, norm_eps=1e-5)
    for key, value in change.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("change,message", [
    (dict(layer_types=["conv", "full_attention"]), "names 2 layers, the model has 3"),
    (dict(layer_types=["conv", "sliding_attention", "conv"]),
     r"unknown layer types \['sliding_attention'\]"),
])
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        check_supported_config(_config(**change))


def test_older_configs_name_the_attention_layers_by_index():
    config = _config(layer_types=None, full_attn_idxs=[0, 2])
    assert layer_types(config) == ["full_attention", "conv", "full_attention"]
    assert lfm2_layout(config).attention_layers == {0, 2}


def test_a_convolution_needs_a_history():
    with pytest.raises(ValueError, match="conv_L_cache must be >= 2"):
        ShortConv(64, 1, False, TensorParallelGroup.single())


def test_transformers_names_of_the_experts_load_too(tiny_model, tmp_path):
    """tiny_model writes the hub's experts one by one (experts.E.w1 / w3 / w2);
    transformers' own modules stack them (experts.gate_up_proj, experts.down_proj)."""
    def stacked(tensors):
        out = stacked_experts(tensors, "w1", "w3", "w2")
        assert "model.layers.1.feed_forward.experts.gate_up_proj" in out
        return out

    path = tiny_model("lfm2_moe", num_layers=3)
    renamed = rewritten_checkpoint(path, tmp_path / "stacked", stacked)
    prompts = [[5, 6, 7], list(range(10, 40))]
    assert same_tokens(hf_greedy(path, prompts, 8), spindle_greedy(renamed, prompts))
