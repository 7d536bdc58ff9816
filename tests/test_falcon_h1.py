"""FalconH1 specifics beyond the end-to-end checks of test_hybrid_models.py (which run
tiny checkpoints with every multiplier away from 1 and each of the mixer's three gate
modes against transformers): tensor parallelism where the norm spans all ranks, the
layout, and what is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from spindle.layers.mamba.mixer import (GATE_ONLY, GATE_THEN_NORM, NORM_THEN_GATE,
                                        GatedRMSNorm, MambaMixer)
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.models.falcon_h1 import check_supported_config, falcon_layout, gate_mode
from test_hybrid_models import SHAPES, assert_equal, generate, prompts_for
from test_generate_vs_hf import hf_greedy


def test_tensor_parallel_with_the_norm_over_all_ranks_equals_transformers(tiny_model):
    """One B/C group: the norm (before the gate) takes its mean square over the whole
    width, so the two ranks all-reduce it."""
    path = tiny_model("falcon_h1", **SHAPES["falcon_h1"]["default"])
    prompts = prompts_for(seed=21)
    (got,), _ = generate(path, prompts, tensor_parallel_size=2)
    assert_equal(hf_greedy(path, prompts, len(got[0][0])), got)


def test_norm_before_the_gate_is_its_formula():
    torch.manual_seed(0)
    x, gate = torch.randn(5, 32), torch.randn(5, 32)
    norm = GatedRMSNorm(32, 32, 1e-6, TensorParallelGroup.single(), [(0, 32)], group_size=8,
                        norm_first=True)
    norm.weight.data = torch.rand(32) + 0.5
    groups = x.unflatten(-1, (4, 8))
    normed = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + 1e-6)).flatten(-2)
    torch.testing.assert_close(norm(x, gate),
                               norm.weight * normed * torch.nn.functional.silu(gate))


def _config(**change):
    config = SimpleNamespace(hidden_act="silu", num_hidden_layers=3, hidden_size=64,
                             mamba_d_ssm=128, mamba_expand=2, mamba_n_heads=4, mamba_d_head="auto",
                             time_step_limit=[0.0, float("inf")], head_dim=16,
                             ssm_multipliers=[1.0] * 5, mlp_multipliers=[1.0, 1.0],
                             embedding_multiplier=1.5, mamba_rms_norm=True,
                             mamba_norm_before_gate=True)
    for key, value in change.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("change,message", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(mamba_d_head=16), "must equal the mixer's width"),
    (dict(mamba_d_ssm=None, mamba_expand=3, mamba_d_head=32), "must equal the mixer"),
    (dict(ssm_multipliers=[1.0] * 4), "ssm_multipliers must hold 5 numbers"),
    (dict(mlp_multipliers=[1.0]), "mlp_multipliers must hold 2 numbers"),
    (dict(time_step_limit=[0.1, 0.01]), "time_step_limit"),
])
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        check_supported_config(_config(**change))


def test_the_layout_and_gate_follow_the_config():
    layout = falcon_layout(_config())
    assert layout.attention_layers == {0, 1, 2}  # every layer attends (beside its mixer)
    assert layout.rotary_dim == 16 and layout.attention_scale == 16 ** -0.5
    assert layout.embedding_multiplier == 1.5
    assert gate_mode(_config()) == NORM_THEN_GATE
    assert gate_mode(_config(mamba_norm_before_gate=False)) == GATE_THEN_NORM
    assert gate_mode(_config(mamba_rms_norm=False)) == GATE_ONLY


@pytest.mark.parametrize("change,message", [
    (dict(gate="norm"), "gate must be one of"),
    (dict(in_proj_multipliers=[1.0, 2.0]), "must hold 5 factors"),
])
def test_the_mixer_refuses_bad_options(change, message):
    options = dict(hidden_size=64, num_heads=4, head_dim=32, n_groups=1, state_size=16,
                   conv_kernel=4, chunk_size=16, eps=1e-6, time_step_limit=(0.0, 1e9),
                   conv_bias=True, proj_bias=False, tp_group=TensorParallelGroup.single())
    with pytest.raises(ValueError, match=message):
        MambaMixer(**options, **change)
