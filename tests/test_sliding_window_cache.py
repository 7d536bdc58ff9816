"""Sliding-window layers hold a bounded number of KV blocks per sequence: blocks
wholly before a request's window go back to the pool as it decodes, so a cache far
too small for one full-attention sequence serves long generations, with tokens equal
to transformers'."""

from __future__ import annotations

import random

from spindle import LLM, SamplingParams
from test_generate_vs_hf import hf_greedy

WINDOW, BLOCK = 8, 4


def test_a_cache_smaller_than_one_sequence_serves_long_generations(tiny_model):
    path = tiny_model("mistral", sliding_window=WINDOW)
    rng = random.Random(3)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (5, 30)]
    max_new = 120
    expected = hf_greedy(path, prompts, max_new)
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4  # 2 layers x K,V x block x kv heads x dim x fp32
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    with LLM(str(path), dtype="float32", device="cpu", max_model_len=256, block_size=BLOCK,
             kv_cache_memory_bytes=8 * block_bytes, max_num_seqs=2,
             max_num_batched_tokens=8) as llm:
        core = llm.engine.core
        assert core.kv_config.num_blocks == 8  # a 150-token sequence would need 38
        manager = core.scheduler.kv_cache_manager
        held = []

        def recording(method, scheduled=lambda result: True):
            """The blocks a request holds at each step it is scheduled: once per step."""
            def call(request, *args, **kwargs):
                result = method(request, *args, **kwargs)
                if scheduled(result):
                    held.append(manager.get_num_blocks(request.request_id))
                return result
            return call

        # A decode step that would change nothing skips allocate_slots (holds_next_token
        # says yes); when it says no, allocate_slots runs and records the step (unless
        # the cache has no room for it: None).
        manager.allocate_slots = recording(manager.allocate_slots,
                                           scheduled=lambda blocks: blocks is not None)
        manager.holds_next_token = recording(manager.holds_next_token, scheduled=bool)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [t for t, _ in expected]
    # Prefill chunks of 8 tokens after 7 window positions straddle at most 5 blocks;
    # a decode step's token and its window at most 3.
    assert max(held) <= 5 and max(held[-50:]) <= 3 and len(held) > 2 * max_new - 10


def test_prefix_hits_and_preemption_with_sliding_layers(tiny_model):
    """Qwen2 with one full and one sliding layer: the second pass over prompts sharing
    a prefix hits blocks of both groups (the sliding group only within the window),
    and a small cache preempts; the tokens stay transformers'."""
    path = tiny_model("qwen2", num_layers=2, use_sliding_window=True, sliding_window=WINDOW,
                      max_window_layers=1)
    rng = random.Random(4)
    prefix = [rng.randrange(512) for _ in range(24)]
    prompts = [prefix + [rng.randrange(512) for _ in range(n)] for n in (1, 5, 9, 14)]
    max_new = 30
    expected = [t for t, _ in hf_greedy(path, prompts, max_new)]
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    block_bytes = 1 * 2 * BLOCK * 2 * 16 * 4  # one layer per group (shared tensors)
    with LLM(str(path), dtype="float32", device="cpu", max_model_len=128, block_size=BLOCK,
             kv_cache_memory_bytes=40 * block_bytes, max_num_batched_tokens=16,
             max_num_seqs=4) as llm:
        core = llm.engine.core
        assert [g.kind for g in core.cache_requirements.groups] == ["full_attention",
                                                                   "sliding_window"]
        first = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                      use_tqdm=False)]
        second = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                       use_tqdm=False)]
        scheduler = core.scheduler
        hits, preemptions = scheduler.prefix_cache_stats.hits, scheduler.num_preemptions
    assert first == second == expected
    assert hits > 0 and preemptions > 0
