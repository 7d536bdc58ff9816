"""`spindle generate`: prompts from the command line, completions to the terminal.

With one sample per prompt the text streams as it is generated; with --n > 1 each
sample is printed whole under a label; --logprobs adds a table per sample,
--prompt-logprobs one scoring the prompt;
--output json prints one JSON object per prompt instead. --chat renders each prompt
as a user message with the checkpoint's chat template (instruct models). Also holds
what `spindle chat` shares: starting the engine, streaming one request, rendering.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable

from spindle.entrypoints.cli_args import (CLI_SAMPLING_DEFAULTS, SAMPLING_DEFAULTS_NOTE,
                                          FlagError, HelpFormatter, add_engine_args,
                                          add_sampling_args, refuse_embed_task,
                                          sampling_params_from)

from spindle.outputs import finite_logprob

OUTPUT_FORMATS = ("text", "json")


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    gen = subparsers.add_parser(
        "generate", help="Generate text for prompts, streaming to the terminal.",
        description=__doc__.split("\n\n")[0] + "\n\n" + SAMPLING_DEFAULTS_NOTE.format(
            **CLI_SAMPLING_DEFAULTS), usage="%(prog)s [options] [prompt ...]",
        formatter_class=HelpFormatter)
    gen.add_argument("prompt", nargs="*",
                     help='Prompt text; several prompts run one after another (default: "Hello").')
    gen.add_argument("--output", choices=OUTPUT_FORMATS, default="text",
                     help="text: completions as they are generated; json: one JSON object per "
                          "prompt (samples, token ids, logprobs, finish reasons).")
    add_chat_args(gen, optional=True)
    add_engine_args(gen)
    add_sampling_args(gen, **CLI_SAMPLING_DEFAULTS)
    gen.set_defaults(func=cmd_generate, check=check_generate_flags)


def add_chat_args(parser: argparse.ArgumentParser, optional: bool) -> None:
    group = parser.add_argument_group("chat")
    if optional:
        group.add_argument("--chat", action="store_true",
                           help="Send each prompt as a user message, rendered with the "
                                "checkpoint's chat template (for instruct models); print "
                                "only the reply.")
    group.add_argument("--system", default=None,
                       help="A system message to start the conversation with (default: none).")
    group.add_argument("--chat-template", default=None, metavar="TEMPLATE_OR_FILE",
                       help="A Jinja chat template, or a file holding one (default: the "
                            "checkpoint's).")


def check_generate_flags(ns: argparse.Namespace) -> None:
    sampling_params_from(ns)
    refuse_embed_task(ns, "generate")
    if not ns.chat and (ns.system is not None or ns.chat_template is not None):
        flag = "--system" if ns.system is not None else "--chat-template"
        raise FlagError(flag, "needs --chat")


def cmd_generate(ns: argparse.Namespace) -> int:
    params = sampling_params_from(ns)
    prompts = ns.prompt or ["Hello"]
    llm = start_llm(ns)
    try:
        inputs = [render_chat(llm, ns, [user_message(p)]) if ns.chat else p for p in prompts]
        if ns.output == "json":
            for prompt, out in zip(prompts, llm.generate(inputs, params, use_tqdm=False)):
                write_line(json.dumps(json_record(prompt, out, params.logprobs,
                                                  params.prompt_logprobs),
                                      ensure_ascii=False, allow_nan=False))
        else:
            for prompt, engine_input in zip(prompts, inputs):
                print_completion(llm, prompt if not ns.chat else "", engine_input, params)
    finally:
        llm.shutdown()
    return 0


# ---- shared with `spindle chat` --------------------------------------------------------
def start_llm(ns: argparse.Namespace) -> Any:
    """An LLM for the command's engine flags (the built-in demo model without --model);
    ValueError if the model does not generate text."""
    from spindle.entrypoints.cli import default_model_dir
    from spindle.entrypoints.cli_args import engine_args_from
    from spindle.entrypoints.llm import LLM

    args = engine_args_from(ns, model=ns.model or str(default_model_dir()))
    llm = LLM(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})
    if llm.config.model.task != "generate":
        llm.shutdown()
        raise ValueError(f"the model at {args.model} embeds texts (task "
                         f"{llm.config.model.task!r}): run `spindle embed` instead")
    return llm


def user_message(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def chat_template_from(ns: argparse.Namespace) -> str | None:
    """--chat-template: the text of the file it names, or the template itself."""
    value = ns.chat_template
    if value is None:
        return None
    path = Path(value)
    if "{" not in value and path.is_file():
        return path.read_text(encoding="utf-8")
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def check_chat_template(llm: Any, ns: argparse.Namespace) -> None:
    """Fail before any input is read when there is no template to render with."""
    if ns.chat_template is None and not getattr(llm.engine.tokenizer, "chat_template", None):
        raise ValueError(f"the model at {llm.config.model.model} has no chat template: "
                         "pass one with --chat-template FILE")


def render_chat(llm: Any, ns: argparse.Namespace, conversation: list[dict]) -> dict:
    """The engine input for a conversation: {"prompt", "prompt_token_ids"}."""
    check_chat_template(llm, ns)
    system = [{"role": "system", "content": ns.system}] if ns.system is not None else []
    return llm.render_chat(system + conversation, chat_template=chat_template_from(ns))


def stream_request(llm: Any, engine_input: Any, params: Any, write: Callable[[str], None],
                   prefix: str = "") -> Any:
    """Run one single-sample request, passing prefix (once the engine has accepted the
    request) and then its text to write, piece by piece as it is generated; returns the
    final RequestOutput.

    While the sample runs, the text that could still turn out to be the start of a
    stop string stays back: a completed stop string is cut off the text.
    """
    engine = llm.engine
    holdback = params.stop_holdback
    request_id = engine.add_request(engine_input, params)
    write(prefix)
    shown, final = 0, None
    while final is None and engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            text = out.outputs[0].text
            end = len(text) if out.finished else max(shown, len(text) - holdback)
            if end > shown:
                write(text[shown:end])
                shown = end
            if out.finished:
                final = out
    if final is None:
        raise RuntimeError(f"request {request_id} ended without a final output")
    return final


def write_text(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def write_line(text: str) -> None:
    write_text(text + "\n")


# ---- text output ---------------------------------------------------------------------
def print_completion(llm: Any, shown_prompt: str, engine_input: Any, params: Any) -> None:
    """One prompt's samples as text: streamed when there is one, else each whole under a
    label; then the logprobs tables if asked for."""
    if params.n == 1:
        out = stream_request(llm, engine_input, params, write_text, prefix=shown_prompt)
        write_text("\n")
    else:
        (out,) = llm.generate([engine_input], params, use_tqdm=False)
        for c in out.outputs:
            write_line(f"--- sample {c.index + 1} of {params.n} (finish: {c.finish_reason}) ---")
            write_line(shown_prompt + c.text)
    if params.prompt_logprobs is not None:
        write_line("--- prompt logprobs: position, token, logprob, rank"
                   + (f", top {params.prompt_logprobs}" if params.prompt_logprobs else "")
                   + " ---")
        for line in prompt_logprob_lines(out, params.prompt_logprobs):
            write_line(line)
    if params.logprobs is not None:
        for c in out.outputs:
            label = f" (sample {c.index + 1})" if params.n > 1 else ""
            write_line(f"--- logprobs{label}: position, token, logprob"
                       + (f", top {params.logprobs}" if params.logprobs else "") + " ---")
            for line in logprob_lines(c, params.logprobs):
                write_line(line)


def logprob_lines(completion: Any, top: int) -> list[str]:
    return [_position_line(pos, token_id, entry, top) for pos, (token_id, entry)
            in enumerate(zip(completion.token_ids, completion.logprobs or []))]


def prompt_logprob_lines(out: Any, top: int) -> list[str]:
    """A line per prompt token after the first (nothing before the first predicts it):
    position, token, logprob, rank, the top ones."""
    return [_position_line(pos, token_id, entry, top, with_rank=True) for pos, (token_id, entry)
            in enumerate(zip(out.prompt_token_ids, out.prompt_logprobs)) if entry is not None]


def _position_line(pos: int, token_id: int, entry: dict, top: int,
                   with_rank: bool = False) -> str:
    chosen = entry[token_id]
    line = f"{pos:>5}  {_token_label(token_id, chosen):<20} {chosen.logprob:9.4f}"
    if with_rank:
        line += f" {chosen.rank:>6}"
    alternatives = _top(entry, top)
    if alternatives:
        line += "   " + "  ".join(f"{_token_label(t, lp)} {lp.logprob:.4f}"
                                  for t, lp in alternatives)
    return line


def _top(entry: dict, k: int) -> list[tuple[int, Any]]:
    return sorted(entry.items(), key=lambda item: item[1].rank)[:k]


def _token_label(token_id: int, logprob: Any) -> str:
    """The token as a quoted string (whitespace visible), or its id when it has no text."""
    return repr(logprob.decoded_token) if logprob.decoded_token is not None else f"#{token_id}"


# ---- JSON output ---------------------------------------------------------------------
def json_record(prompt: str, out: Any, top: int | None,
                prompt_top: int | None = None) -> dict[str, Any]:
    record = {"prompt": prompt, "prompt_token_ids": out.prompt_token_ids,
              "samples": [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                           "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                           "cumulative_logprob": finite_logprob(c.cumulative_logprob),
                           "logprobs": _logprobs_json(c, top)}
                          for c in out.outputs]}
    if prompt_top is not None:
        record["prompt_logprobs"] = [
            None if entry is None else _position_json(token_id, entry, prompt_top)
            for token_id, entry in zip(out.prompt_token_ids, out.prompt_logprobs)]
    return record


def _position_json(token_id: int, entry: dict, top: int) -> dict[str, Any]:
    """One position's logprobs: its token's, then the top ones."""
    return {"token_id": token_id, "token": entry[token_id].decoded_token,
            "logprob": finite_logprob(entry[token_id].logprob), "rank": entry[token_id].rank,
            "top_logprobs": [{"token_id": t, "token": lp.decoded_token,
                              "logprob": finite_logprob(lp.logprob)} for t, lp in _top(entry, top)]}


def _logprobs_json(completion: Any, top: int | None) -> list[dict] | None:
    if top is None or completion.logprobs is None:
        return None
    return [_position_json(token_id, entry, top)
            for token_id, entry in zip(completion.token_ids, completion.logprobs)]
