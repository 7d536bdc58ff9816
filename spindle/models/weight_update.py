"""New weights for a loaded model: where they come from, and their check against the
model's checkpoint before anything is copied.

A source is a checkpoint directory (safetensors, read tensor by tensor) or a list of
(name, tensor) in Hugging Face naming, what a trainer's named_parameters() or
state_dict() gives. Either must fit the layout of the checkpoint the engine started
from: every name one of its tensors (or one the model derives instead of loading, such
as a tied LM head), of the same shape, floating point. The whole source is checked
first, so a bad one changes nothing; then it is streamed through the model's own
load_weights, one tensor at a time, into the existing parameters (their addresses,
and CUDA graphs reading them, stay valid).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from spindle.models.loader import checkpoint_files, iter_checkpoint

@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    floating: bool


def checkpoint_layout(model_dir: str | Path) -> dict[str, TensorSpec]:
    """Name -> shape (and whether floating point) of every tensor of a safetensors
    checkpoint, read from the files' headers only."""
    from safetensors import safe_open

    layout: dict[str, TensorSpec] = {}
    for path in checkpoint_files(Path(model_dir)):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    layout[name] = TensorSpec(tuple(piece.get_shape()),
                                              piece.get_dtype().startswith(("F", "BF")))
        except Exception as e:  # safetensors raises its own error types for bad files
            raise ValueError(f"cannot read checkpoint shard {path}: {e}") from e
    return layout


class WeightCheck:
    """Checks sources against the layout of the checkpoint an engine started from
    (read from its headers on first use, then kept)."""

    def __init__(self, model_config: Any) -> None:
        self._model_config = model_config
        self._layout: dict[str, TensorSpec] | None = None

    def source(self, source: Any) -> list[str]:
        """check_source against this checkpoint; the names the source holds."""
        return check_source(source, self._checkpoint(), derived_names(self._model_config.hf_config))

    def entries(self, entries: list[tuple[str, tuple[int, ...], bool]]) -> None:
        check_entries(entries, self._checkpoint(), derived_names(self._model_config.hf_config))

    def _checkpoint(self) -> dict[str, TensorSpec]:
        if self._layout is None:
            self._layout = checkpoint_layout(self._model_config.model)
        return self._layout


def derived_names(hf_config: Any) -> set[str]:
    """Names a source may carry that no checkpoint needs to hold: the LM head of a model
    whose head is the input embedding (state_dict() lists it under both names)."""
    return {"lm_head.weight"} if getattr(hf_config, "tie_word_embeddings", False) else set()


def check_source(source: Any, layout: dict[str, TensorSpec], derived: set[str]
                 ) -> list[str]:
    """Raise ValueError naming what does not fit; returns the names the source holds."""
    if isinstance(source, (str, Path)):
        if not Path(source).is_dir():
            raise ValueError(f"update_weights: {str(source)!r} is not a checkpoint directory")
        given = checkpoint_layout(source)
        entries = [(name, spec.shape, spec.floating) for name, spec in given.items()]
    else:
        entries = []
        for item in source:
            if not (isinstance(item, (tuple, list)) and len(item) == 2
                    and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)):
                raise ValueError("update_weights takes a checkpoint directory or (name, tensor) "
                                 f"pairs; got an item of type {type(item).__name__}")
            name, tensor = item
            entries.append((name, tuple(tensor.shape), tensor.is_floating_point()))
    check_entries(entries, layout, derived)
    return [name for name, _, _ in entries]


def check_entries(entries: list[tuple[str, tuple[int, ...], bool]],
                  layout: dict[str, TensorSpec], derived: set[str]) -> None:
    """(name, shape, floating point) of each tensor a source holds, against the layout;
    raise ValueError naming every one that does not fit (the first five)."""
    if not entries:
        raise ValueError("update_weights: the source holds no tensors")
    problems = []
    for name, shape, floating in entries:
        spec = layout.get(name)
        if spec is None:
            if name not in derived:
                problems.append(f"{name!r} is not a tensor of this model's checkpoint")
        elif tuple(shape) != spec.shape:
            problems.append(f"{name!r} has shape {list(shape)}, the checkpoint's is "
                            f"{list(spec.shape)}")
        elif floating != spec.floating:
            problems.append(f"{name!r} is {'' if floating else 'not '}floating point, unlike "
                            "the checkpoint's")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more"
                                           if len(problems) > 5 else "")
        raise ValueError(f"update_weights: nothing was changed: {shown}")


def cast_weights(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors one at a time, floating ones cast to dtype."""
    for name, tensor in weights:
        tensor = tensor.detach()
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        yield name, tensor


def iter_source(source: Any, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's tensors one at a time, floating ones cast to dtype."""
    if isinstance(source, (str, Path)):
        yield from iter_checkpoint(checkpoint_files(Path(source)), dtype)
    else:
        yield from cast_weights(source, dtype)


def as_weight_source(weights: Any) -> "str | list[tuple[str, torch.Tensor]]":
    """What update_weights() was given, in the form that travels to the workers: a
    directory as a string; a mapping (a state_dict) or any iterable of pairs (a
    generator too) as a list, which holds the caller's tensors, not copies."""
    if isinstance(weights, (str, Path)):
        return str(weights)
    if isinstance(weights, dict):
        return list(weights.items())
    if isinstance(weights, Iterable):
        return list(weights)
    raise ValueError("update_weights takes a checkpoint directory, a state_dict or an "
                     f"iterable of (name, tensor) pairs; got {type(weights).__name__}")
