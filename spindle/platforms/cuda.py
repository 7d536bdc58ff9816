"""CUDA platform: NCCL for collectives, device memory measured through torch."""

from __future__ import annotations

import logging
import threading

import torch

from spindle.platforms.interface import Platform
from spindle.switches import on_off

logger = logging.getLogger(__name__)

# "0" leaves the CUDA context and cuBLAS to the worker's own first calls.
EARLY_START_ENV = "SPINDLE_CUDA_EARLY_START"


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

    def start_device_in_background(self, device: torch.device) -> None:
        """Create device's CUDA context and load cuBLAS (a first matmul) on a daemon thread.
        On an H200 host that takes 0.3-0.5 s, nearly all of it in driver and library calls
        that release the GIL, so started before the config's import of transformers it
        runs beside it instead of at the head of the worker's stages. The thread's cuBLAS
        handle, and its workspace, go to the worker's thread when it ends.

        Nothing happens when SPINDLE_CUDA_EARLY_START=0, when a start of device is running
        already, or when this process uses CUDA already: the context is made then, and
        beside a thread that holds a handle the start's handle would stay unused, with a
        second cuBLAS workspace, for the life of the process."""
        if (not on_off(EARLY_START_ENV, True) or torch.cuda.is_initialized()
                or _start_thread(device) is not None):
            return
        threading.Thread(target=_start_device, args=(device,), name=_start_thread_name(device),
                         daemon=True).start()

    def wait_for_device_start(self, device: torch.device) -> None:
        thread = _start_thread(device)
        if thread is not None:
            thread.join()


def _start_thread_name(device: torch.device) -> str:
    return f"spindle-start-{device}"


def _start_thread(device: torch.device) -> threading.Thread | None:
    """The thread start_device_in_background runs for device, while it runs."""
    name = _start_thread_name(device)
    return next((t for t in threading.enumerate() if t.name == name), None)


def _start_device(device: torch.device) -> None:
    """The calls whose first use in a process is slow: the context, cuBLAS's libraries
    and a handle (torch hands a finished thread's handle on to the next thread)."""
    try:
        with torch.cuda.device(device):
            x = torch.ones((16, 256), dtype=torch.bfloat16, device=device)
            torch.nn.functional.linear(x, x)
            torch.cuda.synchronize(device)
    except Exception as e:  # the worker makes the same calls and reports what fails
        logger.debug("starting %s ahead failed: %s", device, e)
