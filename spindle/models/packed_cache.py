"""A cache of a GGUF model's weights as the CPU worker holds them (int4-packed matrices,
the rest dense), so that a later start reads them instead of decoding and packing the
file again: decoding and packing are most of a GGUF load (models/gguf_weights.py,
layers/int4.py).

One safetensors file per rank, in the model's converted directory (models/gguf.py, keyed
by the GGUF file already), under a name that hashes everything the packed bytes depend
on: the file's identity, the dtype, the rank's place, torch's version, the packed layout
this CPU gets (torch's int4 packing differs by instruction set), the form of the LM head
(int8 codes with the fused CPU kernels, layers/int8_head.py, else int4), the format's
version and the source of the code that decodes and packs. A file that does not match
the model exactly is ignored and the model loads from the GGUF file as without a cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from spindle.layers import int4, int8_head

logger = logging.getLogger(__name__)

DIRECTORY = "spindle-int4"
# What the file holds: 2 since the LM head (and a tied embedding) may be int8 codes with
# float32 group scales and offsets (layers/int8_head.py) instead of packed int4.
FORMAT_VERSION = 2
_PLANES_KEY = "int4_planes"


def cache_file(model_dir: str | os.PathLike, gguf_file: str | os.PathLike,
               dtype: torch.dtype, place: str) -> Path:
    """Where the packed weights of this rank are cached; place names the rank (e.g.
    "tp0of2-pp0of1") and starts the file's name, the hash of the rest ends it."""
    gguf = Path(gguf_file).resolve()
    stat = gguf.stat()
    head = "int8-head" if int8_head.enabled() else "int4-head"
    identity = "\0".join([str(gguf), str(stat.st_size), str(stat.st_mtime_ns), str(dtype),
                          torch.__version__, _layout_fingerprint(), _code_fingerprint(),
                          head, f"format {FORMAT_VERSION}"])
    digest = hashlib.sha256(identity.encode()).hexdigest()[:20]
    return Path(model_dir) / DIRECTORY / f"{place}-{digest}.safetensors"


def _layout_fingerprint() -> str:
    """A hash of a fixed probe matrix as this machine's torch packs it."""
    rows, cols = int4.ROW_MULTIPLE * 2, int4.GROUP * 2
    index = torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols)
    probe = (index * 7 + index // cols * 3) % 16
    return hashlib.sha256(int4.pack(probe).numpy().tobytes()).hexdigest()[:16]


def _code_fingerprint() -> str:
    """A hash of the decoding and packing code (a change to it retires old caches)."""
    from spindle.models import gguf_weights

    digest = hashlib.sha256()
    for module in (int4, int8_head, gguf_weights):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


def _int4_modules(model: nn.Module) -> dict[str, int4.Int4Weight]:
    return {name: module.int4 for name, module in model.named_modules()
            if isinstance(getattr(module, "int4", None), int4.Int4Weight)}


def save(model: nn.Module, path: Path) -> None:
    """Write model's parameters and int4 planes to path (atomically), removing the
    files of the same rank that other versions wrote; a failure to write is logged,
    not raised (the cache only saves time)."""
    from safetensors.torch import save_file

    tensors = {name: param.detach().contiguous() for name, param in model.named_parameters()}
    planes = {name: weight.planes for name, weight in _int4_modules(model).items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=path.parent)
        os.close(handle)
        try:
            save_file(tensors, staging, metadata={_PLANES_KEY: json.dumps(planes)})
            os.replace(staging, path)  # atomic: a reader sees all of it or nothing
        finally:
            if os.path.exists(staging):
                os.unlink(staging)
        place = path.name.rpartition("-")[0]
        for stale in path.parent.glob(f"{place}-*.safetensors"):
            if stale != path:
                stale.unlink(missing_ok=True)
    except (OSError, RuntimeError, ValueError) as e:  # (no room, read-only, shared storage)
        logger.warning("gguf: could not cache the packed weights in %s (%s)", path, e)


def load(model: nn.Module, path: Path) -> bool:
    """Fill model (its int4 layers chosen, nothing loaded yet) from the cache at path.
    False when there is none, it cannot be read or it does not match the model: the
    model then loads from the GGUF file, which writes every parameter again."""
    if not path.is_file():
        return False
    from safetensors import SafetensorError, safe_open

    params = dict(model.named_parameters())
    modules = _int4_modules(model)
    expected = set(params) | {f"{name}.weight_scale_zero" for name in modules}
    try:
        with safe_open(str(path), framework="pt") as f:
            planes = json.loads((f.metadata() or {}).get(_PLANES_KEY, "null"))
            if set(f.keys()) != expected or planes is None or set(planes) != set(modules):
                raise ValueError("its tensors are not this model's")
            tensors = {name: f.get_tensor(name) for name in expected}
        for name, param in params.items():
            if name.rpartition(".")[0] in modules and name.endswith(".weight"):
                continue  # (packed: adopt checks it)
            if tensors[name].shape != param.shape or tensors[name].dtype != param.dtype:
                raise ValueError(f"its {name} has another shape or dtype")
            with torch.no_grad():
                param.data.copy_(tensors[name])
        for name, weight in modules.items():
            weight.adopt(tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_zero"],
                         planes[name])
    except (OSError, SafetensorError, ValueError) as e:
        logger.info("gguf: not using the packed-weight cache %s (%s); loading the file",
                    path, e)
        return False
    return True
