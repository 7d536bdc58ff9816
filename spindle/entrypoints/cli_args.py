"""Command-line flags generated from EngineArgs and SamplingParams fields, so the
CLI and the Python API cannot drift apart."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from spindle.config import EngineArgs, ServerArgs
from spindle.sampling_params import SamplingParams

# No per-request --seed: the engine's --seed already makes a CLI run reproducible.
_SAMPLING_FLAGS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "frequency_penalty", "presence_penalty", "max_tokens", "min_tokens",
                   "stop", "stop_token_ids", "ignore_eos", "logprobs")


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
        group.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name,
                           help=f.metadata.get("help", ""), **kwargs)


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


def add_sampling_args(parser: argparse.ArgumentParser, **defaults: typing.Any) -> None:
    group = parser.add_argument_group("sampling")
    hints = typing.get_type_hints(SamplingParams)
    fields = {f.name: f for f in dataclasses.fields(SamplingParams)}
    for name in _SAMPLING_FLAGS:
        kwargs = _flag_kwargs(hints[name], defaults.get(name, fields[name].default))
        group.add_argument(f"--{name.replace('_', '-')}", dest=name, **kwargs)


def sampling_params_from(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**{name: getattr(ns, name) for name in _SAMPLING_FLAGS})
