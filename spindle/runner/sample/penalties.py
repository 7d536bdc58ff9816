"""Repetition, frequency and presence penalties, with vLLM's semantics.

- repetition: every token seen in the prompt OR the output has its logit divided
  by p when positive and multiplied by p otherwise (so p > 1 always discourages it);
- frequency: subtract penalty * (times the token appears in the OUTPUT);
- presence: subtract penalty * (1 if the token appears in the OUTPUT).

Everything is batched: token occurrences become [B, V] tensors through a scatter
into [B, V + 1], the extra column absorbing the padding id V.
"""

from __future__ import annotations

import numpy as np
import torch

from spindle.runner.sample.metadata import SamplingMetadata


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Return penalised logits [B, V] (a new tensor; the input is left untouched).

    Does nothing when metadata.no_penalties. A penalty tensor left None is neutral.
    """
    if metadata.no_penalties:
        return logits
    batch, vocab = logits.shape
    output_ids = pad_token_lists(metadata.output_token_ids, batch, vocab, logits.device)
    output_counts = token_counts(output_ids, vocab, logits.dtype)
    output_mask = output_counts > 0

    if metadata.repetition_penalties is not None:
        seen = token_mask(metadata.prompt_token_ids, vocab) | output_mask
        logits = apply_repetition_penalty(logits, metadata.repetition_penalties, seen)
    if metadata.frequency_penalties is not None:
        logits = logits - metadata.frequency_penalties.unsqueeze(1) * output_counts
    if metadata.presence_penalties is not None:
        logits = logits - metadata.presence_penalties.unsqueeze(1) * output_mask.to(logits.dtype)
    return logits


def apply_repetition_penalty(logits: torch.Tensor, penalties: torch.Tensor,
                             seen: torch.Tensor) -> torch.Tensor:
    """Divide positive / multiply non-positive logits of the `seen` tokens by the row's penalty."""
    per_token = torch.where(seen, penalties.unsqueeze(1), torch.ones_like(logits))
    return torch.where(logits > 0, logits / per_token, logits * per_token)


def pad_token_lists(token_lists: list[list[int]], batch: int, pad_id: int,
                    device: torch.device) -> torch.Tensor:
    """Pack ragged per-row token lists into a [B, L] int64 tensor padded with pad_id.

    An empty list stands for "no row has outputs yet".
    """
    if token_lists and len(token_lists) != batch:
        raise ValueError(
            f"output_token_ids has {len(token_lists)} rows, expected {batch} (one per logits row)")
    width = max((len(row) for row in token_lists), default=0)
    packed = np.full((batch, width), pad_id, dtype=np.int64)
    for i, row in enumerate(token_lists):
        packed[i, :len(row)] = row
    return torch.from_numpy(packed).to(device, non_blocking=True)


def token_counts(token_ids: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, V] count of each token id in each row of token_ids ([B, L], padded with vocab)."""
    counts = torch.zeros(token_ids.shape[0], vocab + 1, dtype=dtype, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=dtype))
    return counts[:, :vocab]


def token_mask(token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] bool: whether each token id occurs in each row of token_ids ([B, L], padded with vocab)."""
    mask = torch.zeros(token_ids.shape[0], vocab + 1, dtype=torch.bool, device=token_ids.device)
    mask.scatter_(1, token_ids, True)
    return mask[:, :vocab]
