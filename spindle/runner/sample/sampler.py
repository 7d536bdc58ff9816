"""Turns one row of logits per request into one token per request.

The order of operations follows vLLM v1:
  1. logprobs, if wanted, from the RAW logits (they describe the model; with
     processed=True, from the logits the token is drawn from, after steps 2-5);
  2. min_tokens: forbid the blocked ids (stop/EOS ids) of rows still too short;
     allowed_token_ids: forbid every id but those of rows that list them;
     logit_bias: add each listed row's biases;
  3. repetition / frequency / presence penalties;
  4. greedy rows: argmax of the penalised logits;
  5. random rows: temperature, min-p, top-k, top-p, then an exponential race;
  6. the sampled token's logprob and rank, read from the logprobs of step 1.

Device-agnostic and batched: the only Python loops are over the rows that have
their own generator (to draw their noise) and over host-side lists (min_tokens ids,
output ids for the penalties) to pack them into tensors; nothing reads device
values back to the host (checked on CUDA by the gpu test in tests/test_sampler.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from spindle.layers import cpu_kernels
from spindle.layers.batch_invariant import pad_vocab
from spindle.runner.sample.logprobs import compute_logprobs, gather_logprobs
from spindle.runner.sample.metadata import SamplingMetadata
from spindle.runner.sample.penalties import apply_penalties
from spindle.runner.sample.topk_topp import apply_min_p, apply_top_k_top_p
from spindle.switches import on_off

GREEDY_KERNEL_ENV = "SPINDLE_GREEDY_KERNEL"
# Rows with a temperature below this are greedy (the same bound as SamplingParams.is_greedy).
GREEDY_TEMPERATURE_EPS = 1e-5


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    # Present when metadata.max_num_logprobs is not None (k = that value, capped at V):
    logprob_token_ids: torch.Tensor | None = None  # [B, k+1] int64: sampled, then top-k
    logprobs: torch.Tensor | None = None  # [B, k+1] float32, matching logprob_token_ids
    sampled_ranks: torch.Tensor | None = None  # [B] int64, 1 = most likely


class Sampler(torch.nn.Module):
    """Samples one token per row; does not modify the logits it is given.

    processed: logprobs describe the distribution each token was drawn from (after
    min_tokens, penalties and, for sampled rows, temperature and filters; a filtered
    token's is -inf) rather than the model's raw one (what an RL trainer needs to
    weigh the sample exactly).

    batch_invariant: the logits are first padded to an aligned width (pad_vocab in
    layers/batch_invariant.py), so every row's reductions run alike whatever the
    batch; the padding is cut off again before anything leaves draw()."""

    def __init__(self, processed: bool = False, batch_invariant: bool = False) -> None:
        super().__init__()
        self.processed = processed
        self.batch_invariant = batch_invariant

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata,
                argmax: torch.Tensor | None = None) -> SamplerOutput:
        """argmax: each row's argmax of logits where it was computed already (a decode
        graph's, runner/cuda_graph.py), taken as the tokens when that is all it takes."""
        if argmax_suffices(metadata):
            _check_logits(logits)
            if argmax is not None:
                return SamplerOutput(sampled_token_ids=argmax)
            # The logits as they come (a bf16 model's): widening them to float32 first
            # changes no comparison, and at 256 rows of a 152k vocabulary it was a
            # 230 MB round trip through device memory per step.
            return SamplerOutput(sampled_token_ids=raw_argmax(logits))
        sampled, _, logprobs_of = self.draw(logits, metadata)
        return self.gather(logprobs_of, sampled, metadata)

    def draw(self, logits: torch.Tensor, metadata: SamplingMetadata
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Steps 1-5: the tokens [B], the logits each was drawn from [B, V] (a greedy
        row's: its penalised logits), and the logprobs the reply reads (None when no
        row wants any)."""
        _check_logits(logits)
        logits = logits.float()
        vocab = logits.shape[-1]
        if self.batch_invariant:
            logits = pad_vocab(logits)
        wanted = metadata.max_num_logprobs is not None
        logprobs_of = None
        if wanted and not self.processed:
            logprobs_of = compute_logprobs(logits)

        logits = block_min_tokens(logits, metadata.min_tokens_blocked)
        logits = keep_allowed_tokens(logits, metadata.allowed_token_ids)
        logits = add_logit_bias(logits, metadata.logit_bias)
        logits = apply_penalties(logits, metadata)
        sampled, drawn_from = sample(logits, metadata)
        if wanted and logprobs_of is None:
            logprobs_of = compute_logprobs(drawn_from)
        if drawn_from.shape[-1] != vocab:  # (the batch-invariant padding)
            drawn_from = drawn_from[:, :vocab]
            logprobs_of = logprobs_of[:, :vocab] if logprobs_of is not None else None
        return sampled, drawn_from, logprobs_of

    @staticmethod
    def gather(logprobs_of: torch.Tensor | None, tokens: torch.Tensor,
               metadata: SamplingMetadata) -> SamplerOutput:
        """Step 6: the output for tokens (of any row: ids below 0 stand for none)."""
        if logprobs_of is None:
            return SamplerOutput(sampled_token_ids=tokens)
        token_ids, logprobs, ranks = gather_logprobs(
            logprobs_of, tokens.clamp(min=0), metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=tokens, logprob_token_ids=token_ids,
                             logprobs=logprobs, sampled_ranks=ranks)


def sample(logits: torch.Tensor, metadata: SamplingMetadata
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] int64 tokens from penalised logits: argmax for greedy rows, a draw for the
    rest; and the logits each row's token was drawn from (a greedy row's: its own)."""
    if metadata.all_greedy:
        return greedy_sample(logits), logits
    random_tokens, filtered = random_sample(logits, metadata)
    if metadata.all_random:
        return random_tokens, filtered
    is_greedy = metadata.temperature < GREEDY_TEMPERATURE_EPS
    return (torch.where(is_greedy, greedy_sample(logits), random_tokens),
            torch.where(is_greedy.unsqueeze(1), logits, filtered))


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")


def argmax_suffices(metadata: SamplingMetadata) -> bool:
    """Every row greedy, no logprobs, nothing that changes logits before the argmax
    (min_tokens, allowed ids, penalties): the token is the argmax of the raw logits."""
    return (metadata.all_greedy and metadata.max_num_logprobs is None
            and not metadata.min_tokens_blocked and not metadata.allowed_token_ids
            and metadata.logit_bias is None and metadata.no_penalties)


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row (the first maximum). On the CPU the fused kernels' argmax
    gives the same index as torch's, several times faster (cpu_kernels.argmax_rows)."""
    if cpu_kernels.argmax_applies(logits):
        return cpu_kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


def greedy_kernel_enabled() -> bool:
    """Whether raw_argmax takes CUDA logits to argmax_kernel (unless
    SPINDLE_GREEDY_KERNEL=0)."""
    return on_off(GREEDY_KERNEL_ENV, True)


def raw_argmax(logits: torch.Tensor, also_into: torch.Tensor | None = None,
               next_inputs=None) -> torch.Tensor:
    """greedy_sample of the LM head's own logits (the model's dtype), which on CUDA is
    argmax_kernel.argmax_rows unless SPINDLE_GREEDY_KERNEL=0: warm-up's greedy request
    compiles it for that dtype. (Logits the sampler made, float32, keep torch's argmax:
    a kernel variant for them would compile after warm-up.) also_into: an int64 tensor
    of [rows] that receives the tokens too. next_inputs: a decode graph's inputs that
    the kernel advances too (runner/graph_advance.py; the kernel's path only)."""
    if greedy_kernel_enabled() and logits.is_cuda:
        from spindle.runner.sample.argmax_kernel import argmax_rows

        return argmax_rows(logits, also_into, next_inputs)
    if next_inputs is not None:
        raise ValueError("raw_argmax: advancing a graph's inputs needs the CUDA argmax "
                         f"kernel (SPINDLE_GREEDY_KERNEL on, CUDA logits; got {logits.device})")
    tokens = greedy_sample(logits)
    if also_into is not None:
        also_into.copy_(tokens)
    return tokens


def random_sample(logits: torch.Tensor, metadata: SamplingMetadata
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row after temperature and the min-p / top-k / top-p filters;
    returns the tokens and those filtered logits.

    Greedy rows of a mixed batch go through too (with temperature 1, to avoid
    dividing by 0); the caller discards their result.
    """
    logits = apply_temperature(logits, metadata.temperature, metadata.all_random)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    probs = logits.softmax(dim=-1)
    return exponential_race(probs, metadata.generators), logits


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor,
                      all_random: bool) -> torch.Tensor:
    if not all_random:
        temperature = torch.where(temperature < GREEDY_TEMPERATURE_EPS, 1.0, temperature)
    return logits / temperature.to(logits.dtype).unsqueeze(1)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample token i of each row with probability probs[i]: argmax of probs / E, E ~ Exp(1).

    (E_i / p_i is exponential with rate p_i, and the smallest of independent
    exponentials is the i-th with probability p_i / sum(p).) Unlike torch.multinomial
    this needs no host sync, and it lets each seeded row draw its noise from its own
    generator: exactly V exponentials per step, whatever its batch position or mates.
    """
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    # An exponential draw can underflow to 0; 0 / 0 would be NaN, which argmax picks.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def keep_allowed_tokens(logits: torch.Tensor, allowed: dict[int, Sequence[int]]) -> torch.Tensor:
    """Set every id but the allowed ones of each listed row to -inf (ids outside the
    vocabulary are ignored): a bias row per listed row, added without a host sync.
    A row's ids are a list or a numpy array (structured outputs allow up to the whole
    vocabulary: packed without a Python loop over them)."""
    if not allowed:
        return logits
    vocab = logits.shape[-1]
    rows = list(allowed)
    flat = []
    for i, row in enumerate(rows):
        ids = np.asarray(allowed[row], dtype=np.int64)
        flat.append(i * vocab + ids[(ids >= 0) & (ids < vocab)])
    bias = torch.full((len(rows), vocab), float("-inf"), dtype=logits.dtype,
                      device=logits.device)
    bias.view(-1).index_fill_(0, torch.from_numpy(np.concatenate(flat)).to(
        logits.device, non_blocking=True), 0.0)
    logits = logits.clone()
    logits[torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)] += bias
    return logits


def add_logit_bias(logits: torch.Tensor, bias: tuple | None) -> torch.Tensor:
    """Add SamplingMetadata.logit_bias (rows, token ids, biases) to the logits."""
    if bias is None:
        return logits
    rows, tokens, values = bias
    return logits.index_put((rows, tokens), values.to(logits.dtype), accumulate=True)


def block_min_tokens(logits: torch.Tensor, blocked: dict[int, set[int]]) -> torch.Tensor:
    """Set the blocked ids of each listed row to -inf (ids outside the vocabulary are ignored)."""
    vocab = logits.shape[-1]
    flat = [row * vocab + token_id for row, token_ids in blocked.items()
            for token_id in token_ids if 0 <= token_id < vocab]
    if not flat:
        return logits
    flat_index = torch.tensor(flat, dtype=torch.int64).to(logits.device, non_blocking=True)
    # index_fill_ takes the value as a kernel argument; indexed assignment would first
    # copy it to the device, a host sync.
    return logits.clone().view(-1).index_fill_(0, flat_index, float("-inf")).view_as(logits)
