"""The device memory decoded media lives in before the encoder reads it: one buffer of
``mm_ipc_gpu_memory_gb`` (the memory the worker sets aside before it sizes the KV
cache), allocated on first use, at one address for the life of the engine.

Each step that starts requests copies their encoder inputs (an encoder-decoder's
audio features) from the host into the front of the buffer and hands the encoder a
view of it: no allocation per step, and never more decoded media on the device than
the reservation. The engine keeps every step within it: the encoder budget is capped
at the inputs the buffer holds (config.py), so a step never stages more.
"""

from __future__ import annotations

import math

import torch


class MediaBufferPool:
    def __init__(self, capacity_bytes: int, device: torch.device) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"a media buffer needs a capacity >= 1 byte, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.device = device
        self._buffer: torch.Tensor | None = None

    def stage(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        """The inputs (host tensors of one shape and dtype) stacked on the device
        [n, ...], as a view of the buffer; ValueError when they do not fit."""
        shape, dtype = inputs[0].shape, inputs[0].dtype
        nbytes = len(inputs) * math.prod(shape) * inputs[0].element_size()
        if nbytes > self.capacity_bytes:
            raise ValueError(f"{len(inputs)} encoder inputs ({nbytes / 2**20:.1f} MiB) exceed "
                             f"the media buffer (mm_ipc_gpu_memory_gb: "
                             f"{self.capacity_bytes / 2**20:.1f} MiB)")
        if self._buffer is None:
            self._buffer = torch.empty(self.capacity_bytes, dtype=torch.uint8, device=self.device)
        view = self._buffer[:nbytes].view(dtype).view(len(inputs), *shape)
        host = torch.stack(inputs)
        if self.device.type == "cuda":
            host = host.pin_memory()
        view.copy_(host, non_blocking=True)
        return view
