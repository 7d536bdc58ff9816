"""The runner's adapters: which slot holds which adapter, loaded when a request first
needs it and kept (least recently used first to go) while slots last."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch
from torch import nn

from spindle.lora.adapter import load_peft_adapter
from spindle.lora.layers import (LoRASlotWriter, LoRAStep, attach_lora_slots, lora_columns,
                                 lora_mask)
from spindle.lora.request import LoRARequest


class LoRAManager:
    def __init__(self, model: nn.Module, param_name: Callable, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        """param_name: the model class's checkpoint-name mapping (where an adapted
        module's weight lives in the model)."""
        self.max_loras, self.max_rank, self.dtype = max_loras, max_rank, dtype
        self.num_layers = attach_lora_slots(model, max_loras, max_rank, dtype, device)
        self.writer = LoRASlotWriter(model, param_name)
        self.columns = lora_columns(max_loras, max_rank, device)
        self.slot_of: dict[int, int] = {}  # lora_int_id -> slot, for loaded adapters
        self.paths: dict[int, str] = {}  # lora_int_id -> the path it was loaded from
        self.users: dict[int, int] = {}  # lora_int_id -> requests holding it
        self.idle: OrderedDict[int, None] = OrderedDict()  # loaded, unused: oldest first
        self.free_slots = list(range(max_loras - 1, -1, -1))

    def acquire(self, lora: LoRARequest) -> int:
        """The slot of lora's adapter for one more request, loading it first if need be
        (ValueError for an adapter that cannot be served; RuntimeError when every slot
        holds an adapter a request is using, which the scheduler keeps from happening)."""
        rid = lora.lora_int_id
        if rid in self.slot_of and self.paths[rid] != lora.lora_path:
            raise ValueError(f"lora_int_id {rid} is loaded from {self.paths[rid]!r}, and "
                             f"this request names it with {lora.lora_path!r}")
        if rid not in self.slot_of:
            slot = self._take_slot(lora)
            try:
                self.writer.write(slot, load_peft_adapter(lora.lora_path, self.max_rank),
                                  lora.lora_name)
            except Exception:
                self.free_slots.append(slot)
                raise
            self.slot_of[rid], self.paths[rid] = slot, lora.lora_path
        self.idle.pop(rid, None)
        self.users[rid] = self.users.get(rid, 0) + 1
        return self.slot_of[rid]

    def release(self, lora_int_id: int) -> None:
        self.users[lora_int_id] -= 1
        if self.users[lora_int_id] == 0:
            del self.users[lora_int_id]
            self.idle[lora_int_id] = None

    def _take_slot(self, lora: LoRARequest) -> int:
        if self.free_slots:
            return self.free_slots.pop()
        if not self.idle:
            raise RuntimeError(f"adapter {lora.lora_name!r} needs a slot, and all "
                               f"max_loras ({self.max_loras}) hold adapters in use")
        evicted, _ = self.idle.popitem(last=False)
        del self.paths[evicted]
        return self.slot_of.pop(evicted)

    def step(self, token_slots: torch.Tensor) -> LoRAStep:
        """[T] slot ids (-1: none) -> what the step's layers read (lora/layers.py)."""
        return LoRAStep(token_slots, lora_mask(token_slots, self.columns, self.dtype))
