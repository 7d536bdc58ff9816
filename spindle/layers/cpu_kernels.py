"""Fused CPU kernels for bf16 decoder layers (spindle/csrc/cpu_kernels.cpp).

On a small CPU every eager torch op costs 5-15 us of dispatch, and a decoder layer's
norms, rotary embedding, KV store and single-query attention are some twenty of them:
on SmolLM2-135M that was as much time per decode step as every matmul together. The C++
file does each stage in one call and rounds to bf16 where the torch version rounds:

* rms_norm(x, weight, eps, residual=None): optional residual add, then RMSNorm;
* silu_and_mul(x): silu(gate) * up;
* qk_norm_rope_(q, k, ...): per-head q/k RMSNorm (Qwen3), the rotary embedding in
  place, and the KV store;
* decode_attention(q, caches, block tables, ...): one query per request over its paged
  context (window and soft cap included);
* decode_layer(...): a whole Llama-family layer on a decode step, the above and the
  layer's four matmuls (torch's int4 kernel or bf16_linear) in one call
  (models/llama.py, LlamaDecoderLayer.cpu_decode);
* bf16_linear(x, weight, bias): x @ W^T for a few bf16 rows (a decode step's
  batch, up to 32) with AVX-512 BF16 pair products, the layers' GEMM there (in
  decode_layer and in linear.apply_linear);
* int8_group_matmul(x, codes, scale, offset): float32 logits from a GGUF model's LM
  head held as int8 codes with float32 group scales and offsets (layers/int8_head.py;
  x float32 or bf16);
* fp8_matmul(x, codes): float32 products of a few rows with a float8 e4m3fn weight
  (layers/fp8.py's CPU linear layers; torch's float8 GEMM was about 14x slower than
  float32 there).

Only bf16 goes through the others. float32 keeps torch's ops, whose sums match transformers'
bit for bit (the float32 comparisons with it rely on that).

The file is compiled once per machine (``-march=native``, with torch's headers, which
needs a C++ compiler and ninja) into the user cache, keyed by its source, torch and the
CPU, and loaded from there afterwards; ``python -m spindle.layers.cpu_kernels`` builds it
ahead (scripts/install.sh does). ``SPINDLE_CPU_KERNELS=0`` turns them off (the torch ops
then run); if the build fails the torch ops run and the reason is logged once.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from spindle.switches import on_off

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_kernels.cpp"
SWITCH_ENV = "SPINDLE_CPU_KERNELS"
CACHE_ENV = "SPINDLE_CPU_KERNELS_DIR"


class CPUKernelsUnavailable(RuntimeError):
    """The C++ kernels could not be built or loaded (the message says why)."""


def switched_on() -> bool:
    return on_off(SWITCH_ENV, True)


def applies(x: torch.Tensor) -> bool:
    """Whether x's layer runs through the fused kernels: a bf16 CPU tensor, the kernels
    switched on and built."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and switched_on()
            and available())


@functools.cache
def available() -> bool:
    """Built or loaded once per process; a failure is logged and the torch ops run."""
    try:
        kernels()
        return True
    except CPUKernelsUnavailable as e:
        logger.warning("fused CPU kernels unavailable, bf16 layers use torch ops: %s", e)
        return False


@functools.cache
def kernels() -> ModuleType:
    """The compiled module (built here first if this machine has none yet)."""
    directory = build_directory()
    library = directory / f"{module_name()}.so"
    if not library.exists():
        build(directory)
    return _import(library)


def module_name() -> str:
    return f"spindle_cpu_kernels_{_key()[:12]}"


def build_directory() -> Path:
    if os.environ.get(CACHE_ENV):
        root = Path(os.environ[CACHE_ENV]).expanduser()
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = Path(base) / "spindle" / "cpu_kernels"
    return root / _key()


def _key() -> str:
    """What the compiled file depends on: its source, torch, Python and this CPU."""
    parts = [SOURCE.read_bytes(), torch.__version__.encode(), sys.version.encode(),
             platform.machine().encode(), _cpu_model().encode(),
             torch.backends.cpu.get_cpu_capability().encode(), " ".join(_flags()).encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:32]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _flags() -> list[str]:
    """-march=native, and ATen's vector types at the width torch itself runs here."""
    flags = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX512", "AVX2"):
        flags += [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    return flags


def build(directory: Path) -> None:
    """Compile the source into directory (cpp_extension's lock keeps concurrent
    builders, e.g. tensor-parallel workers, from colliding)."""
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    _put_ninja_on_path()
    start = time.perf_counter()
    logger.info("building the fused CPU kernels into %s (once per machine)", directory)
    try:
        cpp_extension.load(name=module_name(), sources=[str(SOURCE)], extra_cflags=_flags(),
                           build_directory=str(directory), verbose=False)
    except Exception as e:  # (a compiler error, no compiler, no ninja)
        raise CPUKernelsUnavailable(f"{type(e).__name__}: {str(e).strip()[-2000:]}") from e
    logger.info("fused CPU kernels built in %.1f s", time.perf_counter() - start)


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the ninja package (a dependency) has its
    binary where PATH may not look (a virtual environment not activated)."""
    try:
        import ninja
    except ImportError:
        return
    directory = getattr(ninja, "BIN_DIR", None)
    if directory and directory not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = directory + os.pathsep + os.environ.get("PATH", "")


def _import(library: Path) -> ModuleType:
    name = library.stem
    if name in sys.modules:
        return sys.modules[name]
    try:
        loader = importlib.machinery.ExtensionFileLoader(name, str(library))
        spec = importlib.util.spec_from_file_location(name, library, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as e:
        raise CPUKernelsUnavailable(f"cannot load {library}: {e}") from e
    sys.modules[name] = module
    return module


# ---------------------------------------------------------------- the kernels

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """x [T, H] -> y, or (y, residual + x) when residual is given."""
    outs = kernels().rms_norm(x, weight, eps, residual)
    return outs[0] if residual is None else (outs[0], outs[1])


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return kernels().silu_and_mul(x)


def qk_norm_rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                  q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                  v: torch.Tensor | None = None, kv_cache: torch.Tensor | None = None,
                  slot_mapping: torch.Tensor | None = None) -> None:
    """fused_kernels.qk_norm_rope_'s contract, on the CPU: in place on q [T, Hq, D] and
    k [T, Hk, D]; with kv_cache [2, blocks, block_size, Hk, D] also stores k and v."""
    key_cache = value_cache = None
    if kv_cache is not None:
        flat = (-1, kv_cache.shape[3], kv_cache.shape[4])
        key_cache, value_cache = kv_cache[0].view(flat), kv_cache[1].view(flat)
        slot_mapping = slot_mapping.to(torch.int64)
    kernels().qk_norm_rope_(q, k, positions.to(torch.int64), cos_cache, sin_cache, q_weight,
                            k_weight, eps, v, key_cache, value_cache, slot_mapping)


def decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                     scale: float, window: int | None = None,
                     soft_cap: float | None = None) -> torch.Tensor:
    """q [B, H, D], one query per request (row b: block_tables[b], seq_lens[b], int32),
    caches [slots, Hk, D] -> [B, H, D]."""
    return kernels().decode_attention(q, key_cache, value_cache, block_tables, seq_lens,
                                      block_size, scale, window or 0, soft_cap or 0.0)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a bf16 x [M, K] and weight [N, K]: up to 32 rows (a decode step's
    batch) with AVX-512 BF16 pair products read straight from the weight as stored,
    float32 sums (plus the bias) rounded once to bf16; torch's GEMM otherwise, or
    where the CPU lacks those instructions. SPINDLE_CPU_BF16_GEMM=0 sends every call to
    torch's GEMM (read once per process)."""
    return kernels().bf16_linear(x, weight, bias)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """bf16 x [M, K] @ W^T -> bf16 [M, N] for W in torch's packed CPU int4 layout
    (packed uint8 [N, K / 2], scale_zero bf16 [K / 32, N, 2]: w = (q - 8) * s + z; see
    layers/int4.py): up to 32 rows, with N a multiple of 64, a kernel of its own that
    reads torch's layout (the layout is checked once per process against torch's kernel),
    float32 sums rounded once to bf16; torch's _weight_int4pack_mm_for_cpu otherwise.
    SPINDLE_CPU_INT4_GEMM=0 sends every call to torch's kernel (read once per process)."""
    return kernels().int4_linear(x, packed, scale_zero)


def int8_group_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                      offset: torch.Tensor) -> torch.Tensor:
    """x [M, K] (float32 or bf16) @ W^T -> float32 [M, N], W [N, K] held as int8 codes
    with a float32 scale and offset [N, K / 32] per group of 32 columns (w = scale *
    code + offset, int4.GroupQuantized); accumulated in float32 (the LM head of a GGUF
    model: layers/int8_head.py)."""
    return kernels().int8_group_matmul(x, codes, scale, offset)


def fp8_matmul(x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """float32 x [M, K] @ W^T -> float32 [M, N] for W [N, K] given as its float8 e4m3fn
    bits (a uint8 view), no scales: layers/fp8.py's CPU product of a few rows, with K a
    multiple of the vector width (16 covers every CPU)."""
    return kernels().fp8_matmul(x, codes)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for a float32 or bf16 CPU x [B, V], V > 0: int64 [B],
    each row's first maximum (its first NaN, if it has one)."""
    return kernels().argmax_rows(x)


def argmax_applies(x: torch.Tensor) -> bool:
    """Whether argmax_rows serves x: float32 or bf16 [B, V > 0] on the CPU, the
    kernels on."""
    return (x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu"
            and x.dim() == 2 and x.shape[1] > 0 and switched_on() and available())


def linear_args(layer) -> tuple | None:
    """A linear layer (layers/linear.py) as decode_layer takes it, (weight, scale_zero,
    planes, bias): its packed int4 weight, or a dense bf16 one; None for anything else
    (float8, batch-invariant). (Its LoRA slots, where it has them, are not read: a step
    with adapters does not call decode_layer.)"""
    if layer.int4 is not None:
        return layer.weight, layer.weight_scale_zero, layer.int4.planes, layer.bias
    if (layer.weight_scale is None and layer.weight.dtype == torch.bfloat16
            and not layer.batch_invariant):
        return layer.weight, None, 0, layer.bias
    return None


def main() -> None:
    """python -m spindle.layers.cpu_kernels: build (or find) the kernels, say where."""
    if not switched_on():
        print(f"{SWITCH_ENV}=0: not building")
        return
    try:
        module = kernels()
    except CPUKernelsUnavailable as e:
        print(f"fused CPU kernels not built (bf16 on the CPU will use torch ops): {e}")
        return
    print(f"fused CPU kernels: {module.__file__}")


if __name__ == "__main__":
    main()
