"""Where the Triton kernel tests (marked `kernel`) run.

On a CUDA device the kernels are compiled and the tests use their full shapes. Without
one they run on CPU tensors under Triton's interpreter, which executes every program of
a launch one after the other in numpy: about a thousand times slower, so the tests pick
small shapes there (`pick`) that still take the kernels' branches. conftest sets
TRITON_INTERPRET=1 when there is no GPU, and imports the kernel modules before such a
test runs (import_kernels_interpreted).

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
                  "spindle.layers.invariant_gemm", "spindle.layers.fused_moe",
                  "spindle.attention.backends.triton_attn", "spindle.layers.mamba.triton_ops",
                  "spindle.layers.mamba.gated_delta_triton", "spindle.attention.cross_triton",
                  "spindle.lora.kernels", "spindle.runner.graph_advance",
                  "spindle.runner.sample.argmax_kernel")

T = TypeVar("T")


def pick(gpu: T, interpreted: T) -> T:
    """The full-size parameters on a GPU, the small ones under the interpreter."""
    return interpreted if INTERPRETED else gpu


class KernelStub:
    """Stands in for a Triton kernel (monkeypatched over the module's name): records
    each launch's grid and keyword arguments in ``launches``, then runs ``kernel`` (the
    real one) or, without it, nothing."""

    def __init__(self, kernel=None) -> None:
        self.kernel = kernel
        self.launches: list[tuple] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs))
            if self.kernel is not None:
                return self.kernel[grid](*args, **kwargs)
        return launch


def import_kernels_interpreted() -> None:
    """Import the kernel modules under Triton's interpreter (idempotent).

    conftest set TRITON_INTERPRET=1 before any test module was imported: Triton reads it
    when a function is decorated, its own library's (tl.sum, tl.cdiv, ...) included. A
    module that was imported with compiled kernels all the same cannot run on CPU
    tensors: that is an error, not a silent skip."""
    loaded = [name for name in ("triton.language", *KERNEL_MODULES) if name in sys.modules]
    if loaded:
        from triton import JITFunction

        compiled = [name for name in loaded if any(
            isinstance(obj, JITFunction) for obj in vars(sys.modules[name]).values())]
        if compiled:
            raise RuntimeError(f"{compiled} were imported with compiled Triton kernels: they "
                               "cannot run under the interpreter (TRITON_INTERPRET=1 must be "
                               "set before anything imports triton)")
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the kernel tests need TRITON_INTERPRET=1 without a GPU")
    for name in KERNEL_MODULES:
        importlib.import_module(name)
