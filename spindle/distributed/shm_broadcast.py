"""A single-writer, many-reader message ring in shared memory.

The multi-process executor writes each per-step message once and every worker
reads it from the same memory; nothing here knows what a message means. Payloads
larger than a slot travel in a one-off overflow segment whose name the slot holds.

Invariants:
- message m (1, 2, ...) lives in slot (m - 1) % num_slots; the writer reuses a slot
  only after every reader has consumed the message it held;
- a slot's seq field is written last (after a fence), so a reader that sees the seq
  it expects also sees the whole payload;
- each reader owns one wakeup pipe; the writer puts one byte in it per message, so
  an idle reader sleeps in the kernel instead of spinning on a shared core;
- names are unique per ring (prefix, pid, random suffix): several engines can share
  a host, and nothing is left in /dev/shm once the writer closes.
"""

from __future__ import annotations

import itertools
import os
import pickle
import select
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.connection import Connection, Pipe
from typing import Any, Callable

SHM_PREFIX = "spindle_"
_U64 = struct.Struct("<Q")
_LINE = 64  # one cache line per counter: readers never write to the same line
_SLOT_HEADER = 64  # seq u64, nbytes u64, overflow u64, padding
_FENCE_LOCK = threading.Lock()


def memory_fence() -> None:
    """A full memory barrier: acquiring and releasing a lock is one (pthread mutex)."""
    with _FENCE_LOCK:
        pass


def unique_shm_name(kind: str) -> str:
    """A /dev/shm name no other engine on this host uses (and short: macOS allows 31)."""
    return f"{SHM_PREFIX}{kind}_{os.getpid()}_{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class RingHandle:
    """What a reader process needs to attach (picklable; carried to spawned workers)."""

    name: str
    num_readers: int
    num_slots: int
    slot_bytes: int
    reader_index: int
    wakeup: Connection  # read end of this reader's wakeup pipe


class BroadcastRing:
    """The writer's side. Create it in the parent, hand reader_handle(i) to reader i."""

    def __init__(self, num_readers: int, num_slots: int = 8, slot_bytes: int = 1 << 18) -> None:
        if num_readers < 1 or num_slots < 2 or slot_bytes < 64:
            raise ValueError(f"BroadcastRing needs num_readers >= 1, num_slots >= 2 and "
                             f"slot_bytes >= 64, got {num_readers}, {num_slots}, {slot_bytes}")
        self.num_readers = num_readers
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._layout = _Layout(num_readers, num_slots, slot_bytes)
        self._shm = shared_memory.SharedMemory(name=unique_shm_name("ring"), create=True,
                                               size=self._layout.total)
        self._buf = self._shm.buf
        self.name = self._shm.name
        pipes = [Pipe(duplex=False) for _ in range(num_readers)]
        self._wakeup_read = [r for r, _ in pipes]
        self._wakeup_write = [w for _, w in pipes]
        for w in self._wakeup_write:
            os.set_blocking(w.fileno(), False)
        self._written = 0
        self._overflow: dict[int, shared_memory.SharedMemory] = {}  # slot -> segment
        self._closed = False

    def reader_handle(self, index: int) -> RingHandle:
        return RingHandle(self.name, self.num_readers, self.num_slots, self.slot_bytes, index,
                          self._wakeup_read[index])

    def release_reader_ends(self) -> None:
        """Close this process's copies of the readers' pipe ends (once they are handed over)."""
        for r in self._wakeup_read:
            r.close()

    def open_fds(self) -> list[int]:
        """The pipe descriptors this process holds (what a forked reader must close,
        except its own wakeup end)."""
        return [c.fileno() for c in self._wakeup_read + self._wakeup_write if not c.closed]

    def enqueue(self, obj: Any, timeout: float | None = None,
                abort: Callable[[], BaseException | None] | None = None) -> None:
        self.write(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), timeout, abort)

    def write(self, payload: bytes, timeout: float | None = None,
              abort: Callable[[], BaseException | None] | None = None) -> None:
        """Publish payload to every reader. Waits while the ring is full (a reader is
        num_slots messages behind); raises TimeoutError after timeout seconds, or the
        exception abort() returns (checked while waiting, e.g. a reader died)."""
        if self._closed:
            raise RuntimeError("the broadcast ring is closed")
        seq = self._written + 1
        slot = (seq - 1) % self.num_slots
        self._wait_for_slot(seq, timeout, abort)
        self._drop_overflow(slot)
        base = self._layout.slot_offset(slot)
        data_at = base + _SLOT_HEADER
        if len(payload) <= self.slot_bytes:
            self._buf[data_at:data_at + len(payload)] = payload
            overflow = 0
        else:
            name = self._write_overflow(slot, payload).encode()
            self._buf[data_at:data_at + len(name)] = name
            overflow, payload = len(payload), name
        _U64.pack_into(self._buf, base + 8, len(payload))
        _U64.pack_into(self._buf, base + 16, overflow)
        memory_fence()
        _U64.pack_into(self._buf, base, seq)
        self._written = seq
        self._wake_readers()

    def close(self) -> None:
        """Unlink the ring and every overflow segment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for slot in list(self._overflow):
            self._drop_overflow(slot)
        for w in self._wakeup_write:
            w.close()
        self._buf.release()
        self._shm.close()
        self._shm.unlink()

    # ---- helpers ------------------------------------------------------------------
    def _consumed(self) -> int:
        return min(_U64.unpack_from(self._buf, self._layout.reader_offset(i))[0]
                   for i in range(self.num_readers))

    def _wait_for_slot(self, seq: int, timeout: float | None,
                       abort: Callable[[], BaseException | None] | None) -> None:
        if self._consumed() >= seq - self.num_slots:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        for spin in itertools.count():
            if self._consumed() >= seq - self.num_slots:
                return
            error = abort() if abort is not None else None
            if error is not None:
                raise error
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"broadcast ring full for {timeout:.1f}s: a reader is "
                                   f"{self.num_slots} messages behind")
            time.sleep(0 if spin < 100 else 1e-4)

    def _write_overflow(self, slot: int, payload: bytes) -> str:
        seg = shared_memory.SharedMemory(name=unique_shm_name("ovf"), create=True,
                                         size=len(payload))
        seg.buf[:len(payload)] = payload
        self._overflow[slot] = seg
        return seg.name

    def _drop_overflow(self, slot: int) -> None:
        # Called when the slot is about to be reused (every reader has consumed it) or at close.
        seg = self._overflow.pop(slot, None)
        if seg is not None:
            seg.close()
            seg.unlink()

    def _wake_readers(self) -> None:
        for w in self._wakeup_write:
            try:
                os.write(w.fileno(), b"\x01")
            except BlockingIOError:
                pass  # the pipe is full of wakeups already: the reader will look
            except (BrokenPipeError, OSError):
                pass  # a dead reader; the executor's monitor reports it


class RingReader:
    """One reader's side, attached by handle (in a worker process)."""

    def __init__(self, handle: RingHandle) -> None:
        self.index = handle.reader_index
        self.num_slots = handle.num_slots
        self.slot_bytes = handle.slot_bytes
        self._layout = _Layout(handle.num_readers, handle.num_slots, handle.slot_bytes)
        self._shm = shared_memory.SharedMemory(name=handle.name)
        self._buf = self._shm.buf
        self._wakeup = handle.wakeup
        self._fd = handle.wakeup.fileno()
        os.set_blocking(self._fd, False)
        self._consumed = _U64.unpack_from(self._buf, self._layout.reader_offset(self.index))[0]

    def dequeue(self, timeout: float | None = None) -> Any:
        return self.read(timeout, pickle.loads)

    def read(self, timeout: float | None = None, decode: Callable[[Any], Any] = bytes) -> Any:
        """The next message, passed through decode (a view of shared memory is only valid
        during decode). Sleeps on the wakeup pipe when nothing is there; raises
        TimeoutError after timeout seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            found, value = self._try_read(decode)
            if found:
                return value
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"no broadcast message within {timeout:.1f}s")
            self._sleep(remaining)

    def close(self) -> None:
        self._buf.release()
        self._shm.close()
        self._wakeup.close()

    def _try_read(self, decode: Callable[[Any], Any]) -> tuple[bool, Any]:
        expected = self._consumed + 1
        base = self._layout.slot_offset((expected - 1) % self.num_slots)
        if _U64.unpack_from(self._buf, base)[0] != expected:
            return False, None
        memory_fence()
        nbytes = _U64.unpack_from(self._buf, base + 8)[0]
        overflow = _U64.unpack_from(self._buf, base + 16)[0]
        data = self._buf[base + _SLOT_HEADER:base + _SLOT_HEADER + nbytes]
        try:
            value = decode(data) if not overflow else self._read_overflow(bytes(data), overflow, decode)
        finally:
            data.release()
        self._consumed = expected
        _U64.pack_into(self._buf, self._layout.reader_offset(self.index), expected)
        return True, value

    @staticmethod
    def _read_overflow(name: bytes, nbytes: int, decode: Callable[[Any], Any]) -> Any:
        seg = shared_memory.SharedMemory(name=name.decode())
        try:
            view = seg.buf[:nbytes]
            try:
                return decode(view)
            finally:
                view.release()
        finally:
            seg.close()

    def _sleep(self, timeout: float | None) -> None:
        select.select([self._fd], [], [], timeout)
        try:
            # Drain: the ring, not the byte count, says what is new.
            if os.read(self._fd, 4096) == b"":
                raise EOFError("the broadcast ring's writer has gone away")
        except BlockingIOError:
            pass


class _Layout:
    """Byte offsets: a line per reader counter, then the slots (header + payload)."""

    def __init__(self, num_readers: int, num_slots: int, slot_bytes: int) -> None:
        self.num_readers = num_readers
        self.slots_at = _LINE * num_readers
        self.slot_stride = _SLOT_HEADER + -(-slot_bytes // _LINE) * _LINE
        self.total = self.slots_at + num_slots * self.slot_stride

    def reader_offset(self, index: int) -> int:
        return _LINE * index

    def slot_offset(self, slot: int) -> int:
        return self.slots_at + slot * self.slot_stride
