"""A file lock per physical device: engines sharing a GPU sleep and wake in turn.

Two engines that hand one GPU back and forth must not both map memory at once
(the one waking could find the other's memory not yet released). Each sleep and
wake_up holds an exclusive flock on a file named after the device's identity (the
GPU's UUID, which is the same whatever CUDA_VISIBLE_DEVICES says), in the system's
temporary directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Iterator


def device_lock_path(device_key: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", device_key)
    return Path(tempfile.gettempdir()) / f"spindle-device-{safe}.lock"


@contextlib.contextmanager
def device_lock(device_key: str, timeout: float | None = None) -> Iterator[float]:
    """Hold the device's lock inside the block; yields the seconds waited for it.
    TimeoutError after timeout seconds (None: wait as long as it takes)."""
    path = device_lock_path(device_key)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    start = time.monotonic()
    try:
        _acquire(fd, path, timeout)
        yield time.monotonic() - start
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _acquire(fd: int, path: Path, timeout: float | None) -> None:
    if timeout is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"device lock {path} still held by another engine after "
                                   f"{timeout:.0f}s") from None
            time.sleep(0.01)
