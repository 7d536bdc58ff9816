"""Loading a checkpoint's tokenizer: transformers' AutoTokenizer, imported on first use.

The class choice is AutoTokenizer's own, so it follows the installed transformers;
spindle keeps no copy of its tables. Importing it here, not at module level, keeps
`from spindle import LLM` free of transformers.
"""

from __future__ import annotations

from typing import Any


def load_tokenizer(path: str, hf_config: Any = None) -> Any:
    """AutoTokenizer.from_pretrained(path). hf_config: transformers' config of
    path/config.json when the caller has it already (AutoTokenizer takes it instead of
    reading the file again). Raises ValueError naming path when it cannot load."""
    from transformers import AutoTokenizer

    kwargs = {} if hf_config is None else {"config": hf_config}
    try:
        return without_length_warning(AutoTokenizer.from_pretrained(path, **kwargs))
    except Exception as e:  # transformers raises many types for a bad tokenizer
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
