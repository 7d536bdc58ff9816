"""PendingOutput: the result of a launched step, collected later.

The runner launches a step and returns at once; the sampled tokens (and logprobs,
when asked for) are copied to pinned host memory behind the step's kernels and an
event is recorded. get() waits for that event only, so the host can schedule and
launch the next step while this one runs. get() is idempotent and the runner
calls it itself when it needs a step's tokens early (penalties read every output).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from spindle.outputs import RequestFailure
from spindle.step_messages import ModelRunnerOutput

if TYPE_CHECKING:
    from spindle.runner.input_batch import StepBatch
    from spindle.runner.model_runner import ModelRunner
    from spindle.runner.sample import SamplerOutput


class PendingOutput:
    def __init__(self, runner: "ModelRunner | None", batch: "StepBatch | None",
                 sampled: "SamplerOutput | None",
                 failed_requests: dict[str, RequestFailure] | None = None) -> None:
        self._runner = runner
        self._batch = batch
        self.sampled = sampled
        self._failed_requests = failed_requests or {}  # reported with the step's tokens
        self._result: ModelRunnerOutput | None = None
        # Which row of the sampled tokens belongs to which request.
        self.sample_row: dict[str, int] = {}
        if batch is not None:  # (a request verifying drafts has several rows: its first)
            rows = batch.sample_rows
            starts = (rows.cumsum() - rows).tolist()
            self.sample_row = {r: start for r, start, n in zip(batch.req_ids, starts, rows.tolist())
                               if n}
        self._host: list[torch.Tensor] = []
        self._event = None
        if sampled is not None:
            self._copy_to_host(sampled)

    @staticmethod
    def ready(output: ModelRunnerOutput) -> "PendingOutput":
        pending = PendingOutput(None, None, None)
        pending._result = output
        return pending

    def _copy_to_host(self, sampled: "SamplerOutput") -> None:
        tensors = [sampled.sampled_token_ids]
        if sampled.logprobs is not None:
            tensors += [sampled.logprob_token_ids, sampled.logprobs, sampled.sampled_ranks]
        device = tensors[0].device
        if device.type == "cpu":
            self._host = tensors
            return
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            self._host.append(host)
        self._event = torch.cuda.Event()
        self._event.record()

    def get(self) -> ModelRunnerOutput:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            token_ids = self._host[0].tolist() if self._host else []
            logprobs = None
            if len(self._host) == 4:
                logprobs = (self._host[1].tolist(), self._host[2].tolist(), self._host[3].tolist())
            self._result = self._runner._record_and_report(self._batch, token_ids, logprobs)
            self._result.failed_requests = self._failed_requests
            self._host = []
            self._runner = self._batch = None  # no cycle keeps the runner (and its memory) alive
        return self._result
