"""Host-to-device staging of a step's small input arrays.

A pageable `tensor.to("cuda")` is a synchronous copy that waits for all queued GPU
work, so the host could never run ahead of the device. Every per-step array goes
instead through a pinned buffer and a non-blocking copy. Steps alternate between
NUM_BUFFERS buffers: with async scheduling step N+1 is staged while step N's
copies may still be queued, but before step N+2 is staged the engine has waited
for step N's results, so the buffer it reuses has been read.
"""

from __future__ import annotations

import numpy as np
import torch


NUM_BUFFERS = 2


class HostToDevice:
    def __init__(self, device: torch.device, capacity_bytes: int = 16 * 2**20) -> None:
        self.device = device
        self.on_cpu = device.type == "cpu"
        self._buffers = [] if self.on_cpu else [
            torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=True)
            for _ in range(NUM_BUFFERS)]
        self._step = 0
        self._buffer = self._buffers[0] if self._buffers else None
        self._offset = 0

    def new_step(self) -> None:
        """Start staging a new step, in the other buffer."""
        self._offset = 0
        if self._buffers:
            self._step += 1
            self._buffer = self._buffers[self._step % NUM_BUFFERS]

    def put(self, array: np.ndarray | list, dtype: torch.dtype) -> torch.Tensor:
        """A device tensor of dtype holding array (copied without blocking the host)."""
        host = torch.as_tensor(np.asarray(array)).to(dtype)
        if self.on_cpu:
            return host
        nbytes = host.numel() * host.element_size()
        start = -(-self._offset // 16) * 16  # keep every slice 16-byte aligned
        if start + nbytes > self._buffer.numel():
            return host.pin_memory().to(self.device, non_blocking=True)  # rare: oversized step
        self._offset = start + nbytes
        staged = self._buffer[start:start + nbytes].view(dtype).view(host.shape)
        staged.copy_(host)
        return staged.to(self.device, non_blocking=True)
