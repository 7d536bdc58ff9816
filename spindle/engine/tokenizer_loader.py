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
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as e:  # transformers raises many types for a bad tokenizer
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e
