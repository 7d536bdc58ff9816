"""Jamba specifics beyond the end-to-end checks of test_hybrid_models.py (three tiny
shapes against transformers: attention in the middle or first, experts in odd or even
layers, projection and conv biases, an odd dt rank): transformers' stacked experts load
like the hub's, and what is refused; and what the Mamba1 mixer and the pure Mamba /
FalconMamba models (models/mamba.py) refuse."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from checkpoint_utils import (rewritten_checkpoint, same_tokens, spindle_greedy,
                              stacked_experts)
from test_generate_vs_hf import hf_greedy

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.mamba.mamba1_mixer import Mamba1Mixer
from spindle.models import mamba
from spindle.models.jamba import check_supported_config, jamba_layout


def test_transformers_stacked_experts_load_too(tiny_model, tmp_path):
    """tiny_model writes the hub's experts one by one (experts.E.gate_proj / up_proj /
    down_proj); transformers' own modules stack them (experts.gate_up_proj, down_proj)."""
    def stacked(tensors):
        out = stacked_experts(tensors, "gate_proj", "up_proj", "down_proj")
        assert "model.layers.1.feed_forward.experts.gate_up_proj" in out
        return out

    path = tiny_model("jamba", num_layers=3)
    renamed = rewritten_checkpoint(path, tmp_path / "stacked", stacked)
    prompts = [[5, 6, 7], list(range(10, 40))]
    assert same_tokens(hf_greedy(path, prompts, 8), spindle_greedy(renamed, prompts))


def _config(**change):
    config = SimpleNamespace(num_hidden_layers=4, hidden_act="silu", attn_layer_period=4,
                             attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1,
                             head_dim=16)
    for key, value in change.items():
        setattr(config, key, value)
    return config


def test_attention_every_period_at_its_offset():
    assert jamba_layout(_config(num_hidden_layers=9, attn_layer_period=4, attn_layer_offset=1)
                        ).attention_layers == {1, 5}


@pytest.mark.parametrize("change,message", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(attn_layer_offset=4), r"attn_layer_offset \(4\) must be in 0..attn_layer_period"),
    (dict(expert_layer_offset=-1), r"expert_layer_offset \(-1\) must be in"),
])
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        check_supported_config(_config(**change))


@pytest.mark.parametrize("change,message", [
    (dict(conv_kernel=1), "mamba_d_conv must be >= 2"),
    (dict(dt_rank=0), "mamba_dt_rank must be >= 1"),
])
def test_bad_mixer_shapes_are_refused(change, message):
    shape = dict(hidden_size=64, intermediate_size=128, state_size=16, conv_kernel=4,
                 dt_rank=4, eps=1e-6, conv_bias=True, proj_bias=False)
    shape.update(change)
    with pytest.raises(ValueError, match=message):
        Mamba1Mixer(tp_group=TensorParallelGroup.single(), **shape)


def test_an_unknown_selection_norm_is_refused():
    with pytest.raises(ValueError, match="selection_norms must be"):
        Mamba1Mixer(tp_group=TensorParallelGroup.single(), hidden_size=64,
                    intermediate_size=128, state_size=16, conv_kernel=4, dt_rank=4, eps=1e-6,
                    conv_bias=True, proj_bias=False, selection_norms="layer")


@pytest.mark.parametrize("change,message", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(time_step_rank="half"), "time_step_rank must be an integer"),
])
def test_unsupported_mamba_configs_are_refused(change, message):
    config = SimpleNamespace(hidden_act="silu", time_step_rank=4)
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=message):
        mamba.check_supported_config(config)
