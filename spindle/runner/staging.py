"""Host-to-device staging of a step's small input arrays.

A pageable `tensor.to("cuda")` is a synchronous copy that waits for all queued GPU
work, so the host could never run ahead of the device. Every per-step array goes
instead through one pinned buffer and a non-blocking copy. The buffer is reused
from its start each step: the runner synchronises once per step (when it reads
the sampled tokens back) before the next step stages anything, so a copy never
reads a region that is being overwritten.
"""

from __future__ import annotations

import numpy as np
import torch


class HostToDevice:
    def __init__(self, device: torch.device, capacity_bytes: int = 16 * 2**20) -> None:
        self.device = device
        self.on_cpu = device.type == "cpu"
        self._buffer = None if self.on_cpu else torch.empty(capacity_bytes, dtype=torch.uint8,
                                                            pin_memory=True)
        self._offset = 0

    def new_step(self) -> None:
        self._offset = 0

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
