"""CuMemAllocator: tagged torch memory pools backed by CUDA virtual memory.

torch's caching allocator asks a pluggable allocator (two ctypes callbacks, see
torch._C._cuda_customAllocator) for each segment of a torch.cuda.MemPool. This
allocator serves every segment with CUDA virtual memory: it reserves an address
range, creates physical memory and maps it there. Sleeping unmaps and releases the
physical memory but keeps the range reserved; waking maps new physical memory at the
same addresses. Tensors, the caching allocator's bookkeeping and captured CUDA graphs
therefore stay valid across sleep. One pool per tag ("weights", "kv_cache").

Layers: DriverVirtualMemory (the driver calls, through cuda-python), TaggedSegments
(which segment belongs to which tag and what state it is in; testable without a
GPU), _SegmentServer (the C callbacks, which must outlive the engine while torch holds
its segments), CuMemAllocator (the torch side) and CuMemSleepBackend (the sleep
backend).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch

from spindle.memory.sleep_backend import (KV_CACHE, MEMORY_TAGS, WEIGHTS, SleepModeBackend,
                                          SleepState, _check_tags)

logger = logging.getLogger(__name__)

# void* malloc(size_t size, int device, cudaStream_t stream)
_MALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
# void free(void* ptr, size_t size, int device, cudaStream_t stream)
_FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)


class VirtualMemory(Protocol):
    """The virtual-memory operations TaggedSegments needs (DriverVirtualMemory on a GPU)."""

    granularity: int

    def reserve(self, size: int) -> int: ...
    def map_new(self, ptr: int, size: int) -> Any: ...  # returns the physical handle
    def unmap(self, ptr: int, size: int, handle: Any) -> None: ...
    def free_address(self, ptr: int, size: int) -> None: ...
    # The copies may run asynchronously: their memory is in use until synchronize().
    def copy_to_host(self, host_ptr: int, ptr: int, size: int) -> None: ...
    def copy_from_host(self, ptr: int, host_ptr: int, size: int) -> None: ...
    def synchronize(self) -> None: ...


class DriverVirtualMemory:
    """CUDA virtual memory on one device through cuda-python's driver bindings."""

    def __init__(self, device_index: int) -> None:
        from cuda.bindings import driver

        self._cu = driver
        self.device_index = device_index
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_index
        self._prop = prop
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device_index
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        self.granularity = int(self._call("cuMemGetAllocationGranularity", prop,
                                          driver.CUmemAllocationGranularity_flags
                                          .CU_MEM_ALLOC_GRANULARITY_MINIMUM))

    def _call(self, name: str, *args: Any) -> Any:
        result = getattr(self._cu, name)(*args)
        err, values = result[0], result[1:]
        if int(err) != 0:
            _, text = self._cu.cuGetErrorString(err)
            text = text.decode() if isinstance(text, bytes) else text
            raise RuntimeError(f"{name} failed on cuda:{self.device_index}: {err!r} ({text})")
        return values[0] if len(values) == 1 else (values or None)

    def reserve(self, size: int) -> int:
        return int(self._call("cuMemAddressReserve", size, self.granularity, 0, 0))

    def map_new(self, ptr: int, size: int) -> Any:
        handle = self._call("cuMemCreate", size, self._prop, 0)
        try:
            self._call("cuMemMap", ptr, size, 0, handle, 0)
        except Exception:
            self._call("cuMemRelease", handle)
            raise
        self._call("cuMemSetAccess", ptr, size, [self._access], 1)
        return handle

    def unmap(self, ptr: int, size: int, handle: Any) -> None:
        self._call("cuMemUnmap", ptr, size)
        self._call("cuMemRelease", handle)

    def free_address(self, ptr: int, size: int) -> None:
        self._call("cuMemAddressFree", ptr, size)

    def copy_to_host(self, host_ptr: int, ptr: int, size: int) -> None:
        # On the legacy default stream; from pinned memory the copy engine runs it while
        # the caller goes on mapping or unmapping other segments.
        self._call("cuMemcpyDtoHAsync", host_ptr, ptr, size, 0)

    def copy_from_host(self, ptr: int, host_ptr: int, size: int) -> None:
        self._call("cuMemcpyHtoDAsync", ptr, host_ptr, size, 0)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device_index)


@dataclass
class Segment:
    ptr: int
    size: int  # bytes mapped (a multiple of the granularity)
    tag: str
    handle: Any  # the physical allocation; None while released
    host_copy: torch.Tensor | None = None


class TaggedSegments:
    """Every live segment, by address, with its tag and state.

    A segment is mapped (handle set) or released (handle None, address still
    reserved). release(tags) releases the mapped segments of tags, copying those
    that keep_on_host selects to host memory first; restore(tags) maps new memory
    under each and copies the host copy back. free() of a released segment only
    gives the address range back.
    """

    def __init__(self, vm: VirtualMemory, pin_host_copies: bool = True) -> None:
        self.vm = vm
        self.pin_host_copies = pin_host_copies
        self.segments: dict[int, Segment] = {}

    def allocate(self, size: int, tag: str) -> int:
        _check_tags([tag])
        size = -(-size // self.vm.granularity) * self.vm.granularity
        ptr = self.vm.reserve(size)
        try:
            handle = self.vm.map_new(ptr, size)
        except Exception:
            self.vm.free_address(ptr, size)
            raise
        self.segments[ptr] = Segment(ptr, size, tag, handle)
        return ptr

    def free(self, ptr: int) -> None:
        segment = self.segments.pop(ptr, None)
        if segment is None:
            raise ValueError(f"free of address {ptr:#x}, which this allocator did not give out")
        if segment.handle is not None:
            self.vm.unmap(segment.ptr, segment.size, segment.handle)
        self.vm.free_address(segment.ptr, segment.size)

    def release(self, tags: Iterable[str], keep_on_host: Callable[[Segment], bool]) -> int:
        """Release the mapped segments of tags; returns the bytes given back. The copies
        to the host are all started first, and the segments that keep none are released
        while they run."""
        self.vm.synchronize()
        freed, copying = 0, []
        for segment in self._of(tags, mapped=True):
            if keep_on_host(segment):
                host = torch.empty(segment.size, dtype=torch.uint8,
                                   pin_memory=self.pin_host_copies)
                self.vm.copy_to_host(host.data_ptr(), segment.ptr, segment.size)
                segment.host_copy = host
                copying.append(segment)
            else:
                freed += self._unmap(segment)
        if copying:
            self.vm.synchronize()  # the copies have landed: their device memory may go
            freed += sum(self._unmap(segment) for segment in copying)
        return freed

    def _unmap(self, segment: Segment) -> int:
        self.vm.unmap(segment.ptr, segment.size, segment.handle)
        segment.handle = None
        return segment.size

    def restore(self, tags: Iterable[str]) -> int:
        """Map new memory under the released segments of tags and put back their host
        copies (each copy starts as soon as its segment is mapped, so the copies run
        while the later segments map); returns the bytes mapped."""
        mapped, copied = 0, []
        for segment in self._of(tags, mapped=False):
            segment.handle = self.vm.map_new(segment.ptr, segment.size)
            if segment.host_copy is not None:
                self.vm.copy_from_host(segment.ptr, segment.host_copy.data_ptr(), segment.size)
                copied.append(segment)
            mapped += segment.size
        self.vm.synchronize()
        for segment in copied:  # (a host copy is in use until its copy has run)
            segment.host_copy = None
        return mapped

    def mapped_bytes(self, tag: str) -> int:
        return sum(s.size for s in self._of([tag], mapped=True))

    def reserved_bytes(self) -> int:
        """Bytes of every segment, mapped or not (what torch counts as reserved)."""
        return sum(s.size for s in self.segments.values())

    def host_bytes(self) -> int:
        return sum(s.host_copy.numel() for s in self.segments.values() if s.host_copy is not None)

    def _of(self, tags: Iterable[str], mapped: bool) -> list[Segment]:
        tags = set(tags)
        return [s for s in self.segments.values()
                if s.tag in tags and (s.handle is not None) == mapped]


class _SegmentServer:
    """The two C callbacks torch's caching allocator calls for the pools' segments, and
    the segment table they serve.

    torch may call them for as long as it holds a segment of the pools, and that can
    be after the engine is gone: an LLM dropped without shutdown() is collected in any
    order (its pools before its tensors), and a tensor kept past shutdown frees its
    segment at some later empty_cache(). A callback Python has freed by then is a jump
    into freed memory (a segfault in the next empty_cache, of this engine or another).
    So servers stay referenced from _SERVING, apart from the allocator that made them,
    until their allocator is gone and every segment is back.
    """

    def __init__(self, segments: TaggedSegments) -> None:
        self.segments = segments
        self.tag: str | None = None  # the pool allocating now (CuMemAllocator.use_pool)
        self.owner_gone = False
        self.malloc_cb = _MALLOC_FN(self._malloc)
        self.free_cb = _FREE_FN(self._free)

    def addresses(self) -> tuple[int, int]:
        return (ctypes.cast(self.malloc_cb, ctypes.c_void_p).value,
                ctypes.cast(self.free_cb, ctypes.c_void_p).value)

    @property
    def retired(self) -> bool:
        """True once torch can no longer call in: the owner is gone, no segment left."""
        return self.owner_gone and not self.segments.segments

    def _malloc(self, size: int, device: int, stream: int) -> int | None:
        try:
            if self.tag is None:
                raise RuntimeError("an allocation reached the cumem allocator outside use_pool()")
            return self.segments.allocate(size, self.tag)
        except Exception:  # an exception cannot cross into C++: torch sees a null pointer
            logger.exception("cumem allocator: cannot allocate %d bytes for %r", size, self.tag)
            return None

    def _free(self, ptr: int, size: int, device: int, stream: int) -> None:
        try:
            self.segments.free(ptr)
        except Exception:
            logger.exception("cumem allocator: cannot free %#x", ptr or 0)


# Servers whose callbacks torch may still call (see _SegmentServer). A retired one is
# dropped when the next allocator is made, never from inside a callback.
_SERVING: set[_SegmentServer] = set()


class CuMemAllocator:
    """The torch side: one MemPool per tag, all served by TaggedSegments."""

    def __init__(self, device: torch.device, vm: VirtualMemory | None = None) -> None:
        self.device = device
        _SERVING.difference_update([s for s in _SERVING if s.retired])
        self._server = _SegmentServer(TaggedSegments(vm or DriverVirtualMemory(device.index or 0)))
        _SERVING.add(self._server)
        weakref.finalize(self, _mark_owner_gone, self._server)
        self._torch_allocator = torch._C._cuda_customAllocator(*self._server.addresses())
        self.pools: dict[str, Any] = {}

    @property
    def segments(self) -> TaggedSegments:
        return self._server.segments

    @contextlib.contextmanager
    def use_pool(self, tag: str) -> Iterator[None]:
        """Allocations on this thread inside the block come from tag's pool."""
        _check_tags([tag])
        if tag not in self.pools:
            self.pools[tag] = torch.cuda.MemPool(self._torch_allocator)
        server = self._server
        previous, server.tag = server.tag, tag
        try:
            with torch.cuda.use_mem_pool(self.pools[tag], device=self.device):
                yield
        finally:
            server.tag = previous

    def close(self) -> None:
        """Drop the pools and let torch give their segments back (call once nothing
        allocated from them is alive); logs segments that outlive it (torch frees them
        later, through the callbacks that _SERVING keeps)."""
        self.pools.clear()
        gc.collect()
        torch.cuda.empty_cache()
        _mark_owner_gone(self._server)
        if self.segments.segments:
            logger.warning("cumem allocator: %d segment(s), %.1f MiB, still in use at close",
                           len(self.segments.segments), self.segments.reserved_bytes() / 2**20)


def _mark_owner_gone(server: _SegmentServer) -> None:
    server.owner_gone = True


class CuMemSleepBackend(SleepModeBackend):
    """Sleep by unmapping the tagged pools: addresses and CUDA graphs survive."""

    name = "cumem"
    preserves_graphs = True
    needs_cumem_allocator = True

    def __init__(self, target, platform, allocator: CuMemAllocator | None = None) -> None:
        super().__init__(target, platform)
        self.allocator = allocator or CuMemAllocator(target.device)
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []  # level 2 host copies

    @classmethod
    def check_available(cls, platform) -> None:
        if not platform.is_cumem_allocator_available():
            raise ValueError(f"sleep_mode_backend 'cumem' needs CUDA and cuda-python "
                             f"(pip install cuda-python); not available on {platform!r}. "
                             "Use sleep_mode_backend='portable' instead.")

    def allocating(self, tag: str):
        return self.allocator.use_pool(tag)

    def _release(self, level: int) -> None:
        if level == 2:
            self._buffers = [(t, t.detach().to("cpu", copy=True))
                             for t in self.target.buffers_outside_checkpoint()]
        # One release for both tags: the KV cache is unmapped while the weights copy out.
        self.allocator.segments.release(
            [WEIGHTS, KV_CACHE], keep_on_host=lambda s: level == 1 and s.tag == WEIGHTS)

    def _restore(self, tags: list[str]) -> None:
        self.allocator.segments.restore(tags)
        if WEIGHTS in tags and self.level == 2:
            self.target.reload_weights()
            for tensor, copy in self._buffers:
                tensor.copy_(copy)
            self._buffers = []
            self.platform.synchronize(self.target.device)

    def state(self) -> SleepState:
        segments = self.allocator.segments
        return SleepState(level=self.level, asleep=tuple(self.asleep),
                          device_bytes={t: segments.mapped_bytes(t) for t in MEMORY_TAGS},
                          host_bytes=segments.host_bytes()
                          + sum(c.numel() * c.element_size() for _, c in self._buffers))

    def close(self) -> None:
        self.allocator.close()
