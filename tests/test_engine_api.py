"""The public API around the engine: errors for bad input, the startup table,
n > 1, stop strings, seeds, chat and the CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from spindle import LLM, SamplingParams
from spindle.worker.worker import LIFECYCLE


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = LLM(str(tiny_model(arch="llama")), device="cpu", dtype="float32", max_model_len=256)
    yield engine
    engine.shutdown()


# ---- bad input ---------------------------------------------------------------------
def test_nonexistent_model_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"), device="cpu")


def test_directory_without_config_is_not_a_checkpoint(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path), device="cpu")


def test_unsupported_architecture_names_the_supported_ones(tiny_model, tmp_path):
    src = tiny_model(arch="llama")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["SpeculativeNonsenseForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="SpeculativeNonsenseForCausalLM") as info:
        LLM(str(tmp_path), device="cpu")
    assert "LlamaForCausalLM" in str(info.value) and "Qwen3ForCausalLM" in str(info.value)


def test_unknown_engine_argument_is_named(tiny_model):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(str(tiny_model(arch="llama")), max_num_seq=4)


@pytest.mark.parametrize("field,value", [("block_size", 3), ("max_num_seqs", 0),
                                         ("gpu_memory_utilization", 1.5), ("dtype", "int8"),
                                         ("tensor_parallel_size", 0), ("device", "tpu"),
                                         ("cpu_threads", 0), ("cpu_threads", 1.5)])
def test_bad_engine_values_name_the_field(tiny_model, field, value):
    with pytest.raises(ValueError, match=field if field != "device" else "device"):
        LLM(str(tiny_model(arch="llama")), **{field: value})


def test_cpu_threads_sets_the_in_process_workers_threads(tiny_model):
    import torch

    before = torch.get_num_threads()
    try:
        with LLM(str(tiny_model(arch="llama")), device="cpu", cpu_threads=1) as llm:
            assert torch.get_num_threads() == 1
            out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=3),
                               use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 3
    finally:
        torch.set_num_threads(before)


def test_prompt_longer_than_max_model_len_fails_alone(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 300], SamplingParams(max_tokens=2), use_tqdm=False)
    # The engine keeps serving.
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n"), ({"top_k": -3}, "top_k"),
    ({"min_p": 2.0}, "min_p"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens")])
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_empty_prompt_list_and_empty_prompt(llm):
    with pytest.raises(ValueError, match="non-empty"):
        llm.generate([], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[10**9]], use_tqdm=False)


def test_one_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate(["fine", [1] * 1000], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.core.has_unfinished_requests()


# ---- startup -----------------------------------------------------------------------
def test_startup_table_lists_all_six_stages(llm):
    table = llm.engine.core.startup_table
    for stage in LIFECYCLE:
        assert stage in table
    reports = llm.engine.core.executor.lifecycle_reports()
    assert [r["stage"] for r in reports[0]] == list(LIFECYCLE)
    assert all(r["seconds"] >= 0 for r in reports[0])


def test_lifecycle_order_is_enforced(tiny_model):
    from spindle.config import EngineArgs
    from spindle.worker.worker import Worker

    config = EngineArgs(model=str(tiny_model(arch="llama")), device="cpu").create_engine_config()
    worker = Worker(config)
    with pytest.raises(RuntimeError, match="out of order"):
        worker.load_model()


# ---- sampling through the engine -----------------------------------------------------
def test_n_samples_with_seed_are_distinct_and_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    first = llm.generate("the cat", params, use_tqdm=False)[0]
    second = llm.generate("the cat", params, use_tqdm=False)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1


def test_seeded_request_is_independent_of_its_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=123, max_tokens=10, ignore_eos=True)
    alone = llm.generate("a prompt", seeded, use_tqdm=False)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    batch = llm.generate(["other", "words here", "a prompt", "more"],
                         [noise, noise, seeded, noise], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone


def test_stop_string_truncates_and_finishes(llm):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate("def f", greedy, use_tqdm=False)[0].outputs[0]
    if len(full.text) < 6:
        pytest.skip("greedy output too short to pick a stop string")
    stop = full.text[3:6]
    out = llm.generate("def f", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                               stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.find(stop)]
    kept = llm.generate("def f", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:full.text.find(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate("xyz", greedy, use_tqdm=False)[0].outputs[0].token_ids
    stopper = full[4]
    first_at = full.index(stopper)
    out = llm.generate("xyz", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                             stop_token_ids=[stopper]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[:first_at + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stopper
    held = llm.generate("xyz", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                              stop_token_ids=[stopper], min_tokens=first_at + 2),
                        use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= first_at + 2
    assert stopper not in held.token_ids[:first_at + 1]


def test_text_equals_decoding_the_tokens(llm):
    out = llm.generate(["hello world", "import os"], SamplingParams(temperature=0.8, seed=3,
                                                                    max_tokens=25),
                       use_tqdm=False)
    tok = llm.get_tokenizer()
    for o in out:
        c = o.outputs[0]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


def test_logprobs_top_k(llm):
    out = llm.generate("the", SamplingParams(temperature=0, max_tokens=4, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1
        assert 3 <= len(entry) <= 4
        values = sorted((lp.logprob for lp in entry.values()), reverse=True)
        assert entry[token].logprob == pytest.approx(values[0])
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_chat_uses_the_template(llm):
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rendered = llm.render_chat(conversation)
    assert "<|im_start|>assistant" in rendered["prompt"]
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    direct = llm.generate({"prompt_token_ids": rendered["prompt_token_ids"]},
                          SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert out[0].outputs[0].token_ids == direct[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "no role"}], use_tqdm=False)


@pytest.mark.parametrize("message,problem", [
    ({"role": "wizard", "content": "x"}, "has role 'wizard'"),
    ({"role": "user"}, "has no 'content'"),
    ({"role": "user", "content": None}, "has no 'content'"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "content"),
])
def test_chat_refuses_the_messages_the_server_refuses(llm, message, problem):
    # One check (chat_utils.chat_messages) for LLM.chat and /v1/chat/completions.
    with pytest.raises(ValueError, match=re.escape(f"messages[1] {problem}")):
        llm.chat([{"role": "system", "content": "be brief"}, message], use_tqdm=False)


def test_chat_messages_read_as_the_template_expects():
    from spindle.entrypoints.chat_utils import chat_messages

    assert chat_messages([{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                            {"type": "text", "text": "b"}]},
                          {"role": "user", "content": "hi", "name": "x"}]) == [
        {"role": "system", "content": "ab"}, {"role": "user", "content": "hi", "name": "x"}]


# ---- CLI ---------------------------------------------------------------------------
def _cli(*args: str, env_extra: dict | None = None, timeout: int = 240):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "spindle.entrypoints.cli", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_cli_make_tiny_model_then_generate(tmp_path):
    out_dir = tmp_path / "tiny-qwen3"
    made = _cli("make-tiny-model", str(out_dir), "--arch", "qwen3")
    assert made.returncode == 0, made.stderr
    assert (out_dir / "config.json").is_file() and (out_dir / "tokenizer.json").is_file()
    gen = _cli("generate", "--model", str(out_dir), "--device", "cpu", "--max-tokens", "8",
               "hello there")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("hello there") and len(gen.stdout.strip()) > len("hello there")
    assert "freeze_gc_heap" in gen.stderr  # the startup table


def test_cli_generate_without_model_uses_the_builtin_demo_model():
    # No --model, no network, no cache: the demo model ships inside the package.
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    gen = _cli("generate", "--device", "cpu", "--max-tokens", "24", "def fibonacci(n):",
               env_extra=env)
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("def fibonacci(n):"), gen.stdout
    assert "\n    " in gen.stdout, gen.stdout  # a completion with indented lines


def test_cli_reports_bad_input_cleanly(tmp_path):
    gen = _cli("generate", "--model", str(tmp_path / "missing"), "--device", "cpu", "x")
    assert gen.returncode == 2
    assert "does not exist" in gen.stderr and "Traceback" not in gen.stderr


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_decoded_at_the_end_equals_the_streamed_text(llm, skip_special_tokens):
    """An offline sample without stop strings is decoded once, at its end: the text must
    be the one the per-token stream gives (random ids: split multi-byte characters,
    special tokens), for any prompt before it, even one ending inside a character."""
    import random

    from spindle.engine.detokenizer import IncrementalDetokenizer

    tok = llm.get_tokenizer()
    rng = random.Random(0)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(40):
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 9))]
        tokens = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 30))]
        streamed = IncrementalDetokenizer(tok, prompt, params)
        at_end = IncrementalDetokenizer(tok, prompt, params, text_at_end=True)
        for t in tokens:
            streamed.add_token(t)
            at_end.add_token(t)
        streamed.finish()
        at_end.finish()
        assert at_end.output_text == streamed.output_text
        # (A byte-level tokenizer: the output's text is its own bytes' text, whatever
        # the prompt ends with.)
        assert streamed.output_text == tok.decode(tokens, skip_special_tokens=skip_special_tokens)


def test_allowed_token_ids_restrict_what_is_generated(tiny_model):
    llm = LLM(model=tiny_model("llama"))
    allowed = [7, 11, 300]
    for temperature in (0.0, 1.0):
        out = llm.generate([[1, 2, 3]], SamplingParams(
            temperature=temperature, max_tokens=12, ignore_eos=True, seed=0,
            allowed_token_ids=allowed), use_tqdm=False)
        assert set(out[0].outputs[0].token_ids) <= set(allowed)
    with pytest.raises(ValueError, match=r"allowed_token_ids must be token ids of the "
                                         r"vocabulary \[0, 512\)"):
        llm.generate([[1, 2]], SamplingParams(allowed_token_ids=[512]), use_tqdm=False)
