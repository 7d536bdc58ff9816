"""A small GRPO loop: spindle does the rollouts, torch trains, the weights go back.

The policy is the built-in demo model (a 4M-parameter Llama trained on Python source).
The toy reward: 1 when the line the model completes parses as Python, else 0. Each
step:

  1. rollouts: for each prompt, a group of samples from spindle (temperature 1);
  2. the engine sleeps (its memory is the trainer's while it trains);
  3. GRPO: each sample's advantage is its reward less its group's mean, over the
     group's spread; one optimiser step on -advantage x the mean log-probability of
     the sample's tokens under the policy (transformers' LlamaForCausalLM, in torch);
  4. wake the weights alone, update_weights(policy.named_parameters()), wake the rest.

It prints the mean reward of each step's rollouts, which rises.

    python examples/grpo_demo.py [--steps 40] [--device cpu|cuda] [--json out.json]
        [--svg curve.svg]

On a GPU the trainer runs there too, and the engine sleeps with the cumem backend
(its weights go to host memory and its KV cache is released while the trainer
trains; addresses and CUDA graphs survive).
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import time
from pathlib import Path

import torch

DEMO_MODEL = Path(__file__).resolve().parent.parent / "spindle" / "demo_model"
PROMPTS = ["x = ", "import ", "for i in ", "if x ", "class ", "    return ", "def ",
           "print(", "while ", "y = x + "]


def reward(prompt: str, completion: str) -> float:
    """1.0 when the line the completion ends (the prompt's last line and the text up to
    the first newline) parses as Python; a line opening a block gets a body."""
    line = (prompt + completion).split("\n")[0].strip()
    if line.endswith(":"):
        line += "\n    pass"
    try:
        ast.parse(line)
    except (SyntaxError, ValueError):
        return 0.0
    return 1.0


def rollouts(llm, params, seed: int):
    """(prompt index, prompt ids, completion ids, reward) for every sample."""
    from spindle import SamplingParams

    sampling = SamplingParams(temperature=1.0, max_tokens=params.max_tokens, n=params.group,
                              seed=seed)
    samples = []
    for i, out in enumerate(llm.generate(PROMPTS, sampling, use_tqdm=False)):
        for completion in out.outputs:
            samples.append((i, out.prompt_token_ids, completion.token_ids,
                            reward(PROMPTS[i], completion.text)))
    return samples


def grpo_loss(policy, samples, group: int) -> torch.Tensor:
    """-advantage x mean token log-probability, averaged over the samples (on the
    policy's device)."""
    device = next(policy.parameters()).device
    rewards = torch.tensor([s[3] for s in samples]).view(-1, group)
    advantages = ((rewards - rewards.mean(1, keepdim=True))
                  / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
    width = max(len(p) + len(c) for _, p, c, _ in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.int64)
    attention = torch.zeros(len(samples), width, dtype=torch.int64)  # right padding
    mask = torch.zeros(len(samples), width)
    for row, (_, prompt, completion, _) in enumerate(samples):
        seq = list(prompt) + list(completion)
        ids[row, :len(seq)] = torch.tensor(seq)
        attention[row, :len(seq)] = 1
        mask[row, len(prompt):len(seq)] = 1.0  # the completion's tokens
    ids, attention, mask = ids.to(device), attention.to(device), mask.to(device)
    advantages = advantages.to(device)
    logits = policy(ids, attention_mask=attention).logits[:, :-1].float()
    token_logprobs = torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None]).squeeze(2)
    target_mask = mask[:, 1:]
    per_sample = (token_logprobs * target_mask).sum(1) / target_mask.sum(1).clamp(min=1)
    return -(advantages * per_sample).mean()


def run(args, llm):
    """Train for args.steps steps with llm doing the rollouts; the reward per step, and
    the trained policy (whose weights llm now holds)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    random.seed(0)
    # The trainer shares the engine's device: on a GPU it trains in the memory the
    # sleeping engine gave back, and update_weights copies device to device.
    policy = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).to(
        llm.engine.core.config.device.device_type)
    optimiser = torch.optim.Adam(policy.parameters(), lr=args.lr)
    curve = []
    for step in range(args.steps):
        start = time.perf_counter()
        samples = rollouts(llm, args, seed=step)
        mean_reward = sum(s[3] for s in samples) / len(samples)
        curve.append(mean_reward)
        llm.sleep(level=1)  # the trainer's turn
        policy.train()
        loss = grpo_loss(policy, samples, args.group)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        llm.wake_up(["weights"])
        llm.update_weights(policy.named_parameters(), version=step + 1)
        llm.wake_up()
        print(f"step {step:3d}  reward {mean_reward:.3f}  loss {loss.item():+.4f}  "
              f"weights v{llm.weight_version}  {time.perf_counter() - start:.1f} s", flush=True)
    return curve, policy.eval()


def rollout_engine(device: str = "auto"):
    from spindle import LLM

    return LLM(str(DEMO_MODEL), device=device, max_model_len=256, enable_sleep_mode=True,
               enable_prefix_caching=False)


def svg_curve(curve: list[float], path: Path) -> None:
    """The reward per step as a small SVG line chart (no plotting library needed)."""
    width, height, pad = 480, 240, 36
    xs = [pad + i * (width - 2 * pad) / max(1, len(curve) - 1) for i in range(len(curve))]
    ys = [height - pad - r * (height - 2 * pad) for r in curve]
    points = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys))
    path.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
        f'<rect width="100%" height="100%" fill="white"/>'
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" '
        f'stroke="black"/><line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" '
        f'stroke="black"/>'
        f'<text x="{pad - 6}" y="{height - pad + 4}" font-size="11" text-anchor="end">0</text>'
        f'<text x="{pad - 6}" y="{pad + 4}" font-size="11" text-anchor="end">1</text>'
        f'<text x="{width / 2}" y="{height - 8}" font-size="12" text-anchor="middle">'
        f'GRPO step (0-{len(curve) - 1})</text>'
        f'<text x="{width / 2}" y="20" font-size="13" text-anchor="middle">'
        f'mean reward of the rollouts (the completed line parses)</text>'
        f'<polyline points="{points}" fill="none" stroke="#1f6feb" stroke-width="2"/></svg>\n')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--group", type=int, default=16, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--svg", type=Path)
    args = parser.parse_args()
    with rollout_engine(args.device) as llm:
        curve, _ = run(args, llm)
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "reward": curve,
                                         "args": {k: str(v) for k, v in vars(args).items()}},
                                        indent=2))
    if args.svg:
        svg_curve(curve, args.svg)
    first, last = curve[:5], curve[-5:]
    print(f"mean reward, first 5 steps {sum(first) / len(first):.3f}, "
          f"last 5 steps {sum(last) / len(last):.3f}")


if __name__ == "__main__":
    main()
