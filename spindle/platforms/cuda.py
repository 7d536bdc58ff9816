"""CUDA platform: NCCL for collectives, device memory measured through torch."""

from __future__ import annotations

import torch

from spindle.platforms.interface import Platform


class CudaPlatform(Platform):
    device_type = "cuda"
    dist_backend = "nccl"
    default_attention_backend = "triton"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def device_for_rank(self, local_rank: int) -> torch.device:
        return torch.device("cuda", local_rank)

    def set_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        return torch.cuda.mem_get_info(device)

    def memory_in_use(self, device: torch.device) -> int:
        free, total = torch.cuda.mem_get_info(device)
        return total - free

    def peak_memory(self, device: torch.device) -> int | None:
        return torch.cuda.max_memory_allocated(device)

    def reset_peak_memory(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def device_key(self, device: torch.device) -> str:
        return f"cuda-{torch.cuda.get_device_properties(device).uuid}"

    def device_model(self, device: torch.device) -> str:
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} sm_{props.major}{props.minor}"

    def is_cumem_allocator_available(self) -> bool:
        try:
            from cuda.bindings import driver  # noqa: F401
        except ImportError:
            return False
        return self.is_available()

    def supports_cuda_graphs(self) -> bool:
        return True
