"""The shared-memory broadcast ring: order, wrap-around, overflow, back-pressure,
cleanup, and a reader in another process."""

from __future__ import annotations

import multiprocessing
import os
import threading
from pathlib import Path

import pytest

from spindle.distributed.shm_broadcast import SHM_PREFIX, BroadcastRing, RingReader


def _shm_names(ring_name: str) -> set[str]:
    # The ring and its overflow segments share the writer's pid in their names.
    pid = ring_name.split("_")[2]
    return {p.name for p in Path("/dev/shm").glob(f"{SHM_PREFIX}*_{pid}_*")}


def _read_all(reader: RingReader, n: int, out: list) -> None:
    for _ in range(n):
        out.append(reader.dequeue(timeout=10))


def test_every_reader_gets_every_message_in_order_across_wraparound():
    ring = BroadcastRing(num_readers=3, num_slots=4, slot_bytes=256)
    readers = [RingReader(ring.reader_handle(i)) for i in range(3)]
    results: list[list] = [[] for _ in readers]
    threads = [threading.Thread(target=_read_all, args=(r, 50, out))
               for r, out in zip(readers, results)]
    for t in threads:
        t.start()
    for i in range(50):  # 50 messages through 4 slots: the writer waits for slow readers
        ring.enqueue({"i": i, "pad": "x" * (i % 7)}, timeout=10)
    for t in threads:
        t.join(10)
    assert all(out == [{"i": i, "pad": "x" * (i % 7)} for i in range(50)] for out in results)
    for r in readers:
        r.close()
    ring.close()


def test_large_payloads_take_the_overflow_path_and_are_unlinked():
    ring = BroadcastRing(num_readers=2, num_slots=2, slot_bytes=128)
    readers = [RingReader(ring.reader_handle(i)) for i in range(2)]
    big = list(range(10_000))  # far more than a 128-byte slot
    ring.enqueue(big)
    assert len(_shm_names(ring.name)) == 2  # the ring and one overflow segment
    assert [r.dequeue(timeout=5) for r in readers] == [big, big]
    ring.enqueue("small")
    ring.enqueue("small again")  # reuses the overflow message's slot: segment dropped
    assert [r.dequeue(timeout=5) for r in readers] == ["small", "small"]
    assert len(_shm_names(ring.name)) == 1
    for r in readers:
        r.close()
    ring.close()
    assert _shm_names(ring.name) == set()


def test_full_ring_times_out_or_aborts_instead_of_waiting_forever():
    ring = BroadcastRing(num_readers=2, num_slots=2, slot_bytes=64)
    reader = RingReader(ring.reader_handle(0))
    ring.enqueue(1)
    ring.enqueue(2)  # reader 1 never reads: the ring is now full
    with pytest.raises(TimeoutError, match="full"):
        ring.enqueue(3, timeout=0.2)
    with pytest.raises(ConnectionError, match="reader died"):
        ring.enqueue(3, abort=lambda: ConnectionError("reader died"))
    reader.close()
    ring.close()


def test_reader_times_out_and_sees_writer_close():
    ring = BroadcastRing(num_readers=1)
    reader = RingReader(ring.reader_handle(0))
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=0.05)
    ring.close()
    with pytest.raises(EOFError):
        reader.dequeue(timeout=1.0)  # the wakeup pipe reads EOF: no busy loop, no hang
    reader.close()


def test_two_rings_never_share_a_name():
    a, b = BroadcastRing(1), BroadcastRing(1)
    assert a.name != b.name and a.name.startswith(SHM_PREFIX)
    a.close()
    b.close()


def _child_reader(handle, out_conn) -> None:
    reader = RingReader(handle)
    out_conn.send([reader.dequeue(timeout=20) for _ in range(3)])
    reader.close()


def test_reader_in_a_spawned_process():
    ctx = multiprocessing.get_context("spawn")
    ring = BroadcastRing(num_readers=1, num_slots=2, slot_bytes=64)
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_reader, args=(ring.reader_handle(0), send))
    proc.start()
    ring.release_reader_ends()
    payloads = ["a", b"x" * 5000, {"k": os.getpid()}]  # the middle one overflows
    for p in payloads:
        ring.enqueue(p, timeout=20)
    assert recv.recv() == payloads
    proc.join(20)
    assert proc.exitcode == 0
    ring.close()
    assert _shm_names(ring.name) == set()
