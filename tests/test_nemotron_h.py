"""NemotronH specifics beyond the end-to-end checks of test_hybrid_models.py: the layer
kinds read from either config spelling, what is refused, the hub's tensor names, the
experts' routing variants (groups, no renormalisation, a latent projection) and
transformers' stacked expert tensors, and the norm's rounding against transformers'
own module."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from checkpoint_utils import rewritten_checkpoint, same_tokens, spindle_greedy
from spindle import LLM
from spindle.layers.norm import Float32WeightRMSNorm
from spindle.models.nemotron_h import check_supported_config, layer_types
from test_generate_vs_hf import hf_greedy


def test_layer_kinds_from_the_pattern_and_the_list():
    listed = SimpleNamespace(layers_block_type=["linear_attention", "mlp", "full_attention"])
    assert layer_types(listed) == ["linear_attention", "mlp", "full_attention"]
    legacy = SimpleNamespace(hybrid_override_pattern="M-M*-E")
    assert layer_types(legacy) == ["linear_attention", "mlp", "linear_attention",
                                   "full_attention", "mlp", "moe"]
    with pytest.raises(ValueError, match=r"holds \['X'\]"):
        layer_types(SimpleNamespace(hybrid_override_pattern="M-X"))
    with pytest.raises(ValueError, match="needs layers_block_type"):
        layer_types(SimpleNamespace())


@pytest.mark.parametrize("change,message", [
    (dict(n_group=3), r"n_routed_experts \(8\) must split into n_group \(3\)"),
    (dict(n_group=8), "groups of at least 2"),
    (dict(topk_group=5), r"topk_group \(5\) must be in 1..n_group \(4\)"),
    (dict(num_experts_per_tok=5), r"num_experts_per_tok \(5\) must be in 1..4"),
    (dict(mlp_hidden_act="silu"), "mlp_hidden_act 'silu'"),
    (dict(mamba_hidden_act="gelu"), "mamba_hidden_act 'gelu'"),
    (dict(sliding_window=16), "sliding_window"),
    (dict(time_step_limit=[0.1, 0.01]), "time_step_limit"),
])
def test_unsupported_configs_are_refused(change, message):
    config = SimpleNamespace(hybrid_override_pattern="M-*E", mlp_hidden_act="relu2",
                             mamba_hidden_act="silu", sliding_window=None,
                             time_step_limit=[0.0, float("inf")], n_routed_experts=8,
                             n_group=4, topk_group=2, num_experts_per_tok=2)
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=message):
        check_supported_config(config)


@pytest.mark.parametrize("layers", [{}, dict(
    num_layers=3, layers_block_type=("linear_attention", "moe", "full_attention"))],
    ids=["dense", "experts"])
def test_hub_names_load_and_mtp_tensors_are_skipped(tiny_model, tmp_path, layers):
    """The hub's checkpoints name the model `backbone` (embeddings under
    backbone.embeddings, experts one by one) and may carry multi-token-prediction
    layers (mtp.*): the same tensors under those names give transformers' greedy
    tokens."""
    def hub_names(tensors):
        hub = {("backbone." + name[len("model."):] if name.startswith("model.") else name): t
               for name, t in tensors.items()}
        assert "backbone.embeddings.weight" in hub
        hub["mtp.layers.0.norm.weight"] = torch.ones(4)
        return hub

    path = tiny_model("nemotron_h", **layers)
    renamed = rewritten_checkpoint(path, tmp_path / "hub-names", hub_names)
    prompts = [[5, 6, 7], list(range(10, 40))]
    assert same_tokens(hf_greedy(path, prompts, 8), spindle_greedy(renamed, prompts))


@pytest.mark.parametrize("routing", [
    dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
         routed_scaling_factor=2.5, norm_topk_prob=False),
    dict(moe_latent_size=24, mlp_bias=True),
], ids=["grouped", "latent"])
def test_expert_routing_variants_equal_transformers(tiny_model, routing):
    """Only the best topk_group groups' experts chosen, weights not renormalised and
    scaled; or the experts behind a latent projection (with biases)."""
    path = tiny_model("nemotron_h", num_layers=3,
                      layers_block_type=("linear_attention", "moe", "full_attention"), **routing)
    prompts = [[5, 6, 7], list(range(10, 40)), [9]]
    expected = hf_greedy(path, prompts, 8)
    for (tokens, lps), (hf_tokens, hf_lps) in zip(spindle_greedy(path, prompts), expected):
        assert tokens == hf_tokens
        assert max(abs(a - b) for a, b in zip(lps, hf_lps)) < 1e-4


def test_a_config_in_the_hubs_older_spelling(tiny_model, tmp_path):
    """Nemotron-H's hub configs spell the layers as hybrid_override_pattern letters and
    some Mamba fields with a mamba_ prefix; transformers reads them, and so does spindle."""
    path = tiny_model("nemotron_h", num_layers=4,
                      layers_block_type=("linear_attention", "moe", "full_attention", "mlp"))
    older = tmp_path / "older-spelling"
    shutil.copytree(path, older)
    config = json.loads((older / "config.json").read_text())
    del config["layers_block_type"]
    config.update(hybrid_override_pattern="ME*-", num_hidden_layers=4,
                  mamba_n_groups=config.pop("n_groups"), mamba_d_conv=config.pop("conv_kernel"),
                  mamba_chunk_size=config.pop("chunk_size"))
    (older / "config.json").write_text(json.dumps(config))
    prompts = [[5, 6, 7], list(range(10, 40))]
    assert same_tokens(hf_greedy(older, prompts, 8), spindle_greedy(older, prompts))


def test_stacked_expert_tensors_load(tiny_model, tmp_path):
    """transformers saves the experts stacked (mixer.experts.up_proj [E, I, H]); the hub
    has them one by one (what tiny_model writes): both give the same model."""
    def stacked(tensors):
        out = {name: t for name, t in tensors.items() if ".experts." not in name}
        for leaf in ("up_proj", "down_proj"):
            out[f"model.layers.1.mixer.experts.{leaf}"] = torch.stack(
                [tensors[f"model.layers.1.mixer.experts.{e}.{leaf}.weight"] for e in range(4)])
        return out

    path = tiny_model("nemotron_h", num_layers=3,
                      layers_block_type=("linear_attention", "moe", "full_attention"))
    prompts = [[5, 6, 7], list(range(10, 40))]
    assert (spindle_greedy(rewritten_checkpoint(path, tmp_path / "stacked", stacked), prompts)
            == spindle_greedy(path, prompts))


def test_a_tied_config_without_a_head_is_an_error(tiny_model, tmp_path):
    """transformers' NemotronH never ties its head (it would start from a random one);
    spindle asks for the tensor instead of guessing."""
    def without_head(tensors):
        del tensors["lm_head.weight"]
        return tensors

    tied = rewritten_checkpoint(tiny_model("nemotron_h"), tmp_path / "tied", without_head)
    config = json.loads((tied / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (tied / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="lm_head.weight"):
        LLM(str(tied), dtype="float32", device="cpu", max_model_len=128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rounds_as_transformers(dtype):
    """The weight multiplies in float32 before the cast (not after, as Llama's)."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNorm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=gen).to(dtype)
    weight = (1 + 0.5 * torch.randn(64, generator=gen)).to(dtype)
    ours = Float32WeightRMSNorm(64, eps=1e-5).to(dtype)
    theirs = NemotronHRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    assert torch.equal(ours(x), theirs(x))
