"""CPU platform: one 'device' (the host), gloo for collectives, RAM for the KV cache."""

from __future__ import annotations

import math
import mmap

import psutil
import torch

from spindle.platforms.interface import Platform


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (x86: AVX512-BF16 or AMX-BF16; Arm:
    the BF16 extension), read from /proc/cpuinfo's flags; False where it cannot tell."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    flags = set(value.split())
                    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    except OSError:
        pass
    return False


class CpuPlatform(Platform):
    device_type = "cpu"
    dist_backend = "gloo"
    default_attention_backend = "torch_sdpa"
    workers_share_device = True
    workers_may_fork = True
    # Host RAM is shared with everything else on the machine, and a maximal dummy
    # forward costs tens of seconds on a few cores: the KV cache has a budget instead.
    kv_cache_from_measured_peak = False
    compiles_kernels_on_first_use = False

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def device_for_rank(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device: torch.device) -> None:
        return None

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return vm.available, vm.total

    def device_key(self, device: torch.device) -> str:
        return "cpu"  # one host memory, whatever the rank

    def memory_in_use(self, device: torch.device) -> int:
        return psutil.Process().memory_info().rss

    def allocate_zeroed(self, shape: tuple[int, ...], dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
        """Pages of a private anonymous mapping: the kernel hands them out zeroed on
        first touch, so a cache of gigabytes costs nothing until its blocks fill
        (torch.zeros writes every byte up front: seconds per GiB). The tensor keeps the
        mapping alive; it is unmapped with the last tensor viewing it."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype, device=device)
        pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
        return torch.frombuffer(pages, dtype=dtype).view(shape)
