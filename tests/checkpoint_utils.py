"""Helpers for tests that rewrite a tiny checkpoint's tensors (other names, other
layouts) and compare what spindle generates from it."""

from __future__ import annotations

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
