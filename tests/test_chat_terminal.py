"""`spindle chat` in a pseudo-terminal, as a person meets it: a prompt, a streamed
reply equal to transformers' greedy answer, the history kept until /reset clears it,
/exit ends."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

from test_cli import CPU, _hf_greedy_reply, user_turns

PROMPT = "> "


def _read_until_prompt(fd: int, timeout: float = 120.0) -> str:
    """Terminal output up to the next input prompt (line endings as \\n)."""
    out = b""
    deadline = time.monotonic() + timeout
    while not out.replace(b"\r\n", b"\n").endswith(PROMPT.encode()):
        if time.monotonic() > deadline:
            raise AssertionError(f"no prompt within {timeout} s; got {out!r}")
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            out += os.read(fd, 4096)
    return out.decode().replace("\r\n", "\n")[:-len(PROMPT)]


def _say(fd: int, line: str) -> str:
    """Type line; the reply printed before the next prompt (the terminal's echo of
    the line taken off)."""
    os.write(fd, (line + "\n").encode())
    text = _read_until_prompt(fd)
    echo = line + "\n"
    assert text.startswith(echo), text
    return text[len(echo):]


def test_chat_in_a_terminal_streams_keeps_history_and_resets(tiny_model):
    from transformers import AutoTokenizer

    model = str(tiny_model(arch="llama"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "spindle", "chat", "--model", model, *CPU,
                             "--max-tokens", "6"], stdin=follower, stdout=follower,
                            stderr=subprocess.PIPE, text=True)
    os.close(follower)
    try:
        assert _read_until_prompt(leader) == ""  # (the banner goes to stderr)
        first = _say(leader, "first question")
        in_context = _say(leader, "second question")
        assert _say(leader, "/reset") == ""
        after_reset = _say(leader, "second question")
        os.write(leader, b"/exit\n")
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)
    expected_first = _hf_greedy_reply(model, tokenizer, user_turns("first question"), 6)
    expected_in_context = _hf_greedy_reply(
        model, tokenizer, user_turns("first question", expected_first, "second question"), 6)
    expected_alone = _hf_greedy_reply(model, tokenizer, user_turns("second question"), 6)
    assert expected_in_context != expected_alone  # (else /reset would show nothing)
    assert first == expected_first + "\n"
    assert in_context == expected_in_context + "\n"
    assert after_reset == expected_alone + "\n"
    assert "chatting with" in err and "history cleared" in err
