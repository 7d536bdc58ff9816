"""runner/compile_ahead.py's hook, driven the way Triton drives it (no GPU needed):
which launches it skips and hands to its threads, which it lets through, and what it
leaves installed. tests/test_compile_gpu.py runs it for real on CUDA."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

knobs = pytest.importorskip("triton").knobs

from spindle.runner.compile_ahead import compiling_ahead  # noqa: E402


class FakeKernel:
    """A JITFunction's preload, recorded with the thread it ran on."""

    def __init__(self, fail: bool = False) -> None:
        self.preloaded: list[tuple[str, int]] = []
        self.fail = fail

    def preload(self, specialization_data: str) -> None:
        if self.fail:
            raise RuntimeError(f"cannot compile {specialization_data}")
        self.preloaded.append((specialization_data, threading.get_ident()))


def launch(kernel: FakeKernel, key: str, manual: bool = False):
    """What JITFunction._do_compile does on an in-memory miss: ask the hook."""
    hook = knobs.runtime.jit_cache_hook
    if hook is None:
        return None
    return hook(key=key, repr=key, fn=SimpleNamespace(jit_function=kernel),
                compile={"key": key, "specialization_data": f"spec-{key}"},
                is_manual_warmup=manual, already_compiled=False)


@pytest.fixture(autouse=True)
def no_hook():
    saved = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = None
    yield
    knobs.runtime.jit_cache_hook = saved


def test_a_miss_is_skipped_and_compiled_once_on_a_pool_thread():
    kernel = FakeKernel()
    with compiling_ahead(torch.device("cpu"), threads=2) as report:
        assert launch(kernel, "a") is True
        assert launch(kernel, "a") is True  # a second launch before it is ready
        assert launch(kernel, "b") is True
        assert launch(kernel, "c", manual=True) is None  # a preload: compiles
    assert report["kernels"] == 2
    assert sorted(spec for spec, _ in kernel.preloaded) == ["spec-a", "spec-b"]
    assert all(thread != threading.get_ident() for _, thread in kernel.preloaded)
    assert knobs.runtime.jit_cache_hook is None
    assert launch(kernel, "d") is None  # after the context: compiled at launch


def test_cuda_without_an_index_is_the_callers_current_device(monkeypatch):
    """The compiling threads set their device before compiling; "cuda" alone must mean
    the device current on the thread that entered, not the pool thread's (device 0)."""
    set_on_threads = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", set_on_threads.append)
    with compiling_ahead(torch.device("cuda"), threads=2):
        launch(FakeKernel(), "a")
    assert set_on_threads == [torch.device("cuda", 3)]


def test_other_threads_launch_as_usual():
    kernel, seen = FakeKernel(), []
    with compiling_ahead(torch.device("cpu"), threads=1) as report:
        worker = threading.Thread(target=lambda: seen.append(launch(kernel, "x")))
        worker.start()
        worker.join()
    assert seen == [None] and report["kernels"] == 0 and not kernel.preloaded


def test_a_compile_error_is_raised_on_leaving():
    with pytest.raises(RuntimeError, match="cannot compile spec-a"):
        with compiling_ahead(torch.device("cpu"), threads=1):
            assert launch(FakeKernel(fail=True), "a") is True
    assert knobs.runtime.jit_cache_hook is None


def test_the_previous_hook_is_asked_first_and_put_back():
    calls = []

    def previous(**kwargs):
        calls.append(kwargs["key"])
        return kwargs["key"] == "veto"

    knobs.runtime.jit_cache_hook = previous
    kernel = FakeKernel()
    with compiling_ahead(torch.device("cpu"), threads=1):
        assert launch(kernel, "veto") is True
        assert launch(kernel, "a") is True
    assert calls == ["veto", "a"] and [s for s, _ in kernel.preloaded] == ["spec-a"]
    assert knobs.runtime.jit_cache_hook is previous


def test_a_hook_installed_on_top_stays_and_ours_only_passes_on():
    kernel = FakeKernel()
    with compiling_ahead(torch.device("cpu"), threads=1):
        ours = knobs.runtime.jit_cache_hook

        def on_top(**kwargs):
            return ours(**kwargs)

        knobs.runtime.jit_cache_hook = on_top
    assert knobs.runtime.jit_cache_hook is on_top
    assert launch(kernel, "later") is None and not kernel.preloaded
