"""Loading a checkpoint's tokenizer: transformers' AutoTokenizer, imported on first use,
or on a later start the same tokenizer from the start cache, without transformers.

The class choice is AutoTokenizer's own, so it follows the installed transformers;
spindle keeps no copy of its tables. Importing it here, not at module level, keeps
`from spindle import LLM` free of transformers. With the start cache on
(start_cache.py), a tokenizer that engine/cached_tokenizer.py can keep whole becomes a
CachedTokenizer, on its first start as on later ones (which read it back without
importing transformers); any other stays transformers' object.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from spindle import start_cache

logger = logging.getLogger(__name__)

# Files of a checkpoint directory that no tokenizer reads (weights), left out of the
# start cache's key; everything else in the directory is in it.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5",
                    ".msgpack", ".onnx", ".npz")
# A subdirectory transformers reads named chat templates from.
_TEMPLATE_DIRECTORY = "additional_chat_templates"


def load_tokenizer(path: str, hf_config: Any = None) -> Any:
    """The tokenizer of path: AutoTokenizer.from_pretrained(path), as a CachedTokenizer
    where it can be one (start cache on). hf_config: transformers' config of
    path/config.json when the caller has it already (AutoTokenizer takes it instead of
    reading the file again; a plain-data snapshot is not passed). Raises ValueError
    naming path when it cannot load."""
    if not start_cache.enabled():
        return auto_tokenizer(path, hf_config)
    from spindle.engine.cached_tokenizer import CachedTokenizer, tokenizer_state, why_not_cacheable

    key = _cache_key(Path(path))
    state = start_cache.load(key) if key is not None else None
    if isinstance(state, dict) and "backend" in state:
        try:
            return CachedTokenizer(state, path)
        except Exception as e:  # a state this code cannot rebuild: load it again
            logger.warning("ignoring the start cache's tokenizer of %s: %s", path, e)
    tokenizer = auto_tokenizer(path, hf_config)
    reason = why_not_cacheable(tokenizer)
    if reason is not None:
        logger.info("the tokenizer of %s stays transformers' (%s): later starts load it "
                    "through transformers too", path, reason)
        return tokenizer
    state = tokenizer_state(tokenizer)
    if key is not None:
        start_cache.store(key, state)
    # transformers' object is dropped, its backend kept: get_tokenizer() loads a fresh
    # one, whose calls cannot change the engine's backend.
    return CachedTokenizer(state, path, backend=tokenizer.backend_tokenizer)


def auto_tokenizer(path: str, hf_config: Any = None) -> Any:
    """AutoTokenizer.from_pretrained(path) (ValueError naming path when it cannot load)."""
    from transformers import AutoTokenizer

    from spindle.hf_config import ConfigSnapshot

    kwargs = {} if hf_config is None or isinstance(hf_config, ConfigSnapshot) else {"config": hf_config}
    try:
        return without_length_warning(AutoTokenizer.from_pretrained(path, **kwargs))
    except Exception as e:  # transformers raises many types for a bad tokenizer
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e


def _cache_key(path: Path) -> str | None:
    """The start cache's name for path's tokenizer: the path, the bytes of every file
    of the directory but weights (and of its named chat templates), and the versions of the
    packages that read them; None when path is not a readable directory (AutoTokenizer
    then says what is wrong)."""
    try:
        files = sorted(f for f in path.iterdir() if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES))
        templates = path / _TEMPLATE_DIRECTORY
        if templates.is_dir():
            files += sorted(f for f in templates.iterdir() if f.is_file())
        parts: list[bytes | str] = [str(path)]  # (the tokenizer's name_or_path)
        parts += [start_cache.package_version(name)
                  for name in ("transformers", "tokenizers", "jinja2")]
        for file in files:
            parts += [str(file.relative_to(path)), file.read_bytes()]
    except OSError:
        return None
    return start_cache.entry_key("tokenizer", parts)


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
