"""Build a model from its config and stream its safetensors checkpoint into it."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import nn

from spindle.config import ModelConfig
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.layers.fp8 import quantize_linear_layers
from spindle.layers.int4 import finish_loading
from spindle.models.fp8_checkpoint import FLOAT8_DTYPES, iter_dequantized
from spindle.models.registry import resolve_model_class
from spindle.models.weights import with_dependents

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"

logger = logging.getLogger(__name__)


def load_model(model_config: ModelConfig, device: torch.device,
               tp_group: TensorParallelGroup, stage: PipelineStage | None = None) -> nn.Module:
    """The model of model_config on device, in model_config.dtype, holding this rank's
    shard of every weight, in eval mode.

    Raises ValueError for an unsupported architecture, a checkpoint that is not
    safetensors, an unreadable shard (naming the file), or parameters the checkpoint
    does not provide (listing them).
    """
    hf_config = model_config.hf_config
    model_class = resolve_model_class(getattr(hf_config, "architectures", None))
    dummy = model_config.load_format == "dummy"
    gguf = model_config.quantization == "gguf"
    files = [] if dummy or gguf else checkpoint_files(Path(model_config.model))
    with _default_dtype(model_config.dtype), torch.device(device):
        if stage is None or stage.size == 1:
            model = model_class(hf_config, tp_group)
        elif getattr(model_class, "supports_pipeline_parallel", False):
            model = model_class(hf_config, tp_group, stage)  # only this stage's layers
        else:
            raise ValueError(f"{model_class.__name__} does not support pipeline_parallel_size > 1")
        if model_config.quantization == "fp8":
            quantize_linear_layers(model, torch.device(device))
    if dummy:
        fill_dummy_weights(model, model_config.seed)
        return model.eval()
    if gguf:
        loaded = _load_gguf(model, model_config, tp_group, stage or PipelineStage.single())
    else:
        loaded = load_into(model, model_checkpoint(files, model_config))
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if missing:
        raise ValueError(f"checkpoint {model_config.model} does not provide {len(missing)} "
                         f"parameter(s) of {type(model).__name__}: {', '.join(missing)}")
    return model.eval()


@torch.no_grad()
def reload_checkpoint(model: nn.Module, model_config: ModelConfig) -> None:
    """Copy model_config's checkpoint into model's existing parameters (same tensors,
    same addresses); RuntimeError naming the parameters it left unloaded."""
    if model_config.load_format == "dummy":
        fill_dummy_weights(model, model_config.seed)
        return
    if model_config.quantization == "gguf":
        from spindle.models.gguf_weights import GGUFWeights

        weights = GGUFWeights(model_config.gguf_file, model_config.hf_config).items(
            model_config.dtype)
    else:
        weights = model_checkpoint(checkpoint_files(Path(model_config.model)), model_config)
    loaded = load_into(model, weights)
    missing = [n for n, _ in model.named_parameters() if n not in loaded]
    if missing:
        raise RuntimeError(f"reloading {model_config.model} left {len(missing)} "
                           f"parameter(s) unloaded: {', '.join(missing[:5])}")


def load_into(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """model.load_weights(weights), then the int4 weights packed (layers/int4.py):
    every load, reload and weight update goes through here. Returns the names of the
    parameters completely loaded. For the text model of an image-text checkpoint
    (config ``text_model_of``), its language model's tensors in the text model's names."""
    if getattr(getattr(model, "config", None), "text_model_of", None):
        weights = text_model_tensors(weights)
    loaded = model.load_weights(weights)
    if finish_loading(model):  # (their scales are parameters only from now on)
        loaded = with_dependents(model, loaded)
    return loaded


# Where image-text checkpoints keep their language model (transformers' names, and the
# hub's older ones), and what else they hold that a text model leaves out.
_LANGUAGE_MODEL_PREFIXES = (("model.language_model.", "model."),
                            ("language_model.model.", "model."),
                            ("language_model.lm_head.", "lm_head."))
_NOT_TEXT_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.",
                      "model.vision_model.", "vision_model.",
                      "model.multi_modal_projector.", "multi_modal_projector.",
                      "model.image_newline", "image_newline")


def text_model_tensors(weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """An image-text checkpoint's tensors as its text model names them: the language
    model's renamed, the vision tower's and the projector's left out, the rest (the LM
    head, multi-token-prediction layers) as they are."""
    for name, tensor in weights:
        if name.startswith(_NOT_TEXT_PREFIXES):
            continue
        for theirs, ours in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(theirs):
                name = ours + name[len(theirs):]
                break
        yield name, tensor


def _load_gguf(model: nn.Module, model_config: ModelConfig, tp_group: TensorParallelGroup,
               stage: PipelineStage) -> set[str]:
    """quantization='gguf': this rank's weights from the packed-weight cache when it
    matches (models/packed_cache.py), else from the file, then cached."""
    from spindle.models import packed_cache

    weights = _gguf_weights(model, model_config)  # (chooses the int4 layers; read lazily)
    place = f"tp{tp_group.rank}of{tp_group.size}-pp{stage.rank}of{stage.size}"
    path = packed_cache.cache_file(model_config.model, model_config.gguf_file,
                                   model_config.dtype, place)
    if packed_cache.load(model, path):
        logger.info("gguf: packed weights read from %s", path)
        return {name for name, _ in model.named_parameters()}
    loaded = load_into(model, weights)
    packed_cache.save(model, path)
    return loaded


def _gguf_weights(model: nn.Module, model_config: ModelConfig):
    """quantization='gguf': the GGUF file's tensors, the model's linear layers made int4
    where theirs are group-quantized (models/gguf_weights.py)."""
    from spindle.models.gguf_weights import GGUFWeights, use_int4_where_quantized

    if not hasattr(model, "param_name"):
        raise ValueError(f"quantization='gguf' reads Llama-family models; "
                         f"{type(model).__name__} is not one (quantization='none' reads the "
                         "file dequantized)")
    weights = GGUFWeights(model_config.gguf_file, model_config.hf_config)
    dense = use_int4_where_quantized(model, weights)
    if dense:
        logger.info("gguf: %d layer(s) kept in %s, not int4: %s", len(dense),
                    str(model_config.dtype).removeprefix("torch."), "; ".join(dense))
    return weights.items(model_config.dtype)


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    """load_format="dummy": every parameter drawn from a generator seeded by seed and
    its position, so a reload draws the same values. Norm weights are ones, float8
    weights standard normal with scales (``loaded_with`` parameters) of 0.02, the
    rest normal with std 0.02: values of a model's usual scale, for benchmarks."""
    for index, (name, param) in enumerate(model.named_parameters()):
        gen = torch.Generator(device=param.device).manual_seed(seed * 1_000_003 + index)
        module = name.rpartition(".")[0].rpartition(".")[2]
        if "norm" in module:  # input_layernorm, q_norm, norm, ...
            param.fill_(1.0)
        elif getattr(param, "loaded_with", None) is not None:
            param.fill_(0.02)
        elif param.dtype in FLOAT8_DTYPES:
            draw = torch.empty(param.shape, dtype=torch.bfloat16, device=param.device)
            param.copy_(draw.normal_(0.0, 1.0, generator=gen))
        elif param.is_floating_point():
            param.normal_(0.0, 0.02, generator=gen)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, else model.safetensors,
    else every *.safetensors file of the directory."""
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ValueError(f"{index} names shard {f.name}, which does not exist")
        return files
    if (model_dir / SAFETENSORS_SINGLE).is_file():
        return [model_dir / SAFETENSORS_SINGLE]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}: only safetensors checkpoints "
                         "are supported (convert .bin/.pt weights with transformers' "
                         "save_pretrained(safe_serialization=True))")
    return files


def model_checkpoint(files: list[Path],
                     model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """model_config's checkpoint tensors as the model loads them: float8 weights
    dequantized (fp8_checkpoint.py), everything else cast to the model's dtype."""
    if model_config.fp8_checkpoint is not None:
        return iter_dequantized(files, model_config.fp8_checkpoint, model_config.dtype)
    return iter_checkpoint(files, model_config.dtype)


def iter_checkpoint(files: list[Path], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one tensor at a time (memory-mapped reads, so at most about
    one tensor is materialised beyond the model itself), cast to dtype. A float8 tensor
    is refused: without the config's quantization scheme its scale is unknown."""
    from safetensors import safe_open

    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    if tensor.dtype in FLOAT8_DTYPES:
                        raise ValueError(f"tensor {name} is float8, but config.json declares "
                                         "no quantization_config for its scales")
                    if tensor.is_floating_point() and tensor.dtype != dtype:
                        tensor = tensor.to(dtype)
                    yield name, tensor
        except Exception as e:  # safetensors raises its own error types for bad files
            raise ValueError(f"cannot read checkpoint shard {path}: {e}") from e


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
