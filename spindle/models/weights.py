"""Copying HF-named checkpoint tensors into a model's parameters (any architecture)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from spindle.layers.linear import default_weight_loader

# hf name -> (parameter name, shard id), or None to skip the tensor.
NameMapper = Callable[[str], "tuple[str, Any] | None"]


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       map_name: NameMapper) -> set[str]:
    """Feed each tensor to its parameter's weight_loader (which shards it for tensor
    parallelism). Returns the names of the parameters completely loaded (merged
    parameters only once every shard arrived). Raises ValueError on a tensor that
    matches no parameter, or whose shape does not fit."""
    params = dict(model.named_parameters())
    shards_seen: dict[str, set[Any]] = {}
    for hf_name, tensor in weights:
        mapped = map_name(hf_name)
        if mapped is None:
            continue
        name, shard_id = mapped
        param = params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor {hf_name!r} matches no parameter of "
                             f"{type(model).__name__}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"cannot load checkpoint tensor {hf_name!r} into {name!r}: {e}") from e
        shards_seen.setdefault(name, set()).add(shard_id)
    complete = {name for name, seen in shards_seen.items()
                if seen >= set(getattr(params[name], "shard_ids", (None,)))}
    return with_dependents(model, complete)


def not_on_this_rank(lm: nn.Module, hf_name: str, final_norm: str = "norm") -> bool:
    """Whether a causal LM's checkpoint tensor hf_name has no parameter here: rotary
    tables (recomputed from the config; old checkpoints saved inv_freq), an LM head tied
    to the embedding (some checkpoints still store it) or on another stage, and under
    pipeline parallelism the embedding, the final norm (``model.<final_norm>``) and the
    layers another stage owns. lm: a model with ``tie_word_embeddings``, ``lm_head``,
    ``stage`` and ``model.embed_tokens`` / ``model.<final_norm>`` (None off their stage)."""
    if "rotary_emb." in hf_name:
        return True
    if hf_name == "lm_head.weight":
        return lm.tie_word_embeddings or lm.lm_head is None
    if hf_name.startswith("model.embed_tokens."):
        return lm.model.embed_tokens is None
    if hf_name.startswith(f"model.{final_norm}."):
        return getattr(lm.model, final_norm) is None
    if hf_name.startswith("model.layers."):
        return not lm.stage.owns_layer(int(hf_name.split(".")[2]))
    return False


def with_dependents(model: nn.Module, complete: set[str]) -> set[str]:
    """complete plus the parameters filled by the loaders of those in it
    (``loaded_with``)."""
    params = dict(model.named_parameters())
    names = {id(param): name for name, param in params.items()}
    return complete | {name for name, param in params.items()
                       if _loaded_with(name, param, names) in complete}


def _loaded_with(name: str, param: nn.Parameter, names: dict[int, str]) -> str | None:
    """The full name of the parameter whose loader fills param, if any: ``loaded_with``
    names a sibling (a float8 weight's scale: "weight") or is that parameter itself (an
    int4 LM head filled along with the embedding it was tied to)."""
    source = getattr(param, "loaded_with", None)
    if source is None:
        return None
    if isinstance(source, torch.Tensor):
        return names.get(id(source))
    module, _, _ = name.rpartition(".")
    return f"{module}.{source}" if module else source
