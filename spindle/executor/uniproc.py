"""UniProcExecutor: one worker in this process; a call is a plain method call.

It never fails as a whole: an error of the worker is raised from the call itself,
and a call cannot time out (nothing can interrupt it).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable

import torch

from spindle.executor.abstract import Executor
from spindle.executor.devices import worker_device_indices
from spindle.platforms import resolve_platform
from spindle.step_messages import SchedulerOutput
from spindle.worker.worker import Worker


class UniProcExecutor(Executor):
    supports_async_scheduling = True  # the runner launches a step and returns
    supports_pipeline_parallel = False

    def _init_executor(self) -> None:
        platform = resolve_platform(self.config.device.device_type)
        device_index = worker_device_indices(self.config.parallel, platform)[0]
        if self.config.device.cpu_threads is not None:
            torch.set_num_threads(self.config.device.cpu_threads)  # (the whole process's)
        self.worker: Worker | None = Worker(self.config, rank=0, local_rank=device_index)
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(self, method: str | Callable, timeout: float | None = None,
                       args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None, non_block: bool = False) -> Any:
        # In process there is nothing to time out on: the call runs to completion.
        if non_block:
            future: Future = Future()
            try:
                future.set_result(self.collective_rpc(method, timeout, args, kwargs,
                                                      unique_reply_rank))
            except Exception as e:
                future.set_exception(e)
            return future
        self._raise_if_unusable()
        self._check_reply_rank(unique_reply_rank)
        kwargs = kwargs or {}
        if isinstance(method, str):
            reply = getattr(self.worker, method)(*args, **kwargs)
        else:
            reply = method(self.worker, *args, **kwargs)
        return reply if unique_reply_rank is not None else [reply]

    def execute_model_async(self, sched: SchedulerOutput) -> Any:
        """Launch a step in process; the returned PendingOutput's get() waits for it."""
        self._raise_if_unusable()
        return self.worker.execute_model_async(sched)

    def _shutdown_workers(self, clean: bool) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None

    def _stop_workers(self) -> None:
        """Never called: this executor does not fail as a whole."""
