"""The Ray actor side of the RayExecutor: one actor holds one Worker.

The actor only stores its arguments; the executor then drives the Worker through the
same named lifecycle as every other executor, with execute_method(name, ...) calls.
This module imports no Ray at import time (the executor wraps the class with
ray.remote), so it is importable where Ray is not installed.
"""

from __future__ import annotations

import os
import socket
from typing import Any


class RayWorkerActor:
    def __init__(self, config: Any, num_threads: int) -> None:
        self.config = config
        self.num_threads = num_threads
        self.worker = None
        self.rank: int | None = None

    # ---- placement ------------------------------------------------------------------
    def node_info(self) -> dict[str, Any]:
        """Where this actor runs: node id, the GPUs Ray gave it, its pid (the executor
        adds the node's Ray address)."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def free_port(self, ip: str) -> int:
        """A TCP port free on this node's address ip now (the torch.distributed rendezvous)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            return s.getsockname()[1]

    def setup(self, rank: int, local_rank: int, init_method: str | None,
              env: dict[str, str], node_ip: str) -> int:
        """Set this node's device visibility (before any device use), then build the
        Worker. Returns the pid."""
        os.environ.update(env)
        if self.config.parallel.world_size > 1 and "GLOO_SOCKET_IFNAME" not in os.environ:
            ifname = _interface_of(node_ip)
            if ifname is not None:  # gloo talks on the node's Ray address, not the hostname's
                os.environ["GLOO_SOCKET_IFNAME"] = ifname
        import torch

        from spindle.worker.worker import Worker

        torch.set_num_threads(self.num_threads)
        self.rank = rank
        self.worker = Worker(self.config, rank=rank, local_rank=local_rank,
                             distributed_init_method=init_method)
        return os.getpid()

    # ---- calls ----------------------------------------------------------------------
    def execute_method(self, method: str | bytes, args: tuple, kwargs: dict) -> Any:
        if self.worker is None:
            raise RuntimeError("the actor's worker is not set up")
        if isinstance(method, str):
            if method.startswith("_"):
                raise AttributeError(f"{method!r} is private: collective_rpc calls public methods")
            return getattr(self.worker, method)(*args, **kwargs)
        import cloudpickle

        return cloudpickle.loads(method)(self.worker, *args, **kwargs)

    def pid(self) -> int:
        return os.getpid()


def _interface_of(ip: str) -> str | None:
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return name
    return None
