"""What a start reads through transformers, kept on disk so that later starts of the
same checkpoint need no transformers at all.

Importing transformers and running AutoConfig and AutoTokenizer are 1.3-1.8 s of a
warm start (docs/benchmarks.md, "A start without transformers"). What the engine
keeps of them is plain data: the HF config's attribute values (a ConfigSnapshot, what
worker processes get anyway) and the tokenizer as transformers built it (its
`tokenizers.Tokenizer` as JSON and the attributes spindle reads, engine/
cached_tokenizer.py). The first start of a checkpoint stores both; later starts read
them back in milliseconds.

An entry's name hashes everything its content depends on: the checkpoint's path (which
transformers records), the bytes of the files transformers read, the versions of the
packages that read them, and this module's FORMAT. So an edited config.json or
tokenizer file, or another transformers, simply misses. Entries are written whole (a temporary file renamed into place); one that
cannot be read is ignored and written again.

Where: $SPINDLE_START_CACHE_DIR, else $XDG_CACHE_HOME/spindle/start (~/.cache/...).
SPINDLE_START_CACHE=0 turns the cache off: then the engine uses transformers' own
config and tokenizer objects, as it did before the cache existed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any, Iterable

logger = logging.getLogger(__name__)

ENABLE_ENV = "SPINDLE_START_CACHE"
DIRECTORY_ENV = "SPINDLE_START_CACHE_DIR"
# What an entry holds; raise it when the stored objects change shape.
FORMAT = 2


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0"


def directory() -> Path:
    if os.environ.get(DIRECTORY_ENV):
        return Path(os.environ[DIRECTORY_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "spindle" / "start"


def package_version(name: str) -> str:
    """The installed version of a package, read from its metadata (not by importing it)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def entry_key(kind: str, parts: Iterable[bytes | str]) -> str:
    """kind-<hash of FORMAT and parts>: the name of an entry."""
    digest = hashlib.blake2b(f"{kind}\0{FORMAT}".encode(), digest_size=20)
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return f"{kind}-{digest.hexdigest()}"


def load(key: str) -> Any | None:
    """The entry stored under key, or None (none stored, or one that cannot be read)."""
    path = directory() / f"{key}.pickle"
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception as e:  # a damaged or truncated entry: read the sources again
        logger.warning("ignoring the unreadable start cache entry %s: %s", path, e)
        return None


def store(key: str, value: Any) -> None:
    """Writes the entry whole; a cache that cannot be written is noted, not fatal (the
    start goes on, and the next one reads through transformers again)."""
    folder = directory()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{key}-", dir=folder)
        try:
            with os.fdopen(handle, "wb") as f:
                pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(temporary, folder / f"{key}.pickle")
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as e:
        logger.warning("cannot write the start cache in %s (%s); later starts will read "
                       "the checkpoint through transformers again", folder, e)
