"""SleepModeBackend: how a worker gives its device memory back and takes it again.

A backend serves one worker. The worker creates it before the model is loaded and
allocates the weights inside allocating("weights") and the KV cache inside
allocating("kv_cache"); sleep then calls suspend(level) and wake_up resume(tags).
What the backend acts on is the runner, through the SleepTarget protocol below: the
backend decides where the bytes go, the runner knows which tensors hold them.

Levels: 1 keeps a host copy of the weights and drops the KV cache; 2 drops both and
reloads the weights from the checkpoint on wake (buffers that the checkpoint does not
hold, such as rotary tables, are kept on the host). Level 0 never reaches a backend:
it only stops scheduling.

Backends are found by name: the built-ins, those given to register_backend(), and
those that installed packages declare in the "spindle.sleep_backends" entry point
group (an entry point names a SleepModeBackend subclass, or a callable returning one).
"""

from __future__ import annotations

import abc
import contextlib
import importlib.metadata
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from spindle.platforms.interface import Platform

logger = logging.getLogger(__name__)

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
MEMORY_TAGS = (WEIGHTS, KV_CACHE)
SLEEP_LEVELS = (1, 2)  # the levels a backend sees (level 0 only pauses scheduling)
ENTRY_POINT_GROUP = "spindle.sleep_backends"


class SleepTarget(Protocol):
    """What a backend needs from the worker's model runner."""

    device: torch.device

    def tagged_tensors(self, tag: str) -> list[torch.Tensor]:
        """The distinct tensors holding tag's memory (for "weights": parameters and
        buffers; for "kv_cache": every cache tensor, list entries flattened)."""

    def buffers_outside_checkpoint(self) -> list[torch.Tensor]:
        """Weight tensors a checkpoint reload does not restore (e.g. rotary tables)."""

    def reload_weights(self) -> None:
        """Copy the checkpoint into the existing weight tensors again."""

    def before_sleep(self, addresses_will_change: bool) -> None:
        """Called before memory is released: drop what would point at moved memory
        (captured CUDA graphs) when addresses will change."""

    def after_wake(self, woken: Sequence[str], all_awake: bool) -> None:
        """Called once tags woke: zero a woken KV cache; once every tag is awake,
        recapture what before_sleep dropped."""


@dataclass
class SleepState:
    """Where a worker's tagged memory is now. device_bytes: bytes of each tag on the
    device (0 for a tag asleep); host_bytes: host memory holding copies."""

    level: int | None  # None: awake
    asleep: tuple[str, ...]
    device_bytes: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0


class SleepModeBackend(abc.ABC):
    """Suspends and resumes one worker's tagged memory. Subclasses implement
    _release(level) and _restore(tags); this class owns the state machine: which
    tags are asleep, at which level, and the errors for calls out of order."""

    name: ClassVar[str] = ""
    # Captured CUDA graphs stay valid across sleep (tensor addresses are kept).
    preserves_graphs: ClassVar[bool] = False
    # The engine must back weights and KV cache by the cumem allocator for it.
    needs_cumem_allocator: ClassVar[bool] = False

    def __init__(self, target: SleepTarget, platform: "Platform") -> None:
        self.target = target
        self.platform = platform
        self.level: int | None = None
        self.asleep: list[str] = []

    @classmethod
    def check_available(cls, platform: "Platform") -> None:
        """Raise ValueError saying what is missing when it cannot run on platform."""
        return None

    @contextlib.contextmanager
    def allocating(self, tag: str) -> Iterator[None]:
        """Scope in which the runner allocates tag's tensors (weights, kv_cache)."""
        _check_tags([tag])
        yield

    def suspend(self, level: int) -> None:
        if level not in SLEEP_LEVELS:
            raise ValueError(f"a sleep backend serves levels {SLEEP_LEVELS}, got {level!r}")
        if self.level is not None:
            raise RuntimeError(f"already asleep at level {self.level} (still asleep: "
                               f"{', '.join(self.asleep)}); wake_up first")
        self.platform.synchronize(self.target.device)
        self.target.before_sleep(addresses_will_change=not self.preserves_graphs)
        self._release(level)
        self.level, self.asleep = level, list(MEMORY_TAGS)
        self.platform.empty_cache()

    def resume(self, tags: Sequence[str] | None = None) -> None:
        """Wake tags (None: every tag asleep). A tag that is not asleep is an error."""
        tags = list(self.asleep if tags is None else tags)
        _check_tags(tags)
        not_asleep = [t for t in tags if t not in self.asleep]
        if not_asleep:
            raise ValueError(f"cannot wake {', '.join(not_asleep)}: not asleep "
                             f"(asleep: {', '.join(self.asleep) or 'nothing'})")
        ordered = [t for t in MEMORY_TAGS if t in tags]  # weights first, whatever the order
        self._restore(ordered)
        self.asleep = [t for t in self.asleep if t not in ordered]
        level = self.level
        if not self.asleep:
            self.level = None
        self.target.after_wake(ordered, all_awake=not self.asleep)
        logger.debug("woke %s (level %s)", ordered, level)

    @abc.abstractmethod
    def _release(self, level: int) -> None:
        """Give back the device memory of every tag (keeping a host copy of the
        weights at level 1, and of buffers_outside_checkpoint() at level 2)."""

    @abc.abstractmethod
    def _restore(self, tags: list[str]) -> None:
        """Take device memory back for tags (weights before kv_cache) and refill the
        weights; the KV cache's content is not restored (the runner zeroes it)."""

    @abc.abstractmethod
    def state(self) -> SleepState:
        """Device and host bytes per tag now."""

    def close(self) -> None:
        """Release what the backend holds (at worker shutdown)."""
        return None


def _check_tags(tags: Sequence[str]) -> None:
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ValueError(f"memory tags must be among {', '.join(MEMORY_TAGS)}, got {bad}")


# ---- registry ---------------------------------------------------------------------------
BackendFactory = Callable[..., SleepModeBackend]

_BUILTIN_BACKENDS = {
    "cumem": "spindle.memory.cumem:CuMemSleepBackend",
    "portable": "spindle.memory.portable:PortableSleepBackend",
}


class BackendRegistry:
    """Name -> backend class. Built-ins and entry points load lazily on lookup."""

    def __init__(self) -> None:
        self._registered: dict[str, Any] = {}

    def register(self, name: str, backend: Any, *, replace: bool = False) -> None:
        """backend: a SleepModeBackend subclass or an 'module:attribute' path to one."""
        if not name or not isinstance(name, str):
            raise ValueError(f"a sleep backend needs a non-empty name, got {name!r}")
        if not replace and name in self.names():
            raise ValueError(f"sleep backend {name!r} is already registered "
                             "(pass replace=True to override it)")
        self._registered[name] = backend

    def unregister(self, name: str) -> None:
        self._registered.pop(name, None)

    def names(self) -> list[str]:
        return sorted(set(_BUILTIN_BACKENDS) | set(self._registered) | set(_entry_points()))

    def get(self, name: str) -> type[SleepModeBackend]:
        if name in self._registered:
            found = self._registered[name]
        elif name in _BUILTIN_BACKENDS:
            found = _BUILTIN_BACKENDS[name]
        elif name in _entry_points():
            found = _entry_points()[name]
        else:
            raise ValueError(f"unknown sleep_mode_backend {name!r}; known: "
                             f"{', '.join(self.names())}")
        backend = _resolve(found, name)
        if not (isinstance(backend, type) and issubclass(backend, SleepModeBackend)):
            raise ValueError(f"sleep backend {name!r} resolves to {backend!r}, which is not a "
                             "SleepModeBackend subclass")
        return backend


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _resolve(found: Any, name: str) -> Any:
    try:
        if isinstance(found, importlib.metadata.EntryPoint):
            found = found.load()
        elif isinstance(found, str):
            module, attr = found.split(":")
            found = getattr(importlib.import_module(module), attr)
    except Exception as e:
        raise ValueError(f"cannot load sleep backend {name!r}: {e}") from e
    if not isinstance(found, type) and callable(found):
        found = found()  # a factory function returning the class
    return found


REGISTRY = BackendRegistry()


def register_backend(name: str, backend: Any, *, replace: bool = False) -> None:
    """Make a sleep backend available as sleep_mode_backend=name (in this process;
    use the entry point group for worker processes and Ray actors)."""
    REGISTRY.register(name, backend, replace=replace)


def get_backend_class(name: str) -> type[SleepModeBackend]:
    return REGISTRY.get(name)


def default_backend_name(platform: "Platform") -> str:
    """cumem where the platform has it (CUDA with cuda-python), else portable."""
    if platform.is_cumem_allocator_available():
        return "cumem"
    if platform.device_type == "cuda":
        logger.warning("sleep mode: cuda-python (cuda.bindings) is not installed, so the "
                       "portable backend is used: it recaptures CUDA graphs on wake. Install "
                       "cuda-python for the cumem backend, which keeps them.")
    return "portable"
