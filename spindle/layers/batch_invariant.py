"""Batch-invariant numerics (EngineArgs.batch_invariant): a token's results do not
depend on the tokens it is computed with.

The default kernels are fast because they adapt to the batch, and adapting changes
the order of floating-point sums: cuBLAS and the skinny GEMM pick tiles and split K
by the number of rows, MKL and oneDNN block and thread by shape, the decode attention
splits each context by batch size. So a request's logits move in the last bits with
its batch mates, and greedy tokens can flip where two logits are close. RL trainers
need the logprobs a rollout reports to be a function of the request alone.

Here every token-wise operation computes each row in an order fixed by the row's own
data and the layer's shape:

* CUDA: one Triton GEMM (invariant_gemm.py) with no split-K and one K step in every
  tile configuration, so each output element is the same sum in the same order
  whatever the batch. The norms, rotary and SiLU-and-mul are already row-wise Triton
  kernels (fused_kernels.py).
* CPU: each row goes through its own call on a fresh copy (rowwise), so every call has
  one shape, one alignment and one threading plan whatever the batch. Exact and slow
  (a call per token per operation): a correctness mode.

Attention lives in attention/backends/batch_invariant.py, sampling pads the
vocabulary (pad_vocab) so every row of the logits is laid out alike.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# Logit rows are padded to a multiple of this many columns in batch-invariant
# sampling: every row then starts at the same alignment, which torch's CUDA softmax
# kernels branch on.
VOCAB_ALIGN = 64


def enable_batch_invariance(model: torch.nn.Module) -> None:
    """Switch every layer of model that has a batch-invariant path to it (the
    attention layers are switched by their backend). Refuses what has none: a layer
    attending within a sliding window (its first key depends on the query tile)."""
    from spindle.attention.layer import Attention

    windowed = [name for name, m in model.named_modules()
                if isinstance(m, Attention) and m.sliding_window is not None]
    if windowed:
        raise ValueError(f"batch_invariant does not support sliding-window attention "
                         f"({len(windowed)} layers, e.g. {windowed[0]})")
    for module in model.modules():
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = True


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn applied to each row x[i:i+1] of x [T, ...] on its own (a fresh, aligned copy),
    the results concatenated: T calls of one shape, whatever T is."""
    if x.shape[0] <= 1:
        return fn(x.clone())
    return torch.cat([fn(x[i:i + 1].clone()) for i in range(x.shape[0])])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed batch-invariantly (see the module docstring)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x.is_cuda:
        from spindle.layers.invariant_gemm import invariant_matmul

        y = invariant_matmul(x2, weight, bias)
    else:
        y = rowwise(lambda row: F.linear(row, weight, bias), x2)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def pad_vocab(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> [B, V'] with V' the next multiple of VOCAB_ALIGN, the new
    columns -inf (no token: probability 0, never sampled, never in a top-k of <= V)."""
    vocab = logits.shape[-1]
    padded = -(-vocab // VOCAB_ALIGN) * VOCAB_ALIGN
    if padded == vocab and logits.is_contiguous():
        return logits
    out = logits.new_full((logits.shape[0], padded), float("-inf"))
    out[:, :vocab] = logits
    return out
