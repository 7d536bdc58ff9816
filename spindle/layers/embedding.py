"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded up to a multiple of the tensor parallel size and split into
equal contiguous ranges, one per rank. Padding rows are zero and their logits are cut
off in ParallelLMHead.compute_logits, so callers always see exactly vocab_size columns.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers import int8_head
from spindle.layers.int4 import Int4Weight
from spindle.layers.int8_head import Int8Weight
from spindle.layers.linear import apply_linear, copy_checked, set_weight_loader


def pad_vocab_size(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    # int8 weight (int8_head.py): a tied int8 LM head's, shared, or the head's own
    # (ParallelLMHead.use_int4_weight, with the fused CPU kernels).
    int8: Int8Weight | None = None

    def __init__(self, num_embeddings: int, embedding_dim: int, *,
                 tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, tp_group.size)
        self.num_embeddings_per_rank = self.num_embeddings_padded // tp_group.size
        self.vocab_start = tp_group.rank * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_rank, embedding_dim),
                                   requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard id, got {shard_id!r}")
        expected = (self.num_embeddings, self.embedding_dim)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"shape mismatch: expected a full embedding of shape {expected}, "
                             f"checkpoint tensor gives {tuple(loaded_weight.shape)}")
        # Rows of this rank that exist in the real vocabulary; the rest is padding.
        real_rows = max(0, min(self.vocab_end, self.num_embeddings) - self.vocab_start)
        self._write_rows(param, loaded_weight.narrow(0, self.vocab_start, real_rows))

    def _write_rows(self, param: nn.Parameter, real: Any) -> None:
        """This rank's rows of the vocabulary (its first len(real) rows), padding zeroed."""
        quantized = self._quantized_weight()
        if quantized is not None and param is self.weight:
            quantized.write_rows(real, 0)
            padding = self.num_embeddings_per_rank - real.shape[0]
            if padding:
                quantized.write_rows(torch.zeros(padding, self.embedding_dim), real.shape[0])
            return
        with torch.no_grad():
            copy_checked(param.data[:real.shape[0]], real)
            param.data[real.shape[0]:].zero_()

    def _quantized_weight(self) -> Int8Weight | Int4Weight | None:
        """What holds self.weight quantized (rows go through its write_rows), if any."""
        return self.int8

    def use_int8_weight(self) -> None:
        """Hold the weight as int8 codes with float32 group scales and offsets
        (int8_head.py), before loading: a tied int8 LM head's, shared; a lookup
        dequantizes the rows it reads."""
        self.int8 = Int8Weight(self, *self.weight.shape)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return self.int8.lookup(ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group.size == 1:
            return self._lookup(input_ids)
        # Each rank embeds the ids in its range, zeros elsewhere; the sum over ranks
        # is the full embedding.
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
        out = self._lookup(local_ids)
        out = out * in_range.unsqueeze(-1).to(out.dtype)
        return self.tp_group.all_reduce(out)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings} (padded {self.num_embeddings_padded}), "
                f"embedding_dim={self.embedding_dim}, tp_size={self.tp_group.size}")


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection onto the vocabulary, sharded like the embedding.

    compute_logits returns the full [N, vocab_size] logits on every rank. Tie it to an
    embedding with tie_to(embedding): both then share one parameter.
    """

    batch_invariant = False  # set by enable_batch_invariance (batch_invariant.py)
    tied = False  # shares the embedding's parameter (tie_to)
    int4: Int4Weight | None = None  # int4 weight only (use_int4_weight)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        if embedding.weight.shape != self.weight.shape:
            raise ValueError(f"cannot tie an LM head of shape {tuple(self.weight.shape)} to an "
                             f"embedding of shape {tuple(embedding.weight.shape)}")
        self.weight = embedding.weight
        self.tied = True
        self._embedding = weakref.ref(embedding)  # (not a submodule)

    def use_int4_weight(self) -> None:
        """Hold the weight quantized, before loading (GGUF matrices, models/gguf_weights.py).

        With the fused CPU kernels (int8_head.enabled()): int8 codes with the file's
        float32 group scales and offsets, multiplied in float32 (float32 logits). A
        tied head keeps sharing its weight with the embedding, which then holds it in
        that form too and dequantizes the rows it looks up.

        Without them (or with SPINDLE_CPU_INT8_HEAD=0): torch's CPU int4 layout
        (int4.py), whose kernel returns the logits rounded to bf16. A tied head then
        gets a weight of its own, filled by the embedding's loader from the same
        checkpoint tensor (the embedding stays dense: it is read one row per token)."""
        if int8_head.enabled():
            if self.tied:
                embedding = self._embedding()
                if embedding.int8 is None:
                    embedding.use_int8_weight()
                self.weight = embedding.weight
                self.int8 = embedding.int8
            else:
                self.int8 = Int8Weight(self, *self.weight.shape)
            return
        if self.tied:
            shared = self.weight
            self.weight = nn.Parameter(torch.empty(shared.shape, dtype=shared.dtype,
                                                   device=shared.device), requires_grad=False)
            set_weight_loader(self.weight, self.weight_loader)
            self.weight.loaded_with = shared  # complete when the embedding is
            fill_embedding = shared.weight_loader

            def fill_both(param: nn.Parameter, loaded_weight: Any, shard_id: Any = None) -> None:
                fill_embedding(param, loaded_weight, shard_id)
                self.weight_loader(self.weight, loaded_weight, shard_id)

            shared.weight_loader = fill_both
            self.tied = False
        self.int4 = Int4Weight(self, *self.weight.shape)

    def _quantized_weight(self) -> Int8Weight | Int4Weight | None:
        return self.int4 if self.int4 is not None else self.int8

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            logits = self.int8.matmul(hidden_states)  # (float32)
        elif self.int4 is not None:
            logits = self.int4.matmul(hidden_states)
        else:
            logits = apply_linear(hidden_states, self.weight, invariant=self.batch_invariant)
        logits = self.tp_group.all_gather(logits, dim=-1)
        if logits.shape[-1] != self.num_embeddings:
            logits = logits[..., :self.num_embeddings]
        return logits

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding: call compute_logits(hidden_states)")
