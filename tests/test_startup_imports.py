"""What a fresh process imports on its way to a ready LLM: startup time is a feature.

`from spindle import LLM` needs torch, not the server stack; reading the checkpoint's
config needs no transformers; the tokenizer needs transformers' tokenizer classes, not
its auto registry (whose import costs seconds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
SERVER_STACK = ("fastapi", "uvicorn", "starlette", "pydantic", "openai", "ray",
                "prometheus_client")
AUTO_REGISTRY = ("transformers.models.auto.configuration_auto",
                 "transformers.models.auto.tokenization_auto",
                 "transformers.models.auto.modeling_auto")


def imported_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running code."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=ROOT, check=True, timeout=300)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def top_level(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def test_import_llm_skips_server_stack_and_transformers():
    modules = top_level(imported_after("from spindle import LLM, SamplingParams"))
    assert not modules & {*SERVER_STACK, "httpx", "transformers", "tokenizers"}, modules


def test_import_spindle_is_cheap():
    assert "torch" not in top_level(imported_after("import spindle"))


def test_engine_config_reads_checkpoint_without_transformers(tiny_model):
    code = ("from spindle.config import EngineArgs\n"
            f"c = EngineArgs(model={str(tiny_model(arch='qwen3'))!r}, device='cpu')"
            ".create_engine_config()\n"
            "assert c.model.hf_config.head_dim == 16 and c.model.hf_config.tie_word_embeddings")
    assert "transformers" not in top_level(imported_after(code))


def test_ready_llm_skips_the_auto_registry(tiny_model):
    code = ("from spindle import LLM\n"
            f"llm = LLM({str(tiny_model(arch='qwen3'))!r}, device='cpu', "
            "kv_cache_memory_bytes=1 << 22, max_num_seqs=2)\n"
            "assert llm.generate('hello', use_tqdm=False)[0].outputs[0].token_ids\n"
            "llm.shutdown()")
    modules = imported_after(code)
    assert not modules & set(AUTO_REGISTRY), sorted(modules & set(AUTO_REGISTRY))
    assert not top_level(modules) & set(SERVER_STACK)
