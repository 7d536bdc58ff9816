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

The folder stays bounded: past MAX_ENTRIES entries or MAX_BYTES in all, a store
deletes the least recently used (a read marks an entry used).

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

from spindle.switches import on_off

logger = logging.getLogger(__name__)

ENABLE_ENV = "SPINDLE_START_CACHE"
DIRECTORY_ENV = "SPINDLE_START_CACHE_DIR"
# What an entry holds; raise it when the stored objects change shape.
FORMAT = 3
# The bounds of the folder (a 150k-token tokenizer's entry is 3.5 MB).
MAX_ENTRIES = 256
MAX_BYTES = 512 << 20


def enabled() -> bool:
    return on_off(ENABLE_ENV, True)


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
            value = pickle.load(f)
        os.utime(path)  # used now: the last to be pruned
        return value
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
        prune(folder)
    except OSError as e:
        logger.warning("cannot write the start cache in %s (%s); later starts will read "
                       "the checkpoint through transformers again", folder, e)


def prune(folder: Path, max_entries: int | None = None, max_bytes: int | None = None) -> None:
    """Deletes the least recently used entries until at most max_entries remain and
    they hold at most max_bytes (the module's bounds by default). Entries another
    process deletes meanwhile are skipped."""
    max_entries = MAX_ENTRIES if max_entries is None else max_entries
    max_bytes = MAX_BYTES if max_bytes is None else max_bytes
    entries = []
    for path in folder.glob("*.pickle"):
        try:
            stat = path.stat()
        except FileNotFoundError:
            continue
        entries.append((stat.st_mtime_ns, stat.st_size, path))
    entries.sort(reverse=True)  # newest first
    kept_bytes = 0
    for count, (_, size, path) in enumerate(entries, start=1):
        kept_bytes += size
        if count > max_entries or kept_bytes > max_bytes:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
