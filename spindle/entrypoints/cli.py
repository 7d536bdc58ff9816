"""The `spindle` command (also `python -m spindle`): generate, chat, serve, embed,
transcribe, make-tiny-model."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Exit status of a command stopped by Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130
EXIT_USAGE = 2

# Module-level imports stay light (torch comes in with build_parser), so that a
# Ctrl-C during start-up lands inside main's handler, not in an import.


def default_model_dir() -> Path:
    """The built-in default model: spindle's demo model, shipped inside the package.

    A 4M-parameter Llama trained on the Python standard library's source by
    spindle/tools/train_demo_model.py (docs/demo_model.md): it completes Python code,
    offline, on any machine.
    """
    path = Path(__file__).resolve().parent.parent / "demo_model"
    if not (path / "config.json").is_file():
        raise ValueError(
            f"the built-in demo model is missing from {path} (a broken install?); "
            "reinstall spindle or pass --model PATH")
    return path


def cmd_serve(ns: argparse.Namespace) -> int:
    from spindle.config import API_KEY_ENV
    from spindle.entrypoints.cli_args import engine_args_from, server_args_from
    from spindle.entrypoints.openai.api_server import run_server
    from spindle.logger import configure_logging

    configure_logging()
    paths = list(ns.model_path or [])
    if paths and ns.model and paths != [ns.model]:
        raise ValueError(f"models given twice: {', '.join(map(repr, paths))} and --model "
                         f"{ns.model!r}; give the paths only")
    # Checked before the engine starts: a bad server flag fails at once.
    server_args = server_args_from(ns, api_key=ns.api_key or os.environ.get(API_KEY_ENV) or None)
    if len(paths) > 1:
        if server_args.lora_modules:
            raise ValueError("--lora-modules serves adapters of one model; several PATHs "
                             "were given")
        return _serve_pool(ns, paths, server_args)
    model = paths[0] if paths else ns.model or str(default_model_dir())
    return run_server(engine_args_from(ns, model=model), host=ns.host, port=ns.port,
                      served_model_names=ns.served_model_name,
                      shutdown_timeout=ns.shutdown_timeout, server_args=server_args)


def _serve_pool(ns: argparse.Namespace, paths: list[str], server_args) -> int:
    """`spindle serve PATH_A PATH_B ...`: one server, one engine per model."""
    from spindle.engine.model_pool import ModelPool
    from spindle.entrypoints.cli_args import engine_args_from, pool_args_from
    from spindle.entrypoints.openai.api_server import run_pool_server

    pool = ModelPool.from_args(paths, ns.served_model_name, engine_args_from(ns, model=paths[0]),
                               pool_args_from(ns))
    return run_pool_server(pool, host=ns.host, port=ns.port,
                           shutdown_timeout=ns.shutdown_timeout, server_args=server_args)


def cmd_make_tiny_model(ns: argparse.Namespace) -> int:
    from spindle.tools.tiny_model import run_cli

    run_cli(ns)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from spindle.entrypoints.chat_cli import add_chat_parser
    from spindle.entrypoints.cli_args import (HelpFormatter, add_engine_args, add_pool_args,
                                              add_server_args)
    from spindle.entrypoints.embed_cli import add_embed_parser
    from spindle.entrypoints.generate_cli import add_generate_parser
    from spindle.entrypoints.transcribe_cli import add_transcribe_parser
    from spindle.tools.tiny_model import add_cli_arguments

    parser = argparse.ArgumentParser(
        prog="spindle", description=__doc__, formatter_class=HelpFormatter,
        epilog="`spindle COMMAND --help` lists a command's flags with their defaults. "
               "generate and chat\nsample greedily by default, unlike the Python API: see "
               "their --help.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_chat_parser(sub)

    serve = sub.add_parser(
        "serve", help="Run the OpenAI-compatible HTTP server.",
        usage="%(prog)s [options] [PATH ...]", formatter_class=HelpFormatter,
        epilog="Several PATHs serve several models from one device: one engine each, routed\n"
               "by the request's model field; those not needed sleep (--max-awake-models) and\n"
               "wake on demand. Engine flags apply to every model (per model:\n"
               "--model-overrides).")
    serve.add_argument("model_path", nargs="*", metavar="PATH",
                       help="Model directory, or several (or --model; default: the built-in "
                            "demo model).")
    serve.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    serve.add_argument("--port", type=int, default=8000,
                       help="Port to listen on; 0 picks a free one (the log says which).")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="Model name(s) clients use (default: the model path). With one "
                            "PATH: names it answers to; with several: one name per PATH.")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="Seconds requests in flight get to finish after SIGINT/SIGTERM "
                            "before they are aborted.")
    add_server_args(serve)
    add_pool_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    add_embed_parser(sub)
    add_transcribe_parser(sub)

    tiny_help = "Write a small random Hugging Face checkpoint with a real tokenizer."
    tiny = sub.add_parser("make-tiny-model", help=tiny_help, description=tiny_help,
                          formatter_class=HelpFormatter)
    add_cli_arguments(tiny)
    tiny.set_defaults(func=cmd_make_tiny_model)
    for subparser in sub.choices.values():  # so that a check can report like argparse
        subparser.set_defaults(parser=subparser)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        ns = build_parser().parse_args(argv)
        _check_flags(ns)
        return ns.func(ns)
    except KeyboardInterrupt:
        return _interrupted()
    except ValueError as e:
        print(f"spindle: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def _check_flags(ns: argparse.Namespace) -> None:
    """The command's checks of its flag values, before anything starts; a bad value
    exits like an argparse error (usage, the flag named, status 2)."""
    from spindle.entrypoints.cli_args import FlagError

    check = getattr(ns, "check", None)
    if check is None:
        return
    try:
        check(ns)
    except FlagError as e:
        ns.parser.error(str(e))


def _interrupted() -> int:
    """Ctrl-C: no traceback, the cursor on a fresh line, status 130."""
    try:
        sys.stdout.write("\n")
        sys.stdout.flush()
    except (OSError, ValueError):  # stdout closed or a broken pipe: nothing to tidy
        pass
    return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
