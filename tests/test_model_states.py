"""The model-state registry, and the runner's promise: no architecture-specific code."""

from __future__ import annotations

import ast
import inspect
import types

import pytest

import spindle.runner.model_runner as model_runner
from spindle.runner.model_states import model_state_class
from spindle.runner.model_states.default import DefaultModelState
from spindle.runner.model_states.encoder_only import EncoderOnlyModelState
from spindle.runner.model_states.prompt_embeds import PromptEmbedsState

# Names of architectures, model kinds and input modes: they belong to the states.
ARCHITECTURE_WORDS = ("llama", "qwen", "bert", "roberta", "mistral", "encoder", "decoder",
                      "model_kind", "prompt_embeds", "architecture", "token_type")


def _code_words(source: str) -> set[str]:
    """Identifiers, attribute names and string constants of the code (no docstrings
    or comments)."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.alias):
            words.add(node.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings:
            words.add(node.value)
    return words


def test_runner_has_no_architecture_specific_branches():
    words = {w.lower() for w in _code_words(inspect.getsource(model_runner))}
    found = sorted(w for w in words if any(a in w for a in ARCHITECTURE_WORDS))
    assert not found, f"model_runner.py names architecture-specific things: {found}"


def _config(enable_prompt_embeds: bool) -> types.SimpleNamespace:
    return types.SimpleNamespace(model=types.SimpleNamespace(
        enable_prompt_embeds=enable_prompt_embeds))


@pytest.mark.parametrize("kind,prompt_embeds,state", [
    ("decoder", False, DefaultModelState),
    ("decoder", True, PromptEmbedsState),
    ("encoder", False, EncoderOnlyModelState),
])
def test_states_by_kind_and_input_mode(kind, prompt_embeds, state):
    assert model_state_class(kind, _config(prompt_embeds)) is state


def test_unknown_kind_and_unsupported_mode_are_named():
    with pytest.raises(ValueError, match="mamba"):
        model_state_class("mamba", _config(False))
    with pytest.raises(ValueError, match="enable_prompt_embeds is not supported for encoder"):
        model_state_class("encoder", _config(True))


def test_a_model_instance_declares_its_kind():
    encoder = types.SimpleNamespace(model_kind="encoder")
    assert model_state_class(encoder) is EncoderOnlyModelState
    assert model_state_class(object()) is DefaultModelState  # no declaration: a decoder
