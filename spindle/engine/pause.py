"""Pausing the engine: the pause modes, and the gate the engine core consults.

This is the one source of truth for what a pause does. The core owns a
SchedulingGate and asks it whether it may schedule this step and, for each new
request, whether to queue it now, hold it until resume, or refuse it. Sleep
level 0 (only scheduling stops) is the same gate with new requests refused, so
the sleep feature reuses it rather than growing a second state machine.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from spindle.engine.request import Request


class PauseMode(str, enum.Enum):
    """What a pause does with requests already accepted and with new ones."""

    ABORT = "abort"  # finish in-flight requests with reason "abort"; refuse new ones
    WAIT = "wait"  # let in-flight requests run to completion; hold new ones until resume
    KEEP = "keep"  # freeze in-flight requests where they are; hold new ones; both go on at resume

    @classmethod
    def parse(cls, value: "str | PauseMode") -> "PauseMode":
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise ValueError(f"pause mode must be one of {allowed}, got {value!r}") from None

    @property
    def holds_new_requests(self) -> bool:
        return self is not PauseMode.ABORT

    @property
    def runs_in_flight(self) -> bool:
        return self is PauseMode.WAIT


class EngineUnavailableError(RuntimeError):
    """The engine refuses new requests for now (paused with mode=abort, or asleep).

    Servers answer it with 503: the request was fine, the client may retry later.
    """


class SleepModeUnavailableError(NotImplementedError):
    """A sleep level or wake-up tag needs an executor that can release device memory."""


class SchedulingGate:
    """Pause and sleep state, and the requests held while paused.

    Invariants: held requests were never given to the scheduler; the core
    schedules only when may_schedule is true; a request refused here was never
    registered anywhere.
    """

    def __init__(self) -> None:
        self.pause_mode: PauseMode | None = None
        self.sleep_level: int | None = None
        self.asleep: list[str] = []  # sleep tags not woken yet (see engine_core.SLEEP_TAGS)
        self.held: list[Request] = []

    @property
    def is_paused(self) -> bool:
        return self.pause_mode is not None

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level is not None

    @property
    def may_schedule(self) -> bool:
        if self.is_sleeping:
            return False
        return self.pause_mode is None or self.pause_mode.runs_in_flight

    def check_accepting(self) -> None:
        """Raise EngineUnavailableError if a new request would be refused now."""
        if self.is_sleeping:
            raise EngineUnavailableError(
                f"the engine is sleeping (level {self.sleep_level}) and takes no requests "
                "until it is woken up")
        if self.pause_mode is not None and not self.pause_mode.holds_new_requests:
            raise EngineUnavailableError(
                f"the engine is paused (mode={self.pause_mode.value}) and takes no requests "
                "until it is resumed")

    def admit(self, request: "Request") -> bool:
        """True: give the request to the scheduler now. False: held until resume."""
        self.check_accepting()
        if self.pause_mode is None:
            return True
        self.held.append(request)
        return False

    def pause(self, mode: PauseMode) -> None:
        self.pause_mode = PauseMode.parse(mode)

    def resume(self) -> list["Request"]:
        """Unpause; returns the held requests, in arrival order, for the scheduler."""
        self.pause_mode = None
        held, self.held = self.held, []
        return held

    def drop_held(self, request_ids: Iterable[str] | None = None) -> list[str]:
        """Forget held requests (all of them when request_ids is None); returns their ids."""
        wanted = None if request_ids is None else set(request_ids)
        dropped = [r.request_id for r in self.held if wanted is None or r.request_id in wanted]
        if dropped:
            gone = set(dropped)
            self.held = [r for r in self.held if r.request_id not in gone]
        return dropped

    def sleep(self, level: int, tags: Iterable[str]) -> None:
        self.sleep_level, self.asleep = level, list(tags)

    def wake(self, tags: Iterable[str]) -> None:
        """Wake tags; the engine is awake once no tag sleeps."""
        woken = set(tags)
        self.asleep = [t for t in self.asleep if t not in woken]
        if not self.asleep:
            self.sleep_level = None
