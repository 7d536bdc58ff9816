"""Command-line flags generated from EngineArgs and SamplingParams fields, so the
CLI and the Python API cannot drift apart; and the checks that refuse bad flag
values before any engine starts."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from pathlib import Path

from spindle.config import EngineArgs, PoolArgs, ServerArgs
from spindle.sampling_params import SamplingParams, StructuredOutputsParams

# No per-request --seed: the engine's --seed already makes a CLI run reproducible.
_SAMPLING_HELP = {
    "n": "Samples per prompt; each is printed whole, under a label.",
    "temperature": "Sampling temperature; 0 is greedy.",
    "top_p": "Nucleus sampling: keep the most likely tokens whose probabilities sum to "
             "this (1: off).",
    "top_k": "Keep only the k most likely tokens (0 or -1: off).",
    "min_p": "Drop tokens less likely than this fraction of the most likely one (0: off).",
    "repetition_penalty": "Discourage tokens already in the prompt or output (1: off; "
                          "> 1 discourages).",
    "frequency_penalty": "Subtract this times a token's count in the output from its "
                         "logit, in [-2, 2].",
    "presence_penalty": "Subtract this from the logit of every token already in the "
                        "output, in [-2, 2].",
    "max_tokens": "Most tokens to generate per sample.",
    "min_tokens": "Tokens to generate before EOS or a stop token may end a sample.",
    "stop": "A string that ends a sample (not printed); repeat the flag for several.",
    "stop_token_ids": "Token ids that end a sample, comma-separated (e.g. 2,7).",
    "ignore_eos": "Keep generating past the end-of-sequence token.",
    "logprobs": "Show each generated token's log-probability and those of the N most "
                "likely tokens at its place.",
    "prompt_logprobs": "Score the prompt: show each prompt token's log-probability given "
                       "the ones before it (and its rank), and the N most likely tokens "
                       "at its place.",
}
SAMPLING_FLAGS = tuple(_SAMPLING_HELP)
# Where the command line says more than EngineArgs' own help.
_ENGINE_HELP_ON_CLI = {
    "model": "Path to a Hugging Face checkpoint directory (default: spindle's built-in demo "
             "model, spindle/demo_model).",
}

# Sampling defaults of the CLI: greedy and long enough to see something. The Python
# API keeps vLLM's SamplingParams defaults (temperature 1.0, max_tokens 16).
CLI_SAMPLING_DEFAULTS = {"temperature": 0.0, "max_tokens": 64}
SAMPLING_DEFAULTS_NOTE = (
    "The sampling defaults here (--temperature {temperature}, --max-tokens {max_tokens})\n"
    "differ from those of the Python API's SamplingParams() (temperature=1.0,\n"
    "max_tokens=16).")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default, except where there is none (None: the help text
    says what happens without the flag); keeps the line breaks of epilogs."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


class FlagError(ValueError):
    """A bad command-line value, reported argparse-style (usage, exit status 2)
    before any engine starts."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"argument {flag}: {message}")
        self.flag = flag


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def _flag_kwargs(tp: typing.Any, default: typing.Any) -> dict:
    """argparse keyword arguments for a dataclass field of type tp."""
    args = typing.get_args(tp)
    base = next((a for a in args if a is not type(None)), tp) if args else tp
    if base is bool:
        return {"action": argparse.BooleanOptionalAction, "default": default}
    if base is dict:  # given as JSON text; the config parses and checks it
        return {"type": str, "default": default, "metavar": "JSON"}
    if typing.get_origin(base) is list:
        item = typing.get_args(base)[0]
        return {"type": _int_list} if item is int else {"action": "append"}
    return {"type": base, "default": default}


def _add_field_flags(group: argparse._ArgumentGroup, cls: type,
                     skip: tuple[str, ...] = ()) -> None:
    """One flag per field of the dataclass cls, with the field's help."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kwargs = _flag_kwargs(hints[f.name], f.default)
        group.add_argument(flag_name(f.name), dest=f.name,
                           help=_ENGINE_HELP_ON_CLI.get(f.name, f.metadata.get("help", "")),
                           **kwargs)


def _fields_from(cls: type, ns: argparse.Namespace, overrides: dict[str, typing.Any]) -> typing.Any:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    values.update(overrides)
    return cls(**values)


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    _add_field_flags(parser.add_argument_group("engine"), EngineArgs, skip)


def engine_args_from(ns: argparse.Namespace, **overrides: typing.Any) -> EngineArgs:
    return _fields_from(EngineArgs, ns, overrides)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    _add_field_flags(parser.add_argument_group("server"), ServerArgs)


def server_args_from(ns: argparse.Namespace, **overrides: typing.Any) -> ServerArgs:
    """ServerArgs from the flags; raises ValueError naming a bad one."""
    return _fields_from(ServerArgs, ns, overrides)


def add_pool_args(parser: argparse.ArgumentParser) -> None:
    _add_field_flags(parser.add_argument_group(
        "several models (spindle serve PATH_A PATH_B ...; one GPU, taking turns by sleep "
        "mode)"), PoolArgs)


def pool_args_from(ns: argparse.Namespace) -> PoolArgs:
    return _fields_from(PoolArgs, ns, {})


def add_sampling_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (),
                      **defaults: typing.Any) -> None:
    group = parser.add_argument_group("sampling")
    hints = typing.get_type_hints(SamplingParams)
    fields = {f.name: f for f in dataclasses.fields(SamplingParams)}
    for name in SAMPLING_FLAGS:
        if name in skip:
            continue
        kwargs = _flag_kwargs(hints[name], defaults.get(name, fields[name].default))
        group.add_argument(flag_name(name), dest=name, help=_SAMPLING_HELP[name], **kwargs)
    shape = parser.add_argument_group("structured outputs (at most one)")
    shape.add_argument("--json-schema", dest="json_schema", metavar="SCHEMA",
                       help="Answer with a JSON document of this schema: a file holding it, "
                            "or the schema's JSON text.")
    shape.add_argument("--json-object", dest="json_object", action="store_true",
                       help="Answer with a JSON object (any keys).")
    shape.add_argument("--regex", dest="regex", metavar="PATTERN",
                       help="Answer with text this regular expression matches in full.")
    shape.add_argument("--choice", dest="choice", action="append", metavar="TEXT",
                       help="Answer with one of these strings; repeat the flag for each.")


def structured_outputs_from(ns: argparse.Namespace) -> StructuredOutputsParams | None:
    """The structured-outputs flags as StructuredOutputsParams (None: none given);
    FlagError naming the flag at fault."""
    given = {flag: value for flag, value in (
        ("--json-schema", getattr(ns, "json_schema", None)),
        ("--json-object", getattr(ns, "json_object", False) or None),
        ("--regex", getattr(ns, "regex", None)), ("--choice", getattr(ns, "choice", None)))
        if value is not None}
    if not given:
        return None
    if len(given) > 1:
        raise FlagError(sorted(given)[1], f"give one of {', '.join(sorted(given))}, not several")
    schema = given.get("--json-schema")
    if schema is not None and not schema.lstrip().startswith(("{", "true", "false")):
        try:
            schema = Path(schema).read_text()
        except OSError as e:
            raise FlagError("--json-schema", f"neither a file nor a schema's JSON text: {e}") \
                from e
    try:
        return StructuredOutputsParams(json=schema, json_object=given.get("--json-object"),
                                       regex=given.get("--regex"), choice=given.get("--choice"))
    except ValueError as e:
        raise FlagError(next(iter(given)), str(e)) from e


def sampling_params_from(ns: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the sampling flags; FlagError naming the flag for a bad value."""
    values = {name: getattr(ns, name) for name in SAMPLING_FLAGS if hasattr(ns, name)}
    structured = structured_outputs_from(ns)
    if structured is not None:
        values["structured_outputs"] = structured
    try:
        return SamplingParams(**values)
    except ValueError as e:
        found = re.match(r"SamplingParams\.(\w+) (.*)", str(e), re.DOTALL)
        if found is None or found.group(1) not in values:
            raise
        raise FlagError(flag_name(found.group(1)), found.group(2)) from e


def refuse_embed_task(ns: argparse.Namespace, command: str) -> None:
    """Generation commands cannot run an embedding engine: say so before starting one."""
    if getattr(ns, "task", None) == "embed":
        raise FlagError("--task", f"`spindle {command}` generates text; to embed texts, run "
                        "`spindle embed` (or `spindle serve --task embed`)")
