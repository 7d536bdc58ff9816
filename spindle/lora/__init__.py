"""LoRA adapters served beside the base model (several per batch): requests name an
adapter with a LoRARequest; see docs/architecture.md, "LoRA adapters"."""

from spindle.lora.request import LoRARequest

__all__ = ["LoRARequest"]
