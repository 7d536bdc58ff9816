"""runner/kernel_plan.py: what a plan keeps, when a saved one is used or refused, and how
a start adds to it; and compile_ahead's recording hook and background Triton hash.
No GPU needed (stand-in kernels with JITFunction's fn, cache_key and preload);
tests/test_compile_gpu.py starts engines from a plan on CUDA."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")
knobs = triton.knobs

from spindle.runner import kernel_plan  # noqa: E402
from spindle.runner.compile_ahead import (hash_triton_in_background,  # noqa: E402
                                          recording_compiles)
from spindle.runner.kernel_plan import (KernelPlan, engine_fingerprint, load_plan,  # noqa: E402
                                        plan_path, save_plan)


class StandInKernel:
    """What a plan reads of a JITFunction: fn (its module and name), cache_key, preload."""

    def __init__(self, name: str, source_key: str, fail: bool = False) -> None:
        def fn():
            pass

        fn.__module__, fn.__qualname__ = __name__, name
        self.fn, self.cache_key, self.fail = fn, source_key, fail
        self.preloaded: list[str] = []
        self.device_caches: dict = {}  # device -> (compiled variants by key, ...)

    def preload(self, specialization_data: str) -> None:
        if self.fail:
            raise RuntimeError("no longer loads")
        self.preloaded.append(specialization_data)


kernel_a = StandInKernel("kernel_a", "source-a")
kernel_b = StandInKernel("kernel_b", "source-b")
broken = StandInKernel("broken", "source-broken", fail=True)


@pytest.fixture(autouse=True)
def fresh_kernels():
    for kernel in (kernel_a, kernel_b, broken):
        kernel.preloaded.clear()
        kernel.device_caches = {}
    kernel_a.cache_key = "source-a"
    saved = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = None
    yield
    knobs.runtime.jit_cache_hook = saved


def test_a_saved_plan_loads_back_without_duplicates(tmp_path):
    path = tmp_path / "plans" / "p.json"
    assert save_plan(path, [(kernel_a, "s1"), (kernel_b, "s2"), (kernel_a, "s1"), (kernel_a, "s3")])
    assert load_plan(path) == [(kernel_a, "s1"), (kernel_b, "s2"), (kernel_a, "s3")]
    assert not list(path.parent.glob("*.tmp"))  # written whole, then renamed


def test_a_kernel_whose_source_changed_makes_the_plan_stale(tmp_path):
    path = tmp_path / "p.json"
    save_plan(path, [(kernel_a, "s1"), (kernel_b, "s2")])
    kernel_a.cache_key = "source-a, edited"
    assert load_plan(path) is None


@pytest.mark.parametrize("entry", [
    {"module": __name__, "name": "no_such_kernel"},
    {"module": "spindle.no_such_module", "name": "kernel_a"},
    {"name": "kernel_a"},
])
def test_a_kernel_that_is_gone_makes_the_plan_stale(tmp_path, entry):
    path = tmp_path / "p.json"
    save_plan(path, [(kernel_b, "s2")])
    plan = json.loads(path.read_text())
    plan["variants"].append({"source_key": "x", "specialization": "s", **entry})
    path.write_text(json.dumps(plan))
    assert load_plan(path) is None


@pytest.mark.parametrize("text", ["", "{not json", "[]",
                                  json.dumps({"format": 999, "variants": []})])
def test_a_plan_that_cannot_be_read_is_not_used(tmp_path, text):
    path = tmp_path / "p.json"
    path.write_text(text)
    assert load_plan(path) is None
    assert load_plan(tmp_path / "missing.json") is None


def test_a_plan_that_cannot_be_written_is_skipped_quietly(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert save_plan(blocker / "p.json", [(kernel_a, "s1")]) is False  # parent is a file


def test_the_plan_lives_in_the_triton_cache_dir_and_its_name_follows_the_engine(
        tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    one, other = engine_fingerprint("config A", "rank 0"), engine_fingerprint("config B", "rank 0")
    assert one == engine_fingerprint("config A", "rank 0") and one != other
    assert plan_path(one) == tmp_path / kernel_plan.PLAN_DIR / f"{one}.json"


def test_a_start_without_a_plan_saves_what_compile_ahead_found(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    plan = KernelPlan(engine_fingerprint("engine"))
    assert plan.preload(torch.device("cpu"), threads=2) is None and not plan.used
    plan.add([(kernel_a, "s1")])
    plan.add([(kernel_b, "s2")])
    plan.save()
    assert load_plan(plan.path) == [(kernel_a, "s1"), (kernel_b, "s2")]

    again = KernelPlan(engine_fingerprint("engine"))
    report = again.preload(torch.device("cpu"), threads=2)
    assert again.used and report["kernels"] == 2 and not report["failed"]
    assert kernel_a.preloaded == ["s1"] and kernel_b.preloaded == ["s2"]
    mtime = again.path.stat().st_mtime_ns
    again.save()  # nothing new: not rewritten
    assert again.path.stat().st_mtime_ns == mtime
    assert again.preload(torch.device("cpu"), threads=2)["kernels"] == 0  # loaded already
    assert kernel_a.preloaded == ["s1"]


def test_a_variant_that_fails_to_preload_leaves_the_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fingerprint = engine_fingerprint("engine")
    save_plan(plan_path(fingerprint), [(kernel_a, "s1"), (broken, "s9")])
    plan = KernelPlan(fingerprint)
    report = plan.preload(torch.device("cpu"), threads=2)
    assert report["kernels"] == 1 and report["failed"] == [(broken, "s9")]
    plan.save()
    assert load_plan(plan.path) == [(kernel_a, "s1")]


def test_a_plan_preloads_on_the_callers_device_when_given_cuda_alone(monkeypatch):
    """As compiling_ahead: the preload threads' own current device is 0, so "cuda"
    must be resolved on the calling thread."""
    set_on_threads = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", set_on_threads.append)
    report = kernel_plan.preload_variants([(kernel_a, "s1")], torch.device("cuda"), threads=2)
    assert report["kernels"] == 1 and kernel_a.preloaded == ["s1"]
    assert set_on_threads == [torch.device("cuda", 2)]


def test_a_kernel_another_engine_of_the_process_compiled_is_left_alone(tmp_path,
                                                                       monkeypatch):
    """A second engine in one process (a model pool) does not reload, and so replace,
    the variants the first one compiled of a kernel."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fingerprint = engine_fingerprint("engine")
    save_plan(plan_path(fingerprint), [(kernel_a, "s1"), (kernel_b, "s2")])
    kernel_b.device_caches = {0: ({"compiled key": object()}, {}, None, None, None)}
    report = KernelPlan(fingerprint).preload(torch.device("cpu"), threads=2)
    assert report["kernels"] == 1 and not report["failed"]
    assert kernel_a.preloaded == ["s1"] and kernel_b.preloaded == []


def _launch(kernel, key: str, manual: bool = False):
    """What JITFunction does on an in-memory miss: ask the hook."""
    hook = knobs.runtime.jit_cache_hook
    return None if hook is None else hook(
        key=key, repr=key, fn=SimpleNamespace(jit_function=kernel),
        compile={"key": key, "specialization_data": f"spec-{key}"},
        is_manual_warmup=manual, already_compiled=False)


def test_misses_of_a_used_plan_compile_on_launch_and_join_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fingerprint = engine_fingerprint("engine")
    save_plan(plan_path(fingerprint), [(kernel_a, "s1")])
    plan = KernelPlan(fingerprint)
    plan.preload(torch.device("cpu"), threads=1)
    with plan.recording_misses():
        assert _launch(kernel_b, "x") is None  # None: Triton compiles it now
        assert _launch(kernel_b, "y", manual=True) is None  # a preload: not a miss
        seen = []
        worker = threading.Thread(target=lambda: seen.append(_launch(kernel_b, "z")))
        worker.start()
        worker.join()  # another thread's launch: not this engine's
    assert knobs.runtime.jit_cache_hook is None
    plan.save()
    assert load_plan(plan.path) == [(kernel_a, "s1"), (kernel_b, "spec-x")]


def test_recording_asks_the_previous_hook_first_and_puts_it_back():
    def previous(**kwargs):
        return kwargs["key"] == "veto"

    knobs.runtime.jit_cache_hook = previous
    with recording_compiles() as compiled:
        assert _launch(kernel_a, "veto") is True
        assert _launch(kernel_a, "a") is None
    assert compiled == [(kernel_a, "spec-a")]
    assert knobs.runtime.jit_cache_hook is previous


def test_triton_is_hashed_once_on_a_background_thread():
    from triton.runtime.cache import triton_key

    triton_key.cache_clear()
    hash_triton_in_background()
    threads = [t for t in threading.enumerate() if t.name == "spindle-triton-key"]
    assert len(threads) == 1 and threads[0].daemon
    hash_triton_in_background()  # running: no second thread
    assert len([t for t in threading.enumerate() if t.name == "spindle-triton-key"]) <= 1
    threads[0].join(timeout=60)
    assert triton_key.cache_info().currsize == 1
    hash_triton_in_background()  # done: nothing started
    assert not [t for t in threading.enumerate() if t.name == "spindle-triton-key"]


def test_an_engines_plan_depends_on_its_kernel_switches(tiny_model, monkeypatch, tmp_path):
    """A CPU engine's plan path (its fingerprint) changes with a kernel switch set in the
    environment, not with a path or the API key: a start under other switches does not
    load a plan made without them."""
    from spindle import LLM

    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path))
    with LLM(str(tiny_model()), device="cpu", max_model_len=64) as llm:
        runner = llm.engine.core.executor.worker.runner

        def plan_file():
            return type(runner).kernel_plan.func(runner).path

        first = plan_file()
        assert first is not None and first.parent == tmp_path / kernel_plan.PLAN_DIR
        monkeypatch.setenv("SPINDLE_API_KEY", "secret")
        monkeypatch.setenv("SPINDLE_LOG_LEVEL", "DEBUG")
        assert plan_file() == first
        monkeypatch.setenv("SPINDLE_PDL", "0")
        assert plan_file() != first
