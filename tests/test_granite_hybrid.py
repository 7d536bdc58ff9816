"""GraniteMoeHybrid specifics beyond the end-to-end checks of test_hybrid_models.py: both
spellings of the expert tensors load, and what is refused; and what Granite 3.x's
dense and MoE models (models/granite.py; end to end in test_generate_vs_hf.py and
test_moe_models.py) refuse and how they lay out their layers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from checkpoint_utils import rewritten_checkpoint, same_tokens, spindle_greedy
from spindle.models.granite_hybrid import check_supported_config, granite_layout
from spindle.tools.tiny_model import GRANITE_HUB_NAMES
from test_generate_vs_hf import hf_greedy

MOE = dict(num_layers=3, num_local_experts=4, num_experts_per_tok=2)


def test_transformers_names_of_the_experts_load_too(tiny_model, tmp_path):
    """tiny_model writes the hub's names (input_linear, output_linear, router.layer);
    transformers saves its own (experts.gate_up_proj, experts.down_proj, router)."""
    back = {hub: ours for ours, hub in GRANITE_HUB_NAMES.items()}

    def transformers_names(tensors):
        moved = {}
        for name, tensor in tensors.items():
            stem, sep, leaf = name.rpartition(".block_sparse_moe.")
            moved[stem + sep + back.get(leaf, leaf) if sep else name] = tensor
        assert "model.layers.0.block_sparse_moe.experts.gate_up_proj" in moved
        return moved

    path = tiny_model("granite_hybrid", **MOE)
    renamed = rewritten_checkpoint(path, tmp_path / "transformers-names", transformers_names)
    prompts = [[5, 6, 7], list(range(10, 40))]
    assert same_tokens(hf_greedy(path, prompts, 8), spindle_greedy(renamed, prompts))


def _config(**change):
    config = SimpleNamespace(hidden_act="silu", layer_types=["mamba", "attention"],
                             num_hidden_layers=2, hidden_size=64, mamba_expand=2,
                             mamba_n_heads=4, mamba_d_head="auto", position_embedding_type=None,
                             time_step_limit=[0.0, float("inf")], head_dim=16,
                             attention_multiplier=0.25, embedding_multiplier=12.0,
                             residual_multiplier=0.22)
    for key, value in change.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("change,message", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(layer_types=["mamba", "moe"]), r"unknown layer types \['moe'\]"),
    (dict(layer_types=["mamba"]), "names 1 layers, the model has 2"),
    (dict(mamba_d_head=8), "must equal mamba_expand"),
    (dict(position_embedding_type="alibi"), "position_embedding_type 'alibi'"),
    (dict(time_step_limit=[0.1, 0.01]), "time_step_limit"),
])
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        check_supported_config(_config(**change))


def test_the_layout_follows_the_config():
    layout = granite_layout(_config(layer_types=["mamba", "full_attention"]))
    assert layout.attention_layers == {1}
    assert layout.rotary_dim == 0  # Granite 4.0: no positions
    assert (layout.attention_scale, layout.embedding_multiplier,
            layout.residual_multiplier) == (0.25, 12.0, 0.22)
    assert granite_layout(_config(position_embedding_type="rope")).rotary_dim == 16


@pytest.mark.parametrize("change,message", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(position_embedding_type="nope"), "position_embedding_type 'nope'"),
])
def test_granite_3_refuses_what_it_would_get_wrong(change, message):
    from spindle.models.granite import check_granite_config

    check_granite_config(_config(position_embedding_type=None))
    with pytest.raises(ValueError, match=message):
        check_granite_config(_config(**change))


def test_granite_3_layers_all_attend_and_rotate_whole_heads():
    from spindle.models.granite import granite_layout

    layout = granite_layout(_config(num_hidden_layers=3))
    assert layout.attention_layers == {0, 1, 2}
    assert layout.rotary_dim == 16
    assert (layout.attention_scale, layout.embedding_multiplier,
            layout.residual_multiplier) == (0.25, 12.0, 0.22)
