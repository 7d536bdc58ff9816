"""Loading a checkpoint's tokenizer: AutoTokenizer's choice, without AutoTokenizer's import.

Importing AutoTokenizer imports transformers' whole model registry (about 2.5 s on the
CI machines, more on a slow host). For the model types spindle serves,
resolve_tokenizer_class follows AutoTokenizer.from_pretrained's choice of class step by
step (from tokenizer_config.json and the model type) and imports only that class, which
then loads exactly as under AutoTokenizer. A case it does not follow (remote code,
another model type or tokenizer class, a transformers version it was not checked
against) goes to AutoTokenizer. tests/test_tokenizer_loader.py checks the choice
against the installed transformers.
"""

from __future__ import annotations

import fnmatch
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from spindle.hf_config import (hub_commit_hash, plain_hf_config, read_config_json,
                               tested_transformers)


def load_tokenizer(path: str, hf_config: Any = None) -> Any:
    """What AutoTokenizer.from_pretrained(path) returns. hf_config: the HF config of
    path/config.json, when the caller has read it already."""
    try:
        choice = resolve_tokenizer_class(path, hf_config)
        if choice is None:
            from transformers import AutoTokenizer

            return without_length_warning(AutoTokenizer.from_pretrained(path))
        tokenizer_class, kwargs = choice
        return without_length_warning(
            tokenizer_class.from_pretrained(path, _from_auto=True, **kwargs))
    except Exception as e:
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e


# The key under which transformers notes that it gave its "Token indices sequence length
# is longer than the specified maximum sequence length" warning (it gives it once).
_LENGTH_WARNING_KEY = "sequence-length-is-longer-than-the-specified-maximum"


def without_length_warning(tokenizer: Any) -> Any:
    """The tokenizer, with its warning about prompts longer than model_max_length
    marked as given already.

    The engine checks every prompt against max_model_len itself and refuses one that is
    too long with a clear error; the tokenizer's warning would come first, compare with
    model_max_length (often not the model's context), and speak of indexing errors that
    cannot happen. Truncation and the tokenizer's other behaviour stay as they are.
    """
    given = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(given, dict):
        given[_LENGTH_WARNING_KEY] = True
    return tokenizer


def resolve_tokenizer_class(path: str, hf_config: Any = None) -> tuple[type, dict] | None:
    """(class, extra from_pretrained kwargs) that AutoTokenizer.from_pretrained(path)
    would use, or None where this does not follow AutoTokenizer."""
    if not tested_transformers() or _custom_tokenizers_registered():
        return None
    if hf_config is None:  # AutoTokenizer reads the tokenizer directory's config.json
        try:
            hf_config = plain_hf_config(read_config_json(Path(path)), path)
        except (OSError, ValueError):
            return None
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in REGISTERED_TOKENIZERS or hasattr(hf_config, "model_name"):
        return None
    tokenizer_config = _read_tokenizer_config(path)
    if tokenizer_config is None or "auto_map" in tokenizer_config:
        return None
    name_or_path = getattr(hf_config, "_name_or_path", None)
    name_or_path = name_or_path.lower() if isinstance(name_or_path, str) else ""
    if any(fnmatch.fnmatch(name_or_path, p) for p in MODEL_IDS_TO_TOKENIZERS_BACKEND):
        return _class_from_name("TokenizersBackend"), {}
    registered = REGISTERED_TOKENIZERS[model_type]
    config_class = tokenizer_config.get("tokenizer_class")
    hub = config_class or getattr(hf_config, "tokenizer_class", None)
    if not (hub is None or isinstance(hub, str)) or not (
            config_class is None or (isinstance(config_class, str) and config_class)):
        return None
    if hub is not None and registered is not None and (
            registered.removesuffix("Fast") != hub.removesuffix("Fast")):
        # The hub names another class than the model type's: AutoTokenizer trusts the
        # hub, unless transformers knows this model type's hub classes to be wrong.
        name = registered.removesuffix("Fast") if model_type in WRONG_HUB_CLASS else hub
        if name not in _CLASSES:
            return None
        chosen = _class_from_name(name)
        if chosen.__name__ in _GENERIC:
            chosen = _class_from_name("TokenizersBackend")
        return chosen, {}
    kwargs = {"_commit_hash": tokenizer_config["_commit_hash"]} if tokenizer_config else {}
    if config_class is not None:
        config_class = config_class.removesuffix("Fast")
        if config_class not in _CLASSES:
            return None
        return _class_from_name(config_class), kwargs
    if getattr(hf_config, "tokenizer_class", None):
        return None
    # The class registered for the model type (the tokenizers backend when there is none).
    return _class_from_name(registered or "TokenizersBackend"), kwargs


def _custom_tokenizers_registered() -> bool:
    """Whether AutoTokenizer.register added classes that its choice could depend on."""
    auto = sys.modules.get(_AUTO_TOKENIZER_MODULE)
    if auto is None:
        return False
    mapping = getattr(auto, "TOKENIZER_MAPPING", None)
    return bool(getattr(auto, "REGISTERED_TOKENIZER_CLASSES", None)
                or getattr(auto, "REGISTERED_FAST_ALIASES", None)
                or getattr(mapping, "_extra_content", None))


# ---------------------------------------------------------------------- tables
# transformers' TOKENIZER_MAPPING_NAMES for the model types spindle serves.
REGISTERED_TOKENIZERS = {"llama": None, "qwen2": "Qwen2Tokenizer", "qwen3": "Qwen2Tokenizer",
                         "bert": "BertTokenizer", "roberta": "RobertaTokenizer",
                         "xlm-roberta": "XLMRobertaTokenizer"}
# Those of them in transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.
WRONG_HUB_CLASS = frozenset({"qwen2"})
# transformers' MODEL_IDS_TO_TOKENIZERS_BACKEND.
MODEL_IDS_TO_TOKENIZERS_BACKEND = (
    "deepseek-ai/deepseek-r1-distill-llama-*", "deepseek-ai/deepseek-coder-*",
    "allenai/dolma2-tokenizer", "google/umt5-small", "salesforce/blip2-opt-*",
    "salesforce/blip2-flan-t5-*", "salesforce/instructblip-flan-t5-*", "stepfun-ai/step-3.7-*")
_GENERIC = ("TokenizersBackend", "PythonBackend", "PreTrainedTokenizerFast")
_BACKEND = ("transformers.tokenization_utils_tokenizers", "TokenizersBackend")
# Class name -> (module, attribute): what transformers' tokenizer_class_from_name gives.
_CLASSES = {
    **{name: _BACKEND for name in ("TokenizersBackend", "PreTrainedTokenizerFast",
                                   "PreTrainedTokenizer", "PythonBackend", "BloomTokenizer",
                                   "BloomTokenizerFast")},
    **{name + suffix: (f"transformers.models.{module}.tokenization_{module}", name)
       for module, name in (("qwen2", "Qwen2Tokenizer"), ("llama", "LlamaTokenizer"),
                            ("bert", "BertTokenizer"), ("roberta", "RobertaTokenizer"),
                            ("xlm_roberta", "XLMRobertaTokenizer"), ("gpt2", "GPT2Tokenizer"))
       for suffix in ("", "Fast")},
}
_AUTO_TOKENIZER_MODULE = "transformers.models.auto.tokenization_auto"


def _class_from_name(name: str) -> type:
    # (PythonBackend maps to TokenizersBackend here: AutoTokenizer swaps it in anyway.)
    # Imports only that class's module, never the auto registry.
    module, attribute = _CLASSES[name]
    return getattr(importlib.import_module(module), attribute)


def _read_tokenizer_config(path: str) -> dict | None:
    """tokenizer_config.json as AutoTokenizer reads it ({} when there is none; None when
    it cannot be read, which AutoTokenizer reports itself)."""
    file = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    config["_commit_hash"] = hub_commit_hash(file)
    return config
