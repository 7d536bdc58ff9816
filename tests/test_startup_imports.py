"""What a fresh process imports on its way to a ready LLM: startup time is a feature.

`from spindle import LLM` needs torch, not the server stack nor transformers; the
engine imports transformers only when it reads a checkpoint (its config and tokenizer
are transformers' own) the start cache does not hold (tests/test_cached_tokenizer.py),
and workers get the config as plain data, without it."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
SERVER_STACK = ("fastapi", "uvicorn", "starlette", "pydantic", "openai", "ray",
                "prometheus_client")
ENGINE_MODULES = ("spindle.config", "spindle.hf_config", "spindle.engine.llm_engine",
                  "spindle.engine.tokenizer_loader", "spindle.executor.multiproc",
                  "spindle.executor.config_snapshot", "spindle.worker.worker")


def imported_after(code: str, stdin: bytes | None = None) -> set[str]:
    """The modules a fresh interpreter holds after running code."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, input=stdin,
                         cwd=ROOT, check=True, timeout=300)
    return set(json.loads(out.stdout.decode().strip().splitlines()[-1]))


def top_level(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def test_import_llm_skips_server_stack_and_transformers():
    modules = top_level(imported_after("from spindle import LLM, SamplingParams"))
    assert not modules & {*SERVER_STACK, "httpx", "transformers", "tokenizers"}, modules


def test_import_spindle_is_cheap():
    assert "torch" not in top_level(imported_after("import spindle"))


def test_engine_modules_import_transformers_only_on_use():
    code = "\n".join(f"import {module}" for module in ENGINE_MODULES)
    assert "transformers" not in top_level(imported_after(code))


def test_workers_get_the_config_without_transformers(tiny_model, monkeypatch):
    """With the start cache off the engine's config is transformers' object; what
    workers unpickle is plain data with the same values (executor/config_snapshot.py)."""
    from spindle.config import EngineArgs
    from spindle.executor.config_snapshot import config_for_workers

    monkeypatch.setenv("SPINDLE_START_CACHE", "0")

    config = EngineArgs(model=str(tiny_model(arch="qwen3")), device="cpu").create_engine_config()
    hf = config.model.hf_config
    assert type(hf).__module__.startswith("transformers.")
    code = ("import pickle, sys\n"
            "c = pickle.loads(sys.stdin.buffer.read())\n"
            f"assert c.model.hf_config.head_dim == {hf.head_dim}\n"
            f"assert c.model.hf_config.rope_parameters == {hf.rope_parameters!r}\n"
            f"assert c.model.hf_config.tie_word_embeddings is {hf.tie_word_embeddings}")
    modules = imported_after(code, stdin=pickle.dumps(config_for_workers(config)))
    assert "transformers" not in top_level(modules)


def test_ready_llm_skips_server_stack_and_transformers_models(tiny_model):
    code = ("from spindle import LLM\n"
            f"llm = LLM({str(tiny_model(arch='qwen3'))!r}, device='cpu', "
            "kv_cache_memory_bytes=1 << 22, max_num_seqs=2)\n"
            "assert llm.generate('hello', use_tqdm=False)[0].outputs[0].token_ids\n"
            "llm.shutdown()")
    modules = imported_after(code)
    assert not top_level(modules) & set(SERVER_STACK)
    # spindle runs its own model classes: transformers' modelling code stays unloaded.
    assert "transformers.models.qwen3.modeling_qwen3" not in modules
