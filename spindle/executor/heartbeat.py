"""Per-rank heartbeats in shared memory, readable while a rank is busy or stuck.

A worker process writes its record when it enters and leaves each call (stage or
step); the executor reads every record without asking the worker anything, so a
rank blocked inside a collective still reports where it is and for how long. A
slow rank shows its step advancing; a hung one shows the same busy stage and step
with seconds_since growing.

Each record is guarded by a sequence counter (odd while being written), so a
reader never returns a torn record.
"""

from __future__ import annotations

import struct
import time
from multiprocessing import shared_memory

from spindle.distributed.shm_broadcast import unique_shm_name
from spindle.worker.worker import Heartbeat

# version u64, pid i64, step i64, since f64 (time.monotonic, system-wide on Linux),
# busy u8, stage: 39 bytes utf-8
_RECORD = struct.Struct("<Qqqd?39s")
_STRIDE = 128


class HeartbeatBoard:
    """One record per rank. The creator (executor) unlinks it; workers attach by name."""

    def __init__(self, num_ranks: int, name: str | None = None) -> None:
        self.num_ranks = num_ranks
        self._owner = name is None
        self._shm = shared_memory.SharedMemory(name=name or unique_shm_name("hb"),
                                               create=self._owner, size=num_ranks * _STRIDE)
        self.name = self._shm.name
        self._version = [0] * num_ranks

    def write(self, rank: int, stage: str, step: int, busy: bool, pid: int) -> None:
        """Called only by the process that owns rank (one writer per record)."""
        offset = rank * _STRIDE
        version = self._version[rank] + 1  # odd while the fields are being written
        _RECORD.pack_into(self._shm.buf, offset, version, pid, step, time.monotonic(), busy,
                          stage.encode()[:39])
        self._version[rank] = version + 1
        struct.pack_into("<Q", self._shm.buf, offset, version + 1)

    def read(self, rank: int) -> Heartbeat:
        offset = rank * _STRIDE
        for _ in range(1000):
            fields = _RECORD.unpack_from(self._shm.buf, offset)
            version = fields[0]
            if version % 2 == 0 and struct.unpack_from("<Q", self._shm.buf, offset)[0] == version:
                break
        _, pid, step, since, busy, stage = fields
        if version == 0:
            return Heartbeat(rank=rank, last_stage="starting", last_step=-1, seconds_since=0.0,
                             busy=False, pid=None)
        return Heartbeat(rank=rank, last_stage=stage.rstrip(b"\0").decode(errors="replace"),
                         last_step=step, seconds_since=time.monotonic() - since, busy=busy,
                         pid=pid)

    def close(self) -> None:
        self._shm.close()
        if self._owner:
            self._shm.unlink()
