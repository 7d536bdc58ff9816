"""load_format="dummy": random weights from config.json alone (for benchmarks of shapes
without a checkpoint), drawn the same way every time, a sleep-level-2 reload
included; and a bad load_format named."""

from __future__ import annotations

import shutil

import pytest

from spindle import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [1, 2, 3, 4]}, {"prompt_token_ids": [9, 8, 7]}]


@pytest.fixture
def config_only(tiny_model, tmp_path):
    path = tmp_path / "no-weights"
    shutil.copytree(tiny_model("qwen3_moe"), path)
    (path / "model.safetensors").unlink()
    return path


def tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_dummy_weights_are_the_same_every_time(config_only):
    with LLM(str(config_only), device="cpu", load_format="dummy",
             enable_sleep_mode=True) as llm:
        first = tokens(llm)
        llm.sleep(2)  # the reload draws the weights again
        llm.wake_up()
        assert tokens(llm) == first
    with LLM(str(config_only), device="cpu", load_format="dummy") as llm:
        assert tokens(llm) == first
    with LLM(str(config_only), device="cpu", load_format="dummy", seed=1) as llm:
        assert tokens(llm) != first  # the seed draws other weights


def test_without_dummy_the_missing_weights_are_an_error(config_only):
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        LLM(str(config_only), device="cpu")
    with pytest.raises(ValueError, match="load_format.*one of \\('auto', 'dummy'\\)"):
        LLM(str(config_only), device="cpu", load_format="pt")
