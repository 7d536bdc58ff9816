"""Reading a PEFT LoRA adapter: adapter_config.json and adapter_model.safetensors.

A LoRA adapter adds (alpha / r) * B A x to a linear layer's output, A [r, in] and
B [out, r] per adapted module (alpha / sqrt(r) with rsLoRA). Options that change that
formula or add weights elsewhere are refused by name, not ignored."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

# adapter_config.json fields whose non-default values this reader does not serve.
_REFUSED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out weights",
            "lora_bias": "LoRA biases", "modules_to_save": "modules_to_save",
            "layer_replication": "layer_replication", "rank_pattern": "per-module ranks",
            "alpha_pattern": "per-module alphas", "use_qalora": "QA-LoRA",
            "trainable_token_indices": "trainable tokens",
            "target_parameters": "target_parameters",
            "alora_invocation_tokens": "activated LoRA"}
_PREFIX = "base_model.model."


@dataclass
class PeftAdapter:
    """rank: r; weights: the base model's module name (as in its checkpoint, e.g.
    "model.layers.0.self_attn.q_proj") -> (A [r, in], B [out, r] times the scaling),
    float32 on the CPU."""

    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def load_peft_adapter(path: str | Path, max_rank: int) -> PeftAdapter:
    directory = Path(path)
    config_file = directory / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r}: no adapter_config.json there")
    config = json.loads(config_file.read_text())
    _check_config(config, path)
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {str(path)!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {str(path)!r} has rank {rank}, more than "
                         f"max_lora_rank ({max_rank}); raise max_lora_rank")
    alpha = config.get("lora_alpha", 8)
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return PeftAdapter(rank, _read_weights(directory, rank, scaling, path))


def _check_config(config: dict, path: str | Path) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {str(path)!r} is a {config.get('peft_type')} adapter; "
                         "only LoRA adapters are served")
    for field, what in _REFUSED.items():
        if config.get(field):
            raise ValueError(f"LoRA adapter {str(path)!r} uses {what} ({field}), which is "
                             "not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {str(path)!r} trains biases (bias="
                         f"{config['bias']!r}), which is not supported")


def _read_weights(directory: Path, rank: int, scaling: float, path: str | Path
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from safetensors.torch import load_file

    weights_file = directory / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r}: no adapter_model.safetensors there "
                         "(only safetensors weights are read)")
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(weights_file).items():
        stem, _, kind = name.removeprefix(_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ValueError(f"LoRA adapter {str(path)!r} holds {name!r}, which is not a "
                             "LoRA A or B weight of a linear layer (not supported)")
        halves.setdefault(stem, {})[kind[0]] = tensor
    if not halves:
        raise ValueError(f"LoRA adapter {str(path)!r} holds no weights")
    weights = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {str(path)!r}: {module} lacks its lora_"
                             f"{'B' if 'A' in pair else 'A'} weight")
        a, b = pair["A"].float(), pair["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"LoRA adapter {str(path)!r}: {module} has A {tuple(a.shape)} "
                             f"and B {tuple(b.shape)}, not [r, in] and [out, r] with r={rank}")
        weights[module] = (a, b * scaling)
    return weights
