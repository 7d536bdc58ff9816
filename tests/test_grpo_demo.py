"""The GRPO demo (examples/grpo_demo.py) in CI size: a few steps raise the reward, and
the rollout engine then holds exactly the trained policy (its greedy tokens are
transformers' on the policy)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

from spindle import SamplingParams

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "grpo_demo.py"


def load_example():
    spec = importlib.util.spec_from_file_location("grpo_demo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_few_grpo_steps_raise_the_reward_and_the_engine_holds_the_policy():
    demo = load_example()
    args = argparse.Namespace(steps=6, group=16, max_tokens=24, lr=3e-4, device="cpu")
    with demo.rollout_engine("cpu") as llm:
        curve, policy = demo.run(args, llm)
        assert llm.weight_version == 6
        assert sum(curve[-2:]) / 2 > curve[0] + 0.1, curve
        prompt = llm.get_tokenizer().encode("def ")
        ours = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16,
                                                    ignore_eos=True), use_tqdm=False)[0]
    with torch.no_grad():
        theirs = policy.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
    assert ours.outputs[0].token_ids == theirs[0, len(prompt):].tolist()


def test_reward_is_whether_the_completed_line_parses():
    demo = load_example()
    assert demo.reward("x = ", "1 + 2\nwhatever(") == 1.0
    assert demo.reward("x = ", ")(") == 0.0
    assert demo.reward("for i in ", "range(3):") == 1.0  # a block opener gets a body
    assert demo.reward("def ", "f(:") == 0.0
