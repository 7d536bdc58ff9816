"""The Platform interface: what the engine needs to know about a kind of device.

Everything device-specific that is not model math goes through here, so the
executor, worker and runner never test `device.type == "cuda"` themselves.
"""

from __future__ import annotations

import abc

import torch


class Platform(abc.ABC):
    device_type: str  # torch device type: "cpu" | "cuda"
    dist_backend: str  # torch.distributed backend for this device type
    default_attention_backend: str
    # True where every worker runs on the same device (the CPU host) instead of one each.
    workers_share_device: bool = False
    # True where worker processes may be forked from the engine's process: their device
    # needs no runtime state that a fork would copy broken (CUDA's does not survive one).
    workers_may_fork: bool = False
    # How the KV cache is sized. True: from the peak memory of a dummy forward at the
    # step's token budget (a GPU, whose memory the engine has to itself). False: from a
    # configured budget (cpu_kv_cache_gb); profile_run then only checks, with a small
    # forward, that the model and the sampler run.
    kv_cache_from_measured_peak: bool = True
    # Whether kernels are compiled at their first launch (Triton on a GPU): warmup then
    # runs a long prefill as well as a short one, so that no request pays for it.
    # Elsewhere one short request (prefill and decode) checks the cache path.
    compiles_kernels_on_first_use: bool = True

    @abc.abstractmethod
    def is_available(self) -> bool:
        """Whether this platform can run on this machine at all."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """Devices visible to this process (after CUDA_VISIBLE_DEVICES)."""

    @abc.abstractmethod
    def device_for_rank(self, local_rank: int) -> torch.device:
        """The torch device a worker with this local rank drives."""

    @abc.abstractmethod
    def set_device(self, device: torch.device) -> None:
        """Make device the current one of this process."""

    @abc.abstractmethod
    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        """(free bytes, total bytes) of the memory that holds this device's tensors."""

    @abc.abstractmethod
    def memory_in_use(self, device: torch.device) -> int:
        """Bytes this process holds on the device now (for the startup table)."""

    def peak_memory(self, device: torch.device) -> int | None:
        """Peak bytes allocated since the last reset_peak_memory, if tracked."""
        return None

    def reset_peak_memory(self, device: torch.device) -> None:
        return None

    def synchronize(self, device: torch.device) -> None:
        return None

    def allocate_zeroed(self, shape: tuple[int, ...], dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
        """A zero-filled tensor for a large, long-lived buffer (the KV cache)."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def empty_cache(self) -> None:
        return None

    def device_key(self, device: torch.device) -> str:
        """A name of the physical device, the same in every process that uses it
        (the per-device sleep lock is named after it)."""
        return f"{self.device_type}-{device.index or 0}"

    def device_model(self, device: torch.device) -> str:
        """The kind of device (what compiled kernels are specific to)."""
        return self.device_type

    def is_cumem_allocator_available(self) -> bool:
        return False

    def is_sleep_mode_available(self) -> bool:
        """Whether sleep levels 1 and 2 can run here: every platform has the portable
        backend; is_cumem_allocator_available() tells whether the cumem one can."""
        return True

    def supports_cuda_graphs(self) -> bool:
        return False

    def start_device_in_background(self, device: torch.device) -> None:
        """Begin readying device on a thread (its runtime and libraries) for a worker that
        this process starts later. Where there is nothing to ready, nothing happens."""
        return None

    def wait_for_device_start(self, device: torch.device) -> None:
        """Wait until what start_device_in_background began for device has ended."""
        return None

    def worker_class(self) -> str:
        """Import path of the Worker class for this platform."""
        return "spindle.worker.worker:Worker"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
