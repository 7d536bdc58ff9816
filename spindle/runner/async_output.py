"""PendingOutput: the result of a launched step, collected later.

The runner launches a step and returns at once; the sampled tokens (and logprobs,
when asked for) are copied to pinned host memory behind the step's kernels and an
event is recorded. get() waits for that event only, so the host can schedule and
launch the next step while this one runs. get() is idempotent and the runner
calls it itself when it needs a step's tokens early (penalties read every output).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from spindle.outputs import RequestFailure
from spindle.step_messages import ModelRunnerOutput, SampledLogprobs

if TYPE_CHECKING:
    from spindle.runner.input_batch import StepBatch
    from spindle.runner.model_runner import ModelRunner
    from spindle.runner.sample import SamplerOutput


class PendingOutput:
    def __init__(self, runner: "ModelRunner | None", batch: "StepBatch | None",
                 sampled: "SamplerOutput | None",
                 failed_requests: dict[str, RequestFailure] | None = None,
                 prompt_logprobs: dict | None = None,
                 tokens_on_host: torch.Tensor | None = None) -> None:
        """tokens_on_host: sampled's tokens in pinned host memory once the step's work
        is done (a decode graph wrote them there: runner/graph_advance.py), so none are
        copied; used unless logprobs go back too."""
        self._runner = runner
        # req_id -> (first position, ids, logprobs, ranks) on the device (the step's
        # kernels compute them before its sampling, so the event covers them too).
        self._prompt_logprobs = prompt_logprobs
        self._batch = batch
        self.sampled = sampled
        self._failed_requests = failed_requests or {}  # reported with the step's tokens
        self._result: ModelRunnerOutput | None = None
        # Which request each row of the sampled tokens belongs to, for the next step's
        # inputs (see sample_row); kept apart from the batch, which get() lets go.
        self._req_ids = batch.req_ids if batch is not None else []
        self._rows = batch.sample_rows if batch is not None else None
        self._sample_row: dict[str, int] | None = None
        self._host: list[torch.Tensor] = []
        self._slot = None  # (the pinned buffers _host lies in: runner.d2h's)
        self._event = None
        # Whether the sampled tokens also sit in the CUDA graphs' input ids (the runner
        # sets it: runner/cuda_graph.py, feeds_inputs).
        self.in_graph_inputs = False
        if sampled is not None:
            self._copy_to_host(sampled, tokens_on_host)

    @property
    def sample_row(self) -> dict[str, int]:
        """The row of the sampled tokens holding each sampling request's token (a
        request verifying drafts has several rows: its first). Built when first asked."""
        if self._sample_row is None:
            rows = self._rows if self._rows is not None else np.zeros(0, dtype=np.int64)
            starts = (rows.cumsum() - rows).tolist()
            self._sample_row = {r: start for r, start, n in zip(self._req_ids, starts,
                                                                rows.tolist()) if n}
        return self._sample_row

    def rows_follow(self, req_ids: list[str]) -> bool:
        """Whether row i of the sampled tokens is req_ids[i]'s one token, for every i:
        every request of this step sampled one row, and req_ids are its requests in
        order (a decode step whose batch did not change)."""
        return (self._rows is not None and len(self._rows) == len(req_ids)
                and self._req_ids == req_ids and bool((self._rows == 1).all()))

    @staticmethod
    def ready(output: ModelRunnerOutput) -> "PendingOutput":
        pending = PendingOutput(None, None, None)
        pending._result = output
        return pending

    @property
    def done(self) -> bool:
        """Whether get() has read the step's results."""
        return self._result is not None

    def _copy_to_host(self, sampled: "SamplerOutput",
                      tokens_on_host: torch.Tensor | None = None) -> None:
        if tokens_on_host is not None and sampled.logprobs is None:
            # Nothing to copy: the event alone says when the graph has written them.
            self._slot, _ = self._runner.d2h.copy([])
            self._host, self._event = [tokens_on_host], self._slot.event
            return
        tensors = [sampled.sampled_token_ids]
        if sampled.logprobs is not None:
            tensors += [sampled.logprob_token_ids, sampled.logprobs, sampled.sampled_ranks]
        device = tensors[0].device
        if device.type == "cpu":
            self._host = tensors
            return
        self._slot, self._host = self._runner.d2h.copy(tensors)
        self._event = self._slot.event

    def get(self) -> ModelRunnerOutput:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            token_ids = self._host[0].tolist() if self._host else []
            logprobs = None
            if len(self._host) == 4:
                logprobs = (self._host[1].tolist(), self._host[2].tolist(), self._host[3].tolist())
            self._host = []
            if self._slot is not None:  # read: its buffers may take another step's copies
                self._runner.d2h.release(self._slot)
                self._slot = self._event = None
            self._result = self._runner._record_and_report(self._batch, token_ids, logprobs)
            self._result.failed_requests = self._failed_requests
            if self._prompt_logprobs:
                self._result.prompt_logprobs = _prompt_entries(self._prompt_logprobs)
                self._prompt_logprobs = None
            self._runner = self._batch = None  # no cycle keeps the runner (and its memory) alive
        return self._result


def _prompt_entries(rows: dict) -> dict[str, tuple[int, list[SampledLogprobs]]]:
    """The runner's prompt logprob tensors as ModelRunnerOutput.prompt_logprobs."""
    out = {}
    for req_id, (start, ids, values, ranks) in rows.items():
        out[req_id] = (start, [SampledLogprobs(token_ids=i, logprobs=v, sampled_rank=r)
                               for i, v, r in zip(ids.tolist(), values.tolist(),
                                                  ranks.tolist())])
    return out
