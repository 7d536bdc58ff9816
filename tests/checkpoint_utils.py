"""Helpers for tests that rewrite a tiny checkpoint's tensors (other names, other
layouts) and compare what spindle generates from it."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Callable

import torch

from spindle import LLM, SamplingParams

Tensors = dict[str, torch.Tensor]


def rewritten_checkpoint(source: Path, dest: Path, rewrite: Callable[[Tensors], Tensors]
                         ) -> Path:
    """A copy of the single-file checkpoint source at dest, its tensors rewrite(tensors)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    tensors = rewrite(load_file(str(dest / "model.safetensors")))
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def spindle_greedy(path: Path, prompts: list[list[int]], max_new: int = 8
                   ) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs, float32 on the CPU (hf_greedy's shape)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=0)
    with LLM(str(path), dtype="float32", device="cpu", max_model_len=128) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def same_tokens(expected, got) -> bool:
    return [tokens for tokens, _ in expected] == [tokens for tokens, _ in got]


def stacked_experts(tensors: Tensors, gate: str, up: str, down: str,
                    block: str = "feed_forward") -> Tensors:
    """The hub's experts one by one (...<block>.experts.E.<gate|up|down>.weight) as
    transformers' modules stack them (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]); the other tensors as they are."""
    out: Tensors = {}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    pattern = re.compile(rf"(.*\.{block}\.experts)\.(\d+)\.({gate}|{up}|{down})\.weight$")
    for name, tensor in tensors.items():
        match = pattern.match(name)
        if match is None:
            out[name] = tensor
        else:
            experts.setdefault(match[1], {})[(int(match[2]), match[3])] = tensor
    for stem, parts in experts.items():
        count = 1 + max(e for e, _ in parts)
        out[f"{stem}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[e, gate], parts[e, up]]) for e in range(count)])
        out[f"{stem}.down_proj"] = torch.stack([parts[e, down] for e in range(count)])
    return out
