"""KimiLinear specifics beyond the end-to-end checks of test_hybrid_models.py (three tiny
shapes against transformers, chunked prefill, prefix hits, tensor parallelism, sleep):
what is refused, the head never tied (as transformers' KimiLinear), and the hub's names
of a dense layer's MLP (``mlp``) beside those transformers writes (``block_sparse_moe``).
The decay per key feature itself is tested in test_gated_delta.py."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file, save_file

from checkpoint_utils import same_tokens
from test_generate_vs_hf import hf_greedy

from spindle import LLM, SamplingParams
from spindle.models.kimi_linear import check_supported_config

PROMPTS = [[5, 6, 7], list(range(10, 50))]


def _config(**change):
    config = SimpleNamespace(num_hidden_layers=2, hidden_act="silu",
                             layer_types=["linear_attention", "full_attention"],
                             mlp_layer_types=["dense", "sparse"], num_local_experts=4,
                             hidden_size=64, moe_intermediate_size=32, n_shared_experts=1,
                             num_experts_per_tok=2, n_group=2, topk_group=1)
    for key, value in change.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("change,message", [
    (dict(mlp_layer_types=["dense", "moe"]), r"mlp_layer_types must name 'dense' or 'sparse'"),
    (dict(mlp_layer_types=["dense"]), r"for each of the 2 layers"),
    (dict(layer_types=["linear_attention", "sliding_attention"]), r"unknown layer types"),
    (dict(num_local_experts=3), r"n_routed_experts \(3\) must split into n_group \(2\)"),
    (dict(hidden_act="gelu"), r"silu")])
def test_config_features_it_would_get_wrong_are_refused(change, message):
    check_supported_config(_config())
    with pytest.raises(ValueError, match=message):
        check_supported_config(_config(**change))


def test_routing_is_checked_only_where_there_are_experts():
    check_supported_config(_config(mlp_layer_types=["dense", "dense"], num_local_experts=3))


def _spindle_greedy(path, max_tokens=8):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(str(path), dtype="float32", device="cpu", max_model_len=128) as llm:
        return [(list(o.outputs[0].token_ids), None)
                for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _copy(path, tmp_path):
    return shutil.copytree(path, tmp_path / "checkpoint")


def test_the_head_is_never_tied(tiny_model, tmp_path):
    """A config saying tie_word_embeddings: transformers' KimiLinear still reads its own
    lm_head, and so does spindle."""
    path = _copy(tiny_model("kimi_linear", num_layers=2), tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    assert same_tokens(hf_greedy(path, PROMPTS, 8), _spindle_greedy(path))


def test_a_dense_mlp_loads_under_either_name(tiny_model, tmp_path):
    """The released checkpoints name the dense layers' MLP ``mlp``, transformers writes
    ``block_sparse_moe``; the experts stay under ``block_sparse_moe``."""
    path = _copy(tiny_model("kimi_linear", num_layers=3), tmp_path)
    expected = hf_greedy(path, PROMPTS, 8)
    weights = load_file(str(path / "model.safetensors"))
    dense = "model.layers.0.block_sparse_moe."
    renamed = {(name.replace(dense, "model.layers.0.mlp.") if name.startswith(dense) else name):
               tensor for name, tensor in weights.items()}
    assert sum(name.startswith("model.layers.0.mlp.") for name in renamed) == 3
    save_file(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})
    assert same_tokens(expected, _spindle_greedy(path))
