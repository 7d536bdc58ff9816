"""Chunked local attention (Llama 4's ``attention_chunk_size`` C): the sequence is cut
into chunks of C positions, and a query sees the keys of its own chunk up to itself,
k in [floor(p / C) * C, p].

Those keys all lie within the last C positions, so such a layer is served as a
sliding window of C (the cache frees what falls out of it, the backends read no key
before it) with one more bound on top: a key before the query's chunk start is masked
(and the decode paths start reading at the chunk start)."""

from __future__ import annotations


def chunk_as_window(sliding_window: int | None, attention_chunk_size: int | None
                    ) -> tuple[int | None, int | None]:
    """(the window a backend reads within, the chunk size): a chunked layer reads within
    a window of its chunk size. ValueError for a layer given both, or a chunk < 1."""
    if attention_chunk_size is None:
        return sliding_window, None
    if sliding_window is not None:
        raise ValueError("a layer has a sliding window or attention chunks, not both")
    if attention_chunk_size < 1:
        raise ValueError(f"attention_chunk_size must be >= 1 or None, got "
                         f"{attention_chunk_size}")
    return attention_chunk_size, attention_chunk_size
