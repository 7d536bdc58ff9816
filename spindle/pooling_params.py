"""Per-request parameters of a pooling (embedding) request.

Passing a PoolingParams instead of SamplingParams to LLMEngine.add_request makes the
request an embedding request: its whole prompt runs in one step and it finishes
with one pooled vector instead of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    # None: the model's default (its sentence-transformers Normalize module, else
    # the engine's normalize_embeddings, else True).
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"PoolingParams.normalize must be None or a bool, "
                             f"got {self.normalize!r}")
