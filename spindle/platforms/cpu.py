"""CPU platform: one 'device' (the host), gloo for collectives, RAM for the KV cache."""

from __future__ import annotations

import psutil
import torch

from spindle.platforms.interface import Platform


class CpuPlatform(Platform):
    device_type = "cpu"
    dist_backend = "gloo"
    default_attention_backend = "torch_sdpa"
    workers_share_device = True
    workers_may_fork = True

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
