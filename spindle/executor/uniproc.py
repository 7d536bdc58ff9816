"""UniProcExecutor: one worker in this process; a call is a plain method call."""

from __future__ import annotations

from typing import Any, Callable

from spindle.executor.abstract import Executor
from spindle.worker.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        local_rank = self.config.parallel.device_ids[0] if self.config.parallel.device_ids else 0
        self.worker: Worker | None = Worker(self.config, rank=0, local_rank=local_rank)
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(self, method: str | Callable, timeout: float | None = None,
                       args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None) -> Any:
        # In process there is nothing to time out on: the call runs to completion.
        if self.worker is None:
            raise RuntimeError("the executor has been shut down")
        kwargs = kwargs or {}
        if isinstance(method, str):
            reply = getattr(self.worker, method)(*args, **kwargs)
        else:
            reply = method(self.worker, *args, **kwargs)
        return reply if unique_reply_rank is not None else [reply]

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
