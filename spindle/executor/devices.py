"""Which device each worker drives: rank -> local rank -> device index.

Device indices are as this process sees devices, i.e. after CUDA_VISIBLE_DEVICES
(without it they are the physical ids). device_ids pins the workers to explicit
devices, one per local rank. Everything is checked here, before any worker
process starts, so a bad id is a clear error and not a crash in a child.

On CPU there is one device, the host, and every worker shares it (threads are
split between them instead); device_ids may only name device 0 there, so it is
of use only to a one-worker engine.
"""

from __future__ import annotations

import os

from spindle.config import ParallelConfig
from spindle.platforms.interface import Platform


def worker_device_indices(parallel: ParallelConfig, platform: Platform) -> list[int]:
    """The device index of every rank's worker, in rank order (one node: local rank = rank)."""
    world_size = parallel.world_size
    count = platform.device_count()
    if parallel.device_ids is not None:
        ids = list(parallel.device_ids)
        bad = [i for i in ids if not 0 <= i < count]
        if bad:
            raise ValueError(f"device_ids {ids}: {bad} not among the {count} "
                             f"{platform.device_type} device(s) this process sees "
                             f"(ids 0..{count - 1}{_visibility_note(platform)})")
        return [ids[local_rank_of(rank, world_size)] for rank in range(world_size)]
    if platform.workers_share_device:
        return [0] * world_size
    if world_size > count:
        raise ValueError(f"{world_size} workers (tensor_parallel_size * pipeline_parallel_size) "
                         f"need {world_size} {platform.device_type} devices, but this process "
                         f"sees {count}{_visibility_note(platform)}")
    return [local_rank_of(rank, world_size) for rank in range(world_size)]


def local_rank_of(rank: int, world_size: int) -> int:
    """Rank on this node. Executors here run one node, so it is the rank itself."""
    return rank


def _visibility_note(platform: Platform) -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if platform.device_type == "cuda" and visible is not None:
        return f"; CUDA_VISIBLE_DEVICES={visible!r}"
    return ""
