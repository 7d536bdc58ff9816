"""Host-to-device staging of a step's small input arrays, and the device-to-host copies
of its outputs.

A pageable `tensor.to("cuda")` is a synchronous copy that waits for all queued GPU
work, so the host could never run ahead of the device. Every per-step array goes
instead through a pinned buffer and a non-blocking copy. Steps alternate between
NUM_BUFFERS buffers: with async scheduling step N+1 is staged while step N's
copies may still be queued, but before step N+2 is staged the engine has waited
for step N's results, so the buffer it reuses has been read.

A step's sampled tokens (and logprobs) go back through pinned buffers too, which
DeviceToHost keeps with their events and hands out again once the host has read them:
a new pinned tensor and a new event every step cost the host's step time (at batch 1
the host's work is what a fast device waits on; benchmarks/host_phases.py).
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


_ALIGN = 16  # bytes: every tensor in a pinned buffer starts on this boundary


class OutputSlot:
    """A pinned buffer and the event that says the copies into it are done."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.event = torch.cuda.Event()


class DeviceToHost:
    """Copies of a step's output tensors into pinned memory, behind the step's kernels.

    copy() takes a free slot (or makes one), queues the copies and records the slot's
    event; the caller waits on that event, reads the host tensors, then gives the slot
    back with release(). A slot that is never given back (its step dropped unread) is
    just not reused. One slot per step in flight: with async scheduling, two."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: list[OutputSlot] = []

    def copy(self, tensors: list[torch.Tensor]) -> tuple[OutputSlot, list[torch.Tensor]]:
        """(slot, host tensors): each of tensors copied without blocking the host."""
        starts, end = [], 0
        for t in tensors:
            starts.append(end)
            end += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        slot = self._free.pop() if self._free else None
        if slot is None or slot.buffer.numel() < end:
            slot = OutputSlot(max(end, 4096))
        host = []
        for t, start in zip(tensors, starts):
            view = slot.buffer[start:start + t.numel() * t.element_size()]
            view = view.view(t.dtype).view(t.shape)
            view.copy_(t, non_blocking=True)
            host.append(view)
        slot.event.record(torch.cuda.current_stream(self.device))
        return slot, host

    def release(self, slot: OutputSlot) -> None:
        """slot's host tensors have been read: it may take the next copies."""
        self._free.append(slot)
