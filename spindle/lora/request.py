"""What a request names to be served with a LoRA adapter."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter: lora_name (what clients call it), lora_int_id (a positive
    integer, one per adapter: requests with the same id share its loaded weights) and
    lora_path (the adapter's directory: adapter_config.json, adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a directory path, got {self.lora_path!r}")

    @property
    def cache_key(self) -> bytes:
        """What sets this adapter's prefix-cache blocks apart from the base model's and
        every other adapter's (its id, name and path)."""
        return hashlib.sha256(f"lora\0{self.lora_int_id}\0{self.lora_name}\0{self.lora_path}"
                              .encode()).digest()
