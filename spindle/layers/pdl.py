"""Programmatic dependent launch (PDL) for the decode path's Triton kernels (Hopper on).

Launched with PDL, a kernel may be placed on the GPU while the kernel before it in the
stream still runs. Each program of such a kernel first lets the kernel after it be
launched (gdc_launch_dependents), then waits until the kernel before it has finished
and its writes are visible (gdc_wait), and only then reads or writes anything. So the
launch and ramp-up of each kernel overlap the one before; at batch 1 a decode step is
some 200 kernels of a few microseconds each, where that overhead is a large share.

A kernel may split enter() into release() and wait() and read, in between, what no
kernel of the chain writes: the skinny GEMM loads its first weight tile there, and
decode attention its first tile of cached keys and values (the cache below the new
token was written by earlier steps). Those loads then overlap the previous kernel's
tail: batch-1 decode 983 -> 1,090 tok/s on an H200 (docs/benchmarks.md).

A launch site passes **kernel_args(device, rows): the kernel's PDL constexpr (for enter())
and, where PDL is on, the launch_pdl keyword. Only kernels that call enter() may be
launched that way: one that reads before waiting could see its predecessor's
half-written output. A kernel launched without PDL waits for its predecessor as usual,
whatever that one did.

It applies to launches of at most max_rows() rows (tokens or requests), on CUDA devices
of compute capability 9.0 and later. Measured on an H200 (docs/benchmarks.md): decode
graphs of 1 to 8 requests replay 9-12% faster with it; from 16 requests, where cuBLAS
GEMMs (which do not take part) sat between these kernels instead of the skinny Triton
GEMM, 1.5-3.6% slower. So the limit is the skinny GEMM's: SPINDLE_SKINNY_MAX_M moves
both. SPINDLE_PDL=0 switches it off.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from spindle.switches import integer, on_off

try:  # (Triton 3.4 and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GDC = True
except ImportError:
    HAVE_GDC = False

    @triton.jit
    def gdc_launch_dependents():  # never called: enabled() is False without them
        pass

    @triton.jit
    def gdc_wait():
        pass

SWITCH_ENV = "SPINDLE_PDL"
MAX_ROWS_ENV = "SPINDLE_SKINNY_MAX_M"
DEFAULT_MAX_ROWS = 16
_KERNEL_MAX_ROWS = 256  # (skinny_gemm.MAX_M: the most rows its kernel takes)


def enabled(device: torch.device) -> bool:
    """Whether kernels for device launch with PDL: switched on, a Triton that has it,
    and a GPU that has it."""
    return (on_off(SWITCH_ENV, True) and HAVE_GDC and device.type == "cuda"
            and capability(device) >= (9, 0))


def max_rows() -> int:
    """The most rows of a PDL launch, which is also the most rows for which the engine's
    linear layers take the skinny GEMM (layers/skinny_gemm.py): above it they are cuBLAS,
    which takes no part in the chain. SPINDLE_SKINNY_MAX_M, 1 to 256; default
    DEFAULT_MAX_ROWS. (Asked at every launch: the setting's text is parsed once.)"""
    return _parsed_max_rows(os.environ.get(MAX_ROWS_ENV, ""))


@functools.lru_cache(maxsize=8)
def _parsed_max_rows(raw: str) -> int:
    return integer(MAX_ROWS_ENV, raw, 1, _KERNEL_MAX_ROWS) if raw else DEFAULT_MAX_ROWS


def launch_options(device: torch.device) -> Mapping[str, bool]:
    """The extra launch keywords for device: launch_pdl where enabled(device), else none."""
    return _PDL_OPTIONS if enabled(device) else _NO_OPTIONS


def kernel_args(device: torch.device, rows: int | None) -> Mapping[str, bool]:
    """What a launch site of rows rows (tokens or requests) passes a kernel that calls
    enter(PDL): the constexpr and the launch keywords. rows None: PDL wherever it is
    enabled, whatever the rows (a kernel whose variant must not depend on the row
    count, or one would compile after warm-up). (Called at every launch.)"""
    within = rows is None or rows <= max_rows()
    return _PDL_ARGS if within and enabled(device) else _NO_PDL_ARGS


_NO_OPTIONS: Mapping[str, bool] = MappingProxyType({})
_PDL_OPTIONS: Mapping[str, bool] = MappingProxyType({"launch_pdl": True})
_NO_PDL_ARGS: Mapping[str, bool] = MappingProxyType({"PDL": False})
_PDL_ARGS: Mapping[str, bool] = MappingProxyType({"PDL": True, **_PDL_OPTIONS})


@functools.lru_cache(maxsize=None)
def capability(device: torch.device) -> tuple[int, int]:
    """device's CUDA compute capability, asked of the driver once."""
    return torch.cuda.get_device_capability(device)


@triton.jit
def enter(PDL: tl.constexpr):
    """A PDL kernel's first step: let the next kernel launch, then wait for the last."""
    release(PDL)
    wait(PDL)


@triton.jit
def release(PDL: tl.constexpr):
    """Let the next kernel launch (enter's first half). A kernel may read, between
    release() and wait(), what no kernel of the chain writes (its weights, or inputs
    copied in before the chain's first kernel), and nothing else."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait until the kernel before has finished and its writes are visible (enter's
    second half)."""
    if PDL:
        gdc_wait()
