"""Where the Triton kernel tests (marked `kernel`) run.

On a CUDA device the kernels are compiled and the tests use their full shapes. Without
one they run on CPU tensors under Triton's interpreter, which executes every program of
a launch one after the other in numpy: about a thousand times slower, so the tests pick
small shapes there (`pick`) that still take the kernels' branches. Before such a test
runs, conftest sets TRITON_INTERPRET=1 and imports the kernel modules
(import_kernels_interpreted).

What the interpreter cannot check: bf16 (it truncates float32 -> bf16 instead of rounding
and multiplies bf16 dot operands as raw integers), CUDA graphs, and the memory ordering of
the split merges (its programs run one at a time). fp16 it computes like a GPU.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TypeVar

import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available()
DEVICE = "cpu" if INTERPRETED else "cuda"
# bf16 is the models' dtype on a GPU; fp16 stands in for it under the interpreter.
HALF = torch.float16 if INTERPRETED else torch.bfloat16

KERNEL_MODULES = ("spindle.layers.fused_kernels", "spindle.layers.skinny_gemm",
                  "spindle.attention.backends.triton_attn")

T = TypeVar("T")


def pick(gpu: T, interpreted: T) -> T:
    """The full-size parameters on a GPU, the small ones under the interpreter."""
    return interpreted if INTERPRETED else gpu


def import_kernels_interpreted() -> None:
    """Turn Triton's interpreter on and import the kernel modules (idempotent).

    Triton reads TRITON_INTERPRET when a function is decorated, its own library's
    (tl.sum, tl.cdiv, ...) included, and again while some of those run: so it is set
    before triton is first imported and stays set for the rest of this process (the
    CPU code paths never import triton; subprocesses inherit it unused). A module that
    earlier code imported with compiled kernels cannot run on CPU tensors: that is an
    error, not a silent skip."""
    loaded = [name for name in ("triton.language", *KERNEL_MODULES) if name in sys.modules]
    if loaded and os.environ.get("TRITON_INTERPRET") != "1":
        from triton import JITFunction

        compiled = [name for name in loaded if any(
            isinstance(obj, JITFunction) for obj in vars(sys.modules[name]).values())]
        if compiled:
            raise RuntimeError(f"{compiled} were imported with compiled Triton kernels before "
                               "the kernel tests: they cannot run under the interpreter (set "
                               "TRITON_INTERPRET=1 before anything imports triton)")
    os.environ["TRITON_INTERPRET"] = "1"
    for name in KERNEL_MODULES:
        importlib.import_module(name)
