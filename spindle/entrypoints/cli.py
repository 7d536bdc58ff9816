"""The `spindle` command: generate, serve, embed, make-tiny-model."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from spindle.entrypoints.cli_args import (add_engine_args, add_sampling_args, add_server_args,
                                          engine_args_from, sampling_params_from,
                                          server_args_from)


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


def cmd_generate(ns: argparse.Namespace) -> int:
    from spindle.engine.llm_engine import LLMEngine
    from spindle.logger import configure_logging

    configure_logging()
    model = ns.model or str(default_model_dir())
    engine = LLMEngine.from_engine_args(engine_args_from(ns, model=model))
    try:
        params = sampling_params_from(ns)
        prompts = ns.prompt or ["Hello"]
        for prompt in prompts:
            _stream_one(engine, prompt, params)
    finally:
        engine.shutdown()
    return 0


def _stream_one(engine, prompt: str, params) -> None:
    request_id = engine.add_request(prompt, params)
    printed = {}
    out = sys.stdout
    out.write(prompt)
    out.flush()
    while engine.has_unfinished_requests():
        for result in engine.step():
            if result.request_id != request_id:
                continue
            for completion in result.outputs:
                seen = printed.get(completion.index, 0)
                if len(result.outputs) > 1 and seen == 0 and completion.text:
                    out.write(f"\n--- sample {completion.index} ---\n")
                out.write(completion.text[seen:])
                printed[completion.index] = len(completion.text)
            out.flush()
    out.write("\n")


def cmd_serve(ns: argparse.Namespace) -> int:
    from spindle.config import API_KEY_ENV
    from spindle.entrypoints.openai.api_server import run_server
    from spindle.logger import configure_logging

    configure_logging()
    if ns.model_path and ns.model and ns.model_path != ns.model:
        raise ValueError(f"two models given: {ns.model_path!r} and --model {ns.model!r}")
    model = ns.model_path or ns.model or str(default_model_dir())
    # Checked before the engine starts: a bad server flag fails at once.
    server_args = server_args_from(ns, api_key=ns.api_key or os.environ.get(API_KEY_ENV) or None)
    return run_server(engine_args_from(ns, model=model), host=ns.host, port=ns.port,
                      served_model_names=ns.served_model_name,
                      shutdown_timeout=ns.shutdown_timeout, server_args=server_args)


def cmd_make_tiny_model(ns: argparse.Namespace) -> int:
    from spindle.tools.tiny_model import run_cli

    run_cli(ns)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spindle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="Generate text for prompts, streaming to the terminal.")
    gen.add_argument("prompt", nargs="*", help="Prompt text (several prompts run one after another).")
    add_engine_args(gen)
    add_sampling_args(gen, temperature=0.0, max_tokens=64)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="Run the OpenAI-compatible HTTP server.")
    serve.add_argument("model_path", nargs="?", metavar="PATH",
                       help="Model directory (or --model; default: the built-in demo model).")
    serve.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    serve.add_argument("--port", type=int, default=8000,
                       help="Port to listen on; 0 picks a free one (the log says which).")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="Model name(s) clients use (default: the model path).")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="Seconds requests in flight get to finish after SIGINT/SIGTERM "
                            "before they are aborted.")
    add_server_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    from spindle.entrypoints.embed_cli import add_embed_parser

    add_embed_parser(sub)

    tiny = sub.add_parser("make-tiny-model",
                          help="Write a small random Hugging Face checkpoint with a real tokenizer.")
    from spindle.tools.tiny_model import add_cli_arguments

    add_cli_arguments(tiny)
    tiny.set_defaults(func=cmd_make_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return ns.func(ns)
    except ValueError as e:
        print(f"spindle: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
