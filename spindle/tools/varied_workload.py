"""A workload that touches every serving path once: batches of many sizes, prompts of
many lengths, every sampling option. What checks that nothing compiles after the engine
is ready run (tests/test_compile_gpu.py, benchmarks/compile_audit.py)."""

from __future__ import annotations

import random
from typing import Sequence

# One request in each batch per option, in turn.
SAMPLING_OPTIONS = (
    dict(temperature=0.0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=5),
    dict(temperature=0.7, min_p=0.1),
    dict(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3),
    dict(temperature=0.0, logprobs=3), dict(temperature=1.0, seed=7), dict(temperature=0.9, n=3),
    dict(temperature=0.0, min_tokens=2))


def run_varied_workload(llm, batch_sizes: Sequence[int], prompt_lengths: Sequence[int],
                        max_token_id: int, seed: int = 0) -> None:
    """One generate call per batch size, each prompt's length drawn from prompt_lengths,
    token ids from 2..max_token_id, 2-20 new tokens (EOS ignored)."""
    from spindle import SamplingParams

    rng = random.Random(seed)
    for batch in batch_sizes:
        prompts = [[rng.randint(2, max_token_id) for _ in range(rng.choice(prompt_lengths))]
                   for _ in range(batch)]
        params = [SamplingParams(max_tokens=rng.randint(2, 20), ignore_eos=True,
                                 **SAMPLING_OPTIONS[(i + batch) % len(SAMPLING_OPTIONS)])
                  for i in range(batch)]
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
