"""EngineCore: the scheduler and the executor, stepped together.

step() is the whole loop: schedule -> execute -> update. The core handles token
ids only; text lives in the output processor above it.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable

from spindle.config import EngineConfig
from spindle.engine.request import Request, RequestStatus
from spindle.engine.scheduler import Scheduler
from spindle.engine.scheduler_output import EngineCoreOutput, ModelRunnerOutput
from spindle.engine.startup_table import format_startup_table
from spindle.executor.abstract import Executor

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        start = time.perf_counter()
        self.executor = Executor.get_class(config)(config)
        try:
            self.num_kv_blocks = self._initialize_kv_caches()
        except BaseException:
            self.executor.shutdown()
            raise
        self.scheduler = Scheduler(config.scheduler, config.cache, self.num_kv_blocks)
        self.startup_seconds = time.perf_counter() - start
        self.startup_table = format_startup_table(self.executor.lifecycle_reports())
        logger.info("startup in %.2fs; KV cache: %d blocks of %d tokens\n%s", self.startup_seconds,
                    self.num_kv_blocks, config.cache.block_size, self.startup_table)

    def _initialize_kv_caches(self) -> int:
        available = min(self.executor.determine_available_memory())
        block_bytes = max(self.executor.kv_cache_block_bytes())
        if block_bytes == 0:  # a model without a KV cache (encoder-only)
            self.executor.initialize_kv_cache(0)
            return 0
        num_blocks = available // block_bytes
        block_size = self.config.cache.block_size
        needed = -(-self.config.model.max_model_len // block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache budget ({available / 2**20:.1f} MiB, {num_blocks} blocks of "
                f"{block_size} tokens) cannot hold one sequence of max_model_len="
                f"{self.config.model.max_model_len} tokens ({needed} blocks); raise "
                "kv_cache_memory_bytes / gpu_memory_utilization or lower max_model_len")
        self.executor.initialize_kv_cache(num_blocks)
        return num_blocks

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.abort_requests(list(request_ids))

    def finish_requests(self, request_ids: Iterable[str]) -> None:
        """Finish requests the output processor stopped (a stop string matched)."""
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        sched = self.scheduler.schedule()
        if sched.is_empty and not (sched.finished_req_ids or sched.preempted_req_ids):
            runner_output = ModelRunnerOutput()  # nothing for the workers to do or forget
        else:
            runner_output = self.executor.execute_model(sched)
        # Always: the scheduler may have finished requests on its own (e.g. one that
        # can never fit), and reports them here.
        return self.scheduler.update_from_output(sched, runner_output)

    def shutdown(self) -> None:
        self.executor.shutdown()
