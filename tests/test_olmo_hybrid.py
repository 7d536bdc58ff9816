"""OLMo Hybrid specifics beyond the end-to-end checks of test_hybrid_models.py (three
tiny shapes against transformers: rotary or none, beta doubled or not, attention first,
tensor and pipeline parallelism): what is refused, and when there is a rotary; OLMo 2
(its attention layers alone; test_generate_vs_hf.py runs it and OLMo 3 through the dense
decoders' regimes) under tensor parallelism; OLMo 3 with YaRN on its full layers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from checkpoint_utils import same_tokens, spindle_greedy
from test_generate_vs_hf import hf_greedy

from spindle import LLM, SamplingParams
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.models.olmo_hybrid import OlmoAttention, check_supported_config, olmo_hybrid_layout


def _config(**change):
    config = SimpleNamespace(num_hidden_layers=2, hidden_act="silu", hidden_size=64,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             rms_norm_eps=1e-6,
                             layer_types=["linear_attention", "full_attention"],
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    for key, value in change.items():
        setattr(config, key, value)
    return config


def test_unknown_layer_types_are_refused():
    """(The hybrids' shared check, models/bamba.check_layer_types; test_qwen3_next.py
    goes through its cases.)"""
    with pytest.raises(ValueError, match=r"unknown layer types \['sliding_attention'\]"):
        check_supported_config(_config(layer_types=["linear_attention", "sliding_attention"]))


@pytest.mark.parametrize("rope_parameters,rotary_dim", [
    ({"rope_type": "default", "rope_theta": 10000.0}, 16),
    ({"rope_type": "default", "rope_theta": None}, 0), (None, 0)])
def test_a_rotary_only_where_the_config_names_a_theta(rope_parameters, rotary_dim):
    """transformers' rule (the released checkpoints have none)."""
    assert olmo_hybrid_layout(_config(rope_parameters=rope_parameters)).rotary_dim == rotary_dim


def test_key_heads_replicated_across_ranks_are_refused():
    """The k norm spans every key head once: a rank holding a copy of another's would
    count it twice."""
    config = _config()
    group = SimpleNamespace(size=4, rank=0)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\) must be a multiple of "
                                         r"the tensor parallel size \(4\)"):
        OlmoAttention(config, olmo_hybrid_layout(config), group)
    OlmoAttention(config, olmo_hybrid_layout(config), TensorParallelGroup.single())


def test_olmo2_under_tensor_parallelism_equals_transformers(tiny_model):
    """OLMo 2 (every layer OLMo's attention): the whole-width q/k norms all-reduce their
    sums of squares across the two ranks."""
    path = tiny_model("olmo2", num_layers=3)
    prompts = [[5, 6, 7], list(range(10, 60))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), dtype="float32", device="cpu", max_model_len=128,
             tensor_parallel_size=2) as llm:
        assert llm.engine.config.model.model_kind == "decoder"
        got = [(list(o.outputs[0].token_ids), None) for o in llm.generate(prompts, params,
                                                                          use_tqdm=False)]
    assert same_tokens(hf_greedy(path, prompts, 8), got)


def test_olmo3_with_yarn_on_its_full_layers_equals_transformers(tiny_model):
    """OLMo 3's long-context rope: YaRN on the full-attention layers only, the sliding
    ones plain (a table per layer type); prompts past the original 32 positions."""
    path = tiny_model("olmo3", num_layers=4, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                           "original_max_position_embeddings": 32,
                           "attention_factor": 1.2}})
    prompts = [[5, 6, 7], list(range(10, 80))]
    assert same_tokens(hf_greedy(path, prompts, 8), spindle_greedy(path, prompts))
