"""Zamba2's shared transformer blocks as checkpoints hold them, and the configs spindle
refuses. (Greedy tokens and logprobs against transformers, chunked prefill, prefix hits,
TP=2 and sleep run with the other hybrids in test_hybrid_models.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from spindle import LLM, SamplingParams

SHAPE = dict(num_layers=6)  # hybrid layers 1, 3, 5: blocks 0, 1, 0
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60)), [3]]


def greedy(path) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), dtype="float32", device="cpu", max_model_len=128) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def rewritten(src, dst, edit) -> None:
    """A copy of checkpoint src at dst with its tensors passed through edit(dict)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_a_checkpoint_holding_each_shared_block_once_loads_the_same(tiny_model, tmp_path):
    """transformers' save_pretrained writes a tied block under its first hybrid layer
    only; the tokens are those of the checkpoint with every copy."""
    path = tiny_model("zamba2", **SHAPE)

    def drop_copies(tensors):
        copies = [n for n in tensors if n.startswith("model.layers.5.shared_transformer.")]
        assert copies
        for name in copies:
            del tensors[name]

    rewritten(path, tmp_path / "once", drop_copies)
    assert greedy(tmp_path / "once") == greedy(path)


def test_copies_of_a_shared_block_that_differ_are_refused(tiny_model, tmp_path):
    path = tiny_model("zamba2", **SHAPE)
    name = "model.layers.5.shared_transformer.feed_forward.down_proj.weight"

    def perturb(tensors):
        tensors[name] = tensors[name] + 1.0

    rewritten(path, tmp_path / "bad", perturb)
    with pytest.raises(ValueError, match=r"layers\.1\.shared_transformer\.feed_forward\."
                                        r"down_proj\.weight.*layers\.5\..*differ"):
        greedy(tmp_path / "bad")


@pytest.mark.parametrize("change, message", [
    (dict(num_key_value_heads=2), "use_shared_attention_adapter needs num_key_value_heads"),
    (dict(hidden_act="relu"), "hidden_act 'relu' is not supported"),
    (dict(layers_block_type=["linear_attention", "moe", "hybrid", "hybrid", "hybrid",
                             "hybrid"]), r"unknown layer types \['moe'\]"),
])
def test_configs_it_would_get_wrong_are_refused(tiny_model, tmp_path, change, message):
    path = tmp_path / "model"
    shutil.copytree(tiny_model("zamba2", **SHAPE), path)
    config = json.loads((path / "config.json").read_text())
    config.update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(path), dtype="float32", device="cpu", max_model_len=128)


@pytest.mark.parametrize("engine", [dict(block_size=16),
                                    dict(block_size=32, max_num_batched_tokens=16,
                                         enable_prefix_caching=False)])
def test_a_prompt_token_alone_in_its_step_is_computed_as_a_prompt_token(tiny_model, engine):
    """transformers (and mamba_ssm) clamp dt in the chunked scan of a prompt but not in
    a decode step. A prompt cut at a block boundary (prefix caching's state snapshot) or
    by a chunked-prefill budget can leave one prompt token to a step: it must still be
    computed as the prompt's. Prompts of 16k + 1 tokens, logprobs at 1e-4 of
    transformers' own generate (which the suite's float64-noise allowance would hide)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_generate_vs_hf import hf_greedy

    path = tiny_model("zamba2", num_layers=4)
    prompts = [[(7 * i + 3 * j) % 500 + 5 for j in range(n)] for i, n in enumerate((17, 33))]
    expected = hf_greedy(path, prompts, 10)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    with LLM(str(path), dtype="float32", device="cpu", max_model_len=128, **engine) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for (tokens, logprobs), out in zip(expected, outputs):
        assert list(out.outputs[0].token_ids) == tokens
        got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]
        assert max(abs(a - b) for a, b in zip(logprobs, got)) < 1e-4
