"""The portable sleep backend: works on any device by moving tensors out and back.

Each tagged tensor keeps its Python identity: its storage is swapped with
`tensor.data = ...`, so modules, the attention layers' cache references and the
rotary tables seen by the kernels all follow. Device addresses do change, so on a
platform with CUDA graphs the runner recaptures them once everything is awake
(preserves_graphs = False).
"""

from __future__ import annotations

import torch

from spindle.memory.sleep_backend import KV_CACHE, WEIGHTS, SleepModeBackend, SleepState


class PortableSleepBackend(SleepModeBackend):
    name = "portable"
    preserves_graphs = False

    def __init__(self, target, platform) -> None:
        super().__init__(target, platform)
        # Per asleep tensor: its host copy (None when dropped), shape and dtype.
        self._saved: dict[str, list[tuple[torch.Tensor, torch.Tensor | None, torch.Size,
                                          torch.dtype]]] = {}

    def _release(self, level: int) -> None:
        keep = set() if level == 1 else {id(t) for t in self.target.buffers_outside_checkpoint()}
        self._saved[WEIGHTS] = [self._evict(t, host_copy=(level == 1 or id(t) in keep))
                                for t in self.target.tagged_tensors(WEIGHTS)]
        self._saved[KV_CACHE] = [self._evict(t, host_copy=False)
                                 for t in self.target.tagged_tensors(KV_CACHE)]

    def _evict(self, tensor: torch.Tensor, host_copy: bool):
        copy = None
        if host_copy:
            pin = tensor.device.type == "cuda"
            copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            copy.copy_(tensor.detach())
        shape, dtype = tensor.shape, tensor.dtype
        tensor.data = torch.empty(0, dtype=dtype, device=tensor.device)
        return tensor, copy, shape, dtype

    def _restore(self, tags: list[str]) -> None:
        device = self.target.device
        for tag in tags:
            for tensor, copy, shape, dtype in self._saved.pop(tag):
                fresh = torch.empty(shape, dtype=dtype, device=device)
                if copy is not None:
                    fresh.copy_(copy)
                tensor.data = fresh
        if WEIGHTS in tags and self.level == 2:
            self.target.reload_weights()
        self.platform.synchronize(device)

    def state(self) -> SleepState:
        device_bytes = {}
        for tag in (WEIGHTS, KV_CACHE):
            device_bytes[tag] = sum(t.numel() * t.element_size()
                                    for t in self.target.tagged_tensors(tag))
        host = sum(c.numel() * c.element_size() for saved in self._saved.values()
                   for _, c, _, _ in saved if c is not None)
        return SleepState(level=self.level, asleep=tuple(self.asleep),
                          device_bytes=device_bytes, host_bytes=host)
