"""The command line as a user meets it: real `python -m spindle` subprocesses on a tiny
model. Engine starts are few (each costs seconds on CPU): flag errors, help and the
install script are checked without one."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

STARTUP_MARKS = ("tokenizer loaded", "freeze_gc_heap", "startup in")
HF_LENGTH_WARNING = "Token indices sequence length is longer"
CPU = ("--device", "cpu", "--dtype", "float32")


def spindle(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spindle", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return str(tiny_model(arch="llama"))


@pytest.fixture(scope="module")
def tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def user_turns(*texts_and_replies: str) -> list[dict]:
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": t} for i, t in enumerate(texts_and_replies)]


# ---- no engine start -------------------------------------------------------------------
def test_python_dash_m_spindle_is_the_spindle_command():
    result = spindle("--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: spindle ")
    for command in ("generate", "chat", "serve", "embed", "make-tiny-model"):
        assert command in result.stdout


@pytest.mark.parametrize("command,flags,flag", [
    ("generate", ["--temperature", "-1"], "--temperature"),
    ("generate", ["--max-tokens", "0"], "--max-tokens"),
    ("generate", ["--top-p", "2"], "--top-p"),
    ("generate", ["--task", "embed"], "--task"),
    ("chat", ["--temperature", "-1"], "--temperature"),
    ("chat", ["--n", "2"], "--n"),
    ("generate", ["--regex", "a", "--choice", "b"], "--regex"),
    ("generate", ["--json-schema", "/no/such/schema.json"], "--json-schema"),
    ("generate", ["--choice", "a", "--ignore-eos"], "--ignore-eos"),
])
def test_bad_flags_are_refused_before_the_engine_starts(model, command, flags, flag):
    result = spindle(command, "--model", model, *CPU, *flags,
                     *(["a prompt"] if command == "generate" else []), stdin="")
    assert result.returncode == 2, result.stderr
    assert f"usage: spindle {command}" in result.stderr
    assert f"spindle {command}: error: argument {flag}: " in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    for mark in STARTUP_MARKS:  # no tokenizer, no model, no startup table
        assert mark not in result.stderr, result.stderr
    assert result.stdout == ""


def _option_entries(help_text: str) -> dict[str, str]:
    """Option invocation ("--top-p TOP_P") -> the help text printed for it."""
    entries: dict[str, list[str]] = {}
    current = None
    for line in help_text.splitlines():
        if re.match(r"^  -", line):
            invocation, _, rest = line.strip().partition("  ")
            current = invocation
            entries[current] = [rest.strip()]
        elif current is not None and line.startswith("   ") and line.strip():
            entries[current].append(line.strip())
        else:
            current = None
    return {k: " ".join(v).strip() for k, v in entries.items()}


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "embed", "make-tiny-model"])
def test_help_describes_every_flag_and_shows_its_default(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    parser = _subparser(command)
    entries = _option_entries(parser.format_help())
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(entries) == len(options) + 1  # (+ -h)
    for action in options:
        invocation, text = _entry_for(entries, action)
        assert len(text) > 10, f"{invocation}: no description"
        if action.default is not None:
            assert f"(default: {action.default})" in text, f"{invocation}: {text!r}"


def _subparser(command: str):
    import argparse

    from spindle.entrypoints.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _entry_for(entries: dict[str, str], action) -> tuple[str, str]:
    for invocation, text in entries.items():
        if {part.split(" ")[0] for part in invocation.split(", ")} & set(action.option_strings):
            return invocation, text
    raise AssertionError(f"{action.option_strings} missing from the help")


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_help_says_the_cli_sampling_defaults_differ_from_the_python_api(command):
    text = " ".join(_subparser(command).format_help().split())
    assert "differ from those of the Python API's SamplingParams() (temperature=1.0, " \
           "max_tokens=16)" in text
    assert "--temperature 0.0" in text


def test_install_script_passes_the_chosen_torch_to_pip(tmp_path):
    """scripts/install.sh with a stand-in Python that records its pip calls."""
    log = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then exit 1; fi\necho "$@" >> {log}\n')
    fake.chmod(0o755)
    script = Path(__file__).resolve().parent.parent / "scripts" / "install.sh"
    base = {"PATH": os.environ["PATH"], "PYTHON": str(fake)}

    subprocess.run(["bash", str(script)], env=base, check=True, timeout=60)
    default_calls = log.read_text().splitlines()
    assert default_calls[0] == "-m pip install --quiet torch==2.13.0"
    assert default_calls[1] == "-m pip install --quiet -e .[dev]"

    log.unlink()
    cpu = "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    subprocess.run(["bash", str(script)], env={**base, "SPINDLE_TORCH": cpu}, check=True,
                   timeout=60)
    assert log.read_text().splitlines()[0] == f"-m pip install --quiet {cpu}"


# ---- generate --------------------------------------------------------------------------
def test_several_samples_print_whole_and_labelled_with_logprobs(model):
    prompt = "def f(x):"
    result = spindle("generate", "--model", model, *CPU, "--n", "2", "--temperature", "1.0",
                     "--seed", "3", "--logprobs", "2", "--max-tokens", "6", "--ignore-eos",
                     prompt)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    labels = [i for i, line in enumerate(lines) if line.startswith("--- sample ")]
    assert [lines[i] for i in labels] == ["--- sample 1 of 2 (finish: length) ---",
                                          "--- sample 2 of 2 (finish: length) ---"]
    assert lines[labels[0] + 1].startswith(prompt) and lines[labels[1] + 1].startswith(prompt)
    tables = [i for i, line in enumerate(lines) if line.startswith("--- logprobs")]
    assert [lines[i] for i in tables] == [
        f"--- logprobs (sample {k}): position, token, logprob, top 2 ---" for k in (1, 2)]
    for start, end in zip(tables, tables[1:] + [len(lines)]):
        rows = lines[start + 1:end]
        assert [int(r.split()[0]) for r in rows] == list(range(6))
        for row in rows:  # position, token, its logprob, then two alternatives with theirs
            assert len(re.findall(r"-?\d+\.\d{4}", row)) == 3, row


@pytest.fixture(scope="module")
def json_run(model):
    prompts = ["hello there", "what is a list?"]
    result = spindle("generate", "--model", model, *CPU, "--chat", "--output", "json",
                     "--n", "2", "--temperature", "1.0", "--logprobs", "2", "--max-tokens", "5",
                     "--ignore-eos", *prompts)
    assert result.returncode == 0, result.stderr
    return prompts, [json.loads(line) for line in result.stdout.splitlines()]


def test_json_output_has_one_object_per_prompt_with_every_sample(json_run, tokenizer):
    prompts, records = json_run
    assert [r["prompt"] for r in records] == prompts
    for record in records:
        assert [s["index"] for s in record["samples"]] == [0, 1]
        for sample in record["samples"]:
            assert sample["finish_reason"] == "length" and len(sample["token_ids"]) == 5
            assert sample["text"] == tokenizer.decode(sample["token_ids"],
                                                      skip_special_tokens=True)
            assert [e["token_id"] for e in sample["logprobs"]] == sample["token_ids"]
            for entry in sample["logprobs"]:
                top = entry["top_logprobs"]
                assert len(top) == 2 and top[0]["logprob"] >= top[1]["logprob"]
                assert entry["logprob"] <= top[0]["logprob"] + 1e-6
            assert sample["cumulative_logprob"] == pytest.approx(
                sum(e["logprob"] for e in sample["logprobs"]), abs=1e-4)


def test_structured_output_flags_shape_the_answers(model, tmp_path):
    """--json-schema (a file) and --choice: every answer is a document of the schema /
    one of the choices, as the Python API's structured outputs give them."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    prompts = ["hello there", "what is a list?"]
    result = spindle("generate", "--model", model, *CPU, "--output", "json", "--max-tokens",
                     "80", "--json-schema", str(path), *prompts)
    assert result.returncode == 0, result.stderr
    for line in result.stdout.splitlines():
        (sample,) = json.loads(line)["samples"]
        assert sample["finish_reason"] == "stop", sample
        document = json.loads(sample["text"])
        assert list(document) == ["ok", "n"] and isinstance(document["ok"], bool)
    result = spindle("generate", "--model", model, *CPU, "--output", "json", "--choice", "yes",
                     "--choice", "no", *prompts)
    assert result.returncode == 0, result.stderr
    assert all(json.loads(line)["samples"][0]["text"] in ("yes", "no")
               for line in result.stdout.splitlines())


def test_prompt_logprobs_score_the_prompt_as_the_engine_does(model):
    from spindle import LLM, SamplingParams

    prompt = "the quick brown fox"
    with LLM(model, device="cpu", dtype="float32") as llm:
        want = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=2),
                            use_tqdm=False)[0]
    ids = want.prompt_token_ids
    result = spindle("generate", "--model", model, *CPU, "--output", "json",
                     "--prompt-logprobs", "2", "--max-tokens", "1", prompt)
    assert result.returncode == 0, result.stderr
    (record,) = [json.loads(line) for line in result.stdout.splitlines()]
    scored = record["prompt_logprobs"]
    assert scored[0] is None and [e["token_id"] for e in scored[1:]] == ids[1:]
    for entry, expected, token in zip(scored[1:], want.prompt_logprobs[1:], ids[1:]):
        assert entry["logprob"] == pytest.approx(expected[token].logprob, abs=1e-5)
        assert entry["rank"] == expected[token].rank and len(entry["top_logprobs"]) == 2
    text = spindle("generate", "--model", model, *CPU, "--prompt-logprobs", "0",
                   "--max-tokens", "1", prompt)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    header = lines.index("--- prompt logprobs: position, token, logprob, rank ---")
    assert len(lines[header + 1:]) == len(ids) - 1
    assert lines[header + 1].split()[0] == "1"
    bad = spindle("generate", "--model", model, *CPU, "--prompt-logprobs", "-1", prompt)
    assert bad.returncode != 0 and "--prompt-logprobs" in bad.stderr


def test_generate_chat_renders_the_prompt_with_the_chat_template(json_run, tokenizer):
    prompts, records = json_run
    for prompt, record in zip(prompts, records):
        text = tokenizer.apply_chat_template(user_turns(prompt), tokenize=False,
                                             add_generation_prompt=True)
        assert record["prompt_token_ids"] == tokenizer.encode(text, add_special_tokens=False)


def test_a_prompt_over_max_model_len_gets_only_spindles_error(model, tokenizer):
    prompt = "word " * 2100  # past the tokenizer's model_max_length (2048) too
    assert len(tokenizer.encode(prompt)) > tokenizer.model_max_length
    result = spindle("generate", "--model", model, *CPU, prompt)
    assert result.returncode == 2
    assert "spindle: error: prompt is" in result.stderr and "max_model_len" in result.stderr
    assert HF_LENGTH_WARNING not in result.stderr
    assert result.stdout == ""  # the prompt is not echoed for a request never run


# ---- chat ------------------------------------------------------------------------------
def _hf_greedy_reply(model: str, tokenizer, conversation: list[dict], max_tokens: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                      do_sample=False, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_chat_streams_replies_in_context_from_piped_stdin(model, tokenizer):
    long_message = "word " * 2100
    stdin = f"first question\n\n{long_message}\nsecond question\n/exit\nnever read\n"
    result = spindle("chat", "--model", model, *CPU, "--max-tokens", "6", stdin=stdin)
    assert result.returncode == 0, result.stderr
    # The message over the context is refused alone, with spindle's error only.
    assert "spindle: error: prompt is" in result.stderr
    assert HF_LENGTH_WARNING not in result.stderr and "Traceback" not in result.stderr
    # Greedy replies equal transformers', the second one given the whole history.
    first = _hf_greedy_reply(model, tokenizer, user_turns("first question"), 6)
    in_context = _hf_greedy_reply(model, tokenizer,
                                  user_turns("first question", first, "second question"), 6)
    alone = _hf_greedy_reply(model, tokenizer, user_turns("second question"), 6)
    assert in_context != alone  # (else this test could not tell history from none)
    # One line per answered message: the empty line is skipped, /exit ends the chat.
    assert result.stdout == f"{first}\n{in_context}\n"


# ---- Ctrl-C ----------------------------------------------------------------------------
def _interrupt(args: list[str], ready) -> subprocess.CompletedProcess:
    """Start `python -m spindle args`, send SIGINT once ready(proc) returns, and wait.

    The child starts with SIGINT at its default, as from a terminal: a test run that
    was itself started in the background by a shell inherits SIGINT ignored, and an
    ignored SIGINT would reach no handler of the CLI's."""
    proc = subprocess.Popen([sys.executable, "-m", "spindle", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen = ready(proc)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(args, proc.returncode, seen + out, err)


def test_ctrl_c_while_generating_exits_130_quietly(model):
    prompt = "def f(x):"

    def first_tokens_shown(proc) -> bytes:
        shown = b""
        while len(shown) <= len(prompt):  # the prompt, then generated text, streamed
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, "generate ended before any text streamed"
            shown += chunk
        return shown

    result = _interrupt(["generate", "--model", model, *CPU, "--max-tokens", "2000",
                         "--ignore-eos", prompt], first_tokens_shown)
    assert result.returncode == 130, result.stderr
    assert b"Traceback" not in result.stderr and b"KeyboardInterrupt" not in result.stderr
    assert result.stdout.startswith(prompt.encode()) and result.stdout.endswith(b"\n")


def test_ctrl_c_during_startup_exits_130_quietly(model):
    def engine_starting(proc) -> bytes:
        # The first log line (the tokenizer is loaded) comes before the worker stages,
        # which take a few hundred milliseconds even for the tiny model: interrupt at
        # once, while they run. (Landing after the start instead fails the test: the
        # prompt would be on stdout.)
        line = proc.stderr.readline()
        assert line, "the command ended before the engine started"
        return b""

    result = _interrupt(["generate", "--model", model, *CPU, "a prompt"], engine_starting)
    assert result.returncode == 130, result.stderr
    assert b"Traceback" not in result.stderr and b"KeyboardInterrupt" not in result.stderr
    assert result.stdout == b"\n"
