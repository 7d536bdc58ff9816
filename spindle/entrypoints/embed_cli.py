"""`spindle embed`: one embedding per text, printed as JSON lines.

Texts come from the command line, or, when none is given, one per line of
standard input (an empty line is an empty text). Each output line is
{"index", "text", "num_tokens", "embedding"}, in input order.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from spindle.entrypoints.cli_args import HelpFormatter, add_engine_args, engine_args_from


def add_embed_parser(subparsers: argparse._SubParsersAction) -> None:
    embed = subparsers.add_parser(
        "embed", help="Embed texts with an embedding model (task=embed); prints JSON lines.",
        description=__doc__, usage="%(prog)s [options] [text ...]", formatter_class=HelpFormatter)
    embed.add_argument("text", nargs="*", help="Texts to embed (default: the lines of stdin).")
    add_engine_args(embed, skip=("task",))
    embed.set_defaults(func=cmd_embed)


def cmd_embed(ns: argparse.Namespace) -> int:
    from spindle.entrypoints.cli import default_model_dir
    from spindle.entrypoints.llm import LLM

    texts = ns.text or [line.rstrip("\r\n") for line in sys.stdin]
    if not texts:
        raise ValueError("no text to embed: pass texts as arguments or on stdin")
    args = engine_args_from(ns, model=ns.model or str(default_model_dir()), task="embed")
    llm = LLM(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})
    try:
        outputs = llm.embed(texts, use_tqdm=False)
    finally:
        llm.shutdown()
    for i, (text, out) in enumerate(zip(texts, outputs)):
        record = {"index": i, "text": text, "num_tokens": len(out.prompt_token_ids),
                  "embedding": out.outputs.embedding}
        sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
    sys.stdout.flush()
    return 0
