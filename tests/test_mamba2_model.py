"""spindle's Mamba2ForCausalLM against transformers' on tiny random Mamba2 checkpoints,
without the engine (the steps, caches and metadata of test_bamba_model.py, whose
helpers this reuses: a model with no attention layer simply ignores the attention
metadata). Float32, LOGIT_ATOL = 1e-4 as there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from spindle.forward_context import forward_context
from spindle.layers.mamba.mixer import GatedRMSNorm
from spindle.distributed.parallel_state import TensorParallelGroup
from test_bamba_model import (LOGIT_ATOL, Request, _single_thread, assign_cache_groups,  # noqa: F401
                              hf_logits, hf_model, random_prompt, run_steps, spindle_model,
                              worst_diff)

# The default tiny Mamba2; two groups with chunks shorter than the prompts (the norm
# still spans the whole width, as transformers'); odd heads and groups (3), a conv of
# width 3 without bias, biased projections, a tied head, a residual stream in the
# model's dtype and a time_step_limit that clamps (transformers' full forward clamps;
# its generate()'s single-step update does not, so that shape stays off generate()).
SHAPES = {
    "default": {},
    "g2-chunk8": dict(num_layers=3, n_groups=2, chunk_size=8),
    "h3g3-odd": dict(hidden_size=48, num_layers=3, num_heads=3, n_groups=3, state_size=8,
                     chunk_size=4, conv_kernel=3, use_conv_bias=False, use_bias=True,
                     tie_word_embeddings=True, residual_in_fp32=False,
                     time_step_limit=(0.002, 0.05)),
}


def test_packed_prefill_then_decode_matches_transformers(tiny_model):
    path = tiny_model("mamba2", **SHAPES["g2-chunk8"])
    model = spindle_model(path)
    prompts = [random_prompt(23, seed=1), random_prompt(9, seed=2)]
    requests = [Request(tokens=list(p), chunks=[len(p)], num_decode=8) for p in prompts]
    assert run_steps(model, requests) == 7
    worst = worst_diff(path, requests)
    assert worst < LOGIT_ATOL, f"max |logit diff| vs transformers = {worst:.3g}"
    for prompt, r in zip(prompts, requests):
        generated = hf_model(path).generate(torch.tensor([prompt]), max_new_tokens=8,
                                            do_sample=False)
        assert generated[0].tolist() == r.tokens


@pytest.mark.parametrize("shape", list(SHAPES))
def test_chunked_prefill_and_decode_match_transformers(tiny_model, shape):
    path = tiny_model("mamba2", **SHAPES[shape])
    model = spindle_model(path)
    plans = [(37, [16, 13, 8], 0), (20, [20], 1), (5, [3, 2], 3), (1, [1], 2), (11, [11], 0),
             (1, [1], 6), (3, [1, 1, 1], 6)]
    requests = [Request(tokens=random_prompt(n, seed=10 + i), chunks=list(chunks),
                        start_step=start, num_decode=5)
                for i, (n, chunks, start) in enumerate(plans)]
    assert run_steps(model, requests, block_size=8, seed=3) > 0
    worst = worst_diff(path, requests)
    assert worst < LOGIT_ATOL, f"max |logit diff| vs transformers = {worst:.3g}"


def test_only_state_layers_cache(tiny_model):
    model = spindle_model(tiny_model("mamba2", **SHAPES["h3g3-odd"]))
    attention, mixers = assign_cache_groups(model)
    assert attention == [] and len(mixers) == 3
    # conv channels: x (3 heads * 32) + B + C (3 groups * 8 each); kernel 3 keeps 2 inputs
    assert mixers[0].cache_spec(torch.float32).shapes == ((96 + 2 * 24, 2), (3, 32, 8))


def test_original_embedding_name_loads(tiny_model, tmp_path):
    """state-spaces checkpoints spell it backbone.embedding (transformers renames it)."""
    path = Path(shutil.copytree(tiny_model("mamba2"), tmp_path / "ckpt"))
    weights = load_file(str(path / "model.safetensors"))
    weights["backbone.embedding.weight"] = weights.pop("backbone.embeddings.weight")
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    prompt = random_prompt(12, seed=6)
    with torch.no_grad(), forward_context(None):
        model = spindle_model(path)
        logits = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt))))
    torch.testing.assert_close(logits, hf_logits(tiny_model("mamba2"), prompt),
                               atol=LOGIT_ATOL, rtol=0)


def test_unsupported_configs_are_refused(tiny_model, tmp_path):
    path = Path(shutil.copytree(tiny_model("mamba2"), tmp_path / "ckpt"))
    original = json.loads((path / "config.json").read_text())
    for change, message in [({"hidden_act": "gelu"}, "hidden_act"),
                            ({"num_heads": 3}, "num_heads"),
                            ({"time_step_limit": [0.5, 0.1]}, "time_step_limit")]:
        (path / "config.json").write_text(json.dumps({**original, **change}))
        with pytest.raises(ValueError, match=message):
            spindle_model(path)


# ----------------------------------------------------------------------------- group-wise gated norm
def test_group_wise_gated_norm_equals_transformers_zamba2_norm():
    """group_size: the mean square per group of consecutive features, as transformers'
    Zamba2RMSNormGated (NemotronH's norm); None: over the whole width."""
    from transformers.models.zamba2.modeling_zamba2 import Zamba2RMSNormGated

    torch.manual_seed(0)
    width, groups = 24, 3
    x, gate = torch.randn(5, width), torch.randn(5, width)
    single = TensorParallelGroup.single()
    for group_size in (width // groups, None):
        ours = GatedRMSNorm(width, width, 1e-5, single, [(0, width)], group_size=group_size)
        ours.weight.data.copy_(1.0 + 0.2 * torch.randn(width))
        theirs = Zamba2RMSNormGated(width, group_size=group_size or width, eps=1e-5)
        theirs.weight.data.copy_(ours.weight)
        torch.testing.assert_close(ours(x, gate), theirs(x, gate), atol=1e-6, rtol=0)
    grouped = GatedRMSNorm(width, width, 1e-5, single, [(0, width)], group_size=8)
    whole = GatedRMSNorm(width, width, 1e-5, single, [(0, width)])
    assert (grouped(x, gate) - whole(x, gate)).abs().max() > 1e-2


def test_group_wise_gated_norm_needs_whole_groups_per_rank():
    """Two ranks of a 16-wide norm (8 each) cannot hold groups of 16 (one group, TP 2)."""
    rank0 = TensorParallelGroup(rank=0, size=2, group=None)
    with pytest.raises(ValueError, match="group size"):
        GatedRMSNorm(8, 16, 1e-5, rank0, [(0, 8)], group_size=16)
