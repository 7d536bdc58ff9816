"""The demo model shipped in the package (spindle/demo_model): transformers loads it,
and spindle's greedy completions equal transformers' (CPU, float32)."""

from __future__ import annotations

import json

import pytest
import torch

from spindle import LLM, SamplingParams
from spindle.entrypoints.cli import default_model_dir

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef ", "class Stack:\n"]
MAX_NEW = 48


@pytest.fixture(scope="module")
def demo_dir():
    return default_model_dir()


def test_demo_model_is_a_small_half_precision_hf_checkpoint(demo_dir):
    files = {p.name for p in demo_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= files
    assert sum(p.stat().st_size for p in demo_dir.iterdir()) <= 20 * 2**20
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] in ("float16", "bfloat16")
    assert config["max_position_embeddings"] >= 512


def _hf_greedy(model_dir, prompts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy completion ids) per prompt; generation stops at EOS like spindle."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt_ids, completions = [], []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_NEW)
        prompt_ids.append(ids[0].tolist())
        completions.append(out[0, ids.shape[1]:].tolist())
    return prompt_ids, completions


def test_greedy_completions_equal_transformers(demo_dir):
    hf_prompts, hf_completions = _hf_greedy(demo_dir, PROMPTS)
    llm = LLM(str(demo_dir), device="cpu", dtype="float32", seed=0)
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
                               use_tqdm=False)
    finally:
        llm.shutdown()
    eos = {1, 4}  # generation_config: <|eos|>, <|im_end|>
    for prompt, ids, hf_ids, out in zip(PROMPTS, hf_prompts, hf_completions, outputs):
        assert out.prompt_token_ids == ids, prompt
        ours = list(out.outputs[0].token_ids)
        assert ours == hf_ids[:len(ours)], prompt
        # Either both ran to max_tokens, or both stopped at the same EOS token.
        assert len(ours) == len(hf_ids) or (ours and ours[-1] in eos), prompt


def test_completions_look_like_python(demo_dir):
    llm = LLM(str(demo_dir), device="cpu", dtype="auto", seed=0)
    try:
        assert llm.engine.config.model.dtype == torch.float32  # float16 on CPU -> float32
        out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0.0, max_tokens=32),
                           use_tqdm=False)
    finally:
        llm.shutdown()
    text = out[0].outputs[0].text
    assert "\n    " in text, text  # indented lines
    assert any(word in text for word in ("return", "def ", "if ", "for ")), text
