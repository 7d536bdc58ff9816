"""The scheduler's waiting queue, in the order requests are admitted: first come,
first served (a preempted request goes back to the front), or by priority (a lower
value first; then first come, first served), vLLM's two scheduling policies."""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from typing import Iterable, Iterator

from spindle.engine.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


def check_priority(priority: int, policy: str) -> None:
    """A request's priority must be 0 unless the engine schedules by priority."""
    if priority != 0 and policy != "priority":
        raise ValueError(f"priority {priority} asked for, and this engine schedules first "
                         "come, first served: start it with scheduling_policy='priority' "
                         "(--scheduling-policy priority)")


def priority_key(request: Request) -> tuple[int, float]:
    """Where a request stands under the priority policy: lower goes first."""
    return request.priority, request.arrival_time


class WaitingQueue:
    def __init__(self, policy: str = "fcfs") -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {policy!r}")
        self.by_priority = policy == "priority"
        self._fifo: deque[Request] = deque()
        # Priority: (key, tie-breaker, request), sorted.
        self._sorted: list[tuple[tuple[int, float], int, Request]] = []
        self._count = itertools.count()

    def __len__(self) -> int:
        return len(self._sorted) if self.by_priority else len(self._fifo)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[Request]:
        if self.by_priority:
            return iter([entry[2] for entry in self._sorted])
        return iter(self._fifo)

    def peek(self) -> Request:
        return self._sorted[0][2] if self.by_priority else self._fifo[0]

    def pop(self) -> Request:
        return self._sorted.pop(0)[2] if self.by_priority else self._fifo.popleft()

    def add(self, request: Request) -> None:
        """A new request: at the back (FCFS), or in its place by priority."""
        if self.by_priority:
            bisect.insort(self._sorted, (priority_key(request), next(self._count), request),
                          key=lambda entry: entry[:2])
        else:
            self._fifo.append(request)

    def add_front(self, request: Request) -> None:
        """A request that was running (preempted): at the front (FCFS), or in its place
        by priority (ahead of later arrivals of its priority)."""
        if self.by_priority:
            self.add(request)
        else:
            self._fifo.appendleft(request)

    def remove(self, request_ids: Iterable[str]) -> None:
        gone = set(request_ids)
        if self.by_priority:
            self._sorted = [e for e in self._sorted if e[2].request_id not in gone]
        elif any(r.request_id in gone for r in self._fifo):
            self._fifo = deque(r for r in self._fifo if r.request_id not in gone)
