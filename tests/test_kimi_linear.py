"""KimiLinear specifics beyond the end-to-end checks of test_hybrid_models.py (three tiny
shapes against transformers, chunked prefill, prefix hits, tensor parallelism, sleep):
what is refused, the head never tied (as transformers' KimiLinear), and the hub's names
of a dense layer's MLP (``mlp``) beside those transformers writes (``block_sparse_moe``),
and the layer on CUDA's ops against its torch path. The decay per key feature itself is
tested in test_gated_delta.py."""

from __future__ import annotations

import copy
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_utils import same_tokens
from kernel_utils import DEVICE
from test_generate_vs_hf import hf_greedy

from spindle import LLM, SamplingParams
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.forward_context import forward_context
from spindle.layers.mamba.kimi_delta import KimiDeltaAttention
from spindle.layers.mamba.metadata import MambaMetadata
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


def test_dt_bias_stays_float32_in_a_half_precision_model():
    """transformers keeps the decay's dt_bias in float32 (_keep_in_fp32_modules_strict),
    and checkpoints store it so: rounding it to bf16 would move every decay."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = KimiDeltaAttention(hidden_size=32, num_heads=2, head_dim=16, conv_kernel=4,
                                   eps=1e-6, tp_group=TensorParallelGroup.single())
    finally:
        torch.set_default_dtype(previous)
    assert layer.in_proj.weight.dtype == torch.bfloat16
    assert layer.dt_bias.dtype == torch.float32


def _step(lens, slots, has_init, device):
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    return MambaMetadata(num_reqs=len(lens), num_tokens=sum(lens), query_start_loc=qsl.to(device),
                         state_indices=torch.tensor(slots, dtype=torch.int32, device=device),
                         has_initial_state=torch.tensor(has_init, device=device),
                         max_query_len=max(lens), query_start_loc_cpu=qsl,
                         has_initial_state_cpu=torch.tensor(has_init),
                         state_indices_cpu=torch.tensor(slots, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.kernel
def test_the_layer_on_its_cuda_kernels_equals_its_torch_path(monkeypatch):
    """Kimi delta attention on CUDA's ops (the conv kernels, the decode kernel with a
    decay per key feature; the torch prefill) against the CPU's torch ops: a prefill of
    two requests, a mixed step, a decode step; outputs and states. Under the interpreter
    the CUDA ops run on CPU tensors."""
    from spindle.layers.mamba import gated_delta_net, gated_delta_triton, triton_ops

    hidden, heads, head_dim, slots = 32, 2, 16, 4
    generator = torch.Generator().manual_seed(0)
    layer = KimiDeltaAttention(hidden_size=hidden, num_heads=heads, head_dim=head_dim,
                               conv_kernel=4, eps=1e-6, tp_group=TensorParallelGroup.single())
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))
        layer.A_log.copy_(torch.rand(heads, generator=generator) * 2.5)
        layer.o_norm.weight.add_(1.0)
    steps = [([5, 9], [0, 2], [False, False]), ([1, 6, 1], [2, 3, 0], [True, False, True]),
             ([1, 1, 1], [0, 2, 3], [True, True, True])]
    inputs = [torch.randn(sum(lens), hidden, generator=generator) for lens, _, _ in steps]

    def run(device):
        model = copy.deepcopy(layer).to(device)
        model.kv_cache = [torch.zeros(slots, 3 * heads * head_dim, 3, device=device),
                          torch.zeros(slots, heads, head_dim, head_dim, device=device)]
        outputs = []
        with torch.no_grad():
            for (lens, owned, has_init), x in zip(steps, inputs):
                with forward_context(_step(lens, owned, has_init, device)):
                    outputs.append(model(x.to(device)).cpu())
        return outputs, [state.cpu() for state in model.kv_cache]

    expected = run("cpu")
    if DEVICE == "cpu":  # (the interpreter: the CUDA ops on CPU tensors)
        monkeypatch.setattr(gated_delta_net, "_ops_for", lambda x: triton_ops)
        monkeypatch.setattr(gated_delta_net, "delta_ops_for", lambda x: gated_delta_triton)
    got = run(DEVICE)
    for want, have in zip([*expected[0], *expected[1]], [*got[0], *got[1]]):
        torch.testing.assert_close(have, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
