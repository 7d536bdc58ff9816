"""spindle's BambaForCausalLM against transformers' on tiny random Bamba checkpoints,
without the engine: the test allocates the attention KV caches and the mamba state
slots itself, puts an AttentionMetadata (cache group 0) and a MambaMetadata (group 1)
in the forward context, and drives prefill, chunked prefill and decode steps.

Every computed position's logits are compared with transformers' full forward over the
same tokens (float32; logits of std ~4). The chunked SSD scan and the step-by-step
decode sum in other orders than transformers' scan, so the paths differ by ~2e-5;
LOGIT_ATOL = 1e-4 as in test_models.py (a wrong state hand-off, group, gate or rotary
moves logits by O(1)). Unused state slots and KV blocks hold NaN, so a read of
anything a request does not own poisons its logits.
"""

from __future__ import annotations

import json
import math
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from spindle.attention import Attention, AttentionMetadata
from spindle.config import EngineArgs, ModelConfig
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import IntermediateTensors, PipelineStage
from spindle.forward_context import forward_context
from spindle.layers.mamba.metadata import MambaMetadata
from spindle.layers.mamba.mixer import MambaMixer
from spindle.models.loader import load_model

LOGIT_ATOL = 1e-4
ATTENTION_GROUP, MAMBA_GROUP = 0, 1

# Shapes (make_tiny_model keywords): the default tiny Bamba; n_groups 2 with chunks
# shorter than the prompts; odd head and group counts (3), a conv of width 3, biases on
# in/out projections and attention, no conv bias, a tied head, two attention layers and
# a time_step_limit that clamps (transformers' full forward clamps; its generate()'s
# single-step update does not, so only this shape stays off the generate() check).
SHAPES = {
    "default": {},
    "g2-chunk8": dict(num_layers=3, mamba_n_groups=2, mamba_chunk_size=8),
    "h3g3-odd": dict(hidden_size=48, num_layers=4, attn_layer_indices=(0, 3), mamba_n_heads=3,
                     mamba_n_groups=3, mamba_d_state=8, mamba_chunk_size=4, mamba_d_conv=3,
                     mamba_conv_bias=False, mamba_proj_bias=True, attention_bias=True,
                     tie_word_embeddings=True, time_step_limit=(0.002, 0.05)),
}


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ----------------------------------------------------------------------------- helpers
def spindle_model(path: Path) -> torch.nn.Module:
    config = ModelConfig.create(EngineArgs(model=str(path), dtype="float32"), "cpu")
    return load_model(config, torch.device("cpu"), TensorParallelGroup.single())


_HF_CACHE: dict[Path, torch.nn.Module] = {}


def hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if path not in _HF_CACHE:
        _HF_CACHE[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF_CACHE[path]


@torch.no_grad()
def hf_logits(path: Path, token_ids: list[int]) -> torch.Tensor:
    return hf_model(path)(torch.tensor([token_ids])).logits[0]


def random_prompt(length: int, seed: int, vocab_size: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab_size, (length,), generator=g).tolist()


@dataclass
class Request:
    tokens: list[int]
    chunks: list[int]  # prompt chunk sizes, in order
    start_step: int = 0
    num_decode: int = 0
    slot: int = -1
    block_ids: list[int] = field(default_factory=list)
    computed: int = 0
    decoded: int = 0
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> logits

    def next_chunk(self, step: int) -> int:
        if step < self.start_step:
            return 0
        if self.chunks:
            return self.chunks[0]
        return 1 if self.decoded < self.num_decode else 0

    def finish_step(self, n: int, logits: torch.Tensor) -> None:
        for j in range(n):
            self.logits[self.computed + j] = logits[j]
        self.computed += n
        if self.chunks:
            self.chunks.pop(0)
        if not self.chunks:
            self.tokens.append(int(logits[-1].argmax()))
            self.decoded += 1

    def all_logits(self) -> torch.Tensor:
        return torch.stack([self.logits[p] for p in range(self.computed)])


def assign_cache_groups(model: torch.nn.Module) -> tuple[list[Attention], list[MambaMixer]]:
    attention = [m for m in model.modules() if isinstance(m, Attention)]
    mixers = [m for m in model.modules() if isinstance(m, MambaMixer)]
    for layer in attention:
        layer.cache_group = ATTENTION_GROUP
    for layer in mixers:
        layer.cache_group = MAMBA_GROUP
    return attention, mixers


def allocate_caches(model: torch.nn.Module, requests: list[Request], block_size: int,
                    seed: int) -> None:
    """NaN-filled KV blocks and state slots, a shuffled set of them per request."""
    g = torch.Generator().manual_seed(seed)
    attention, mixers = assign_cache_groups(model)
    blocks_per_req = [math.ceil((sum(r.chunks) + r.num_decode) / block_size) for r in requests]
    num_blocks = sum(blocks_per_req) + 5
    free_blocks = torch.randperm(num_blocks, generator=g).tolist()
    num_slots = len(requests) + 3
    free_slots = torch.randperm(num_slots, generator=g).tolist()
    for r, n in zip(requests, blocks_per_req):
        r.block_ids = [free_blocks.pop() for _ in range(n)]
        r.slot = free_slots.pop()
    dtype = next(model.parameters()).dtype
    for layer in attention:
        layer.kv_cache = torch.full((2, num_blocks, block_size, layer.num_kv_heads,
                                     layer.head_dim), float("nan"), dtype=dtype)
    for layer in mixers:
        spec = layer.cache_spec(dtype)
        layer.kv_cache = [torch.full((num_slots, *shape), float("nan"), dtype=d)
                          for shape, d in zip(spec.shapes, spec.dtypes)]


def step_metadata(active: list[tuple[Request, int]], block_size: int | None
                  ) -> list[AttentionMetadata | MambaMetadata]:
    """Both groups' metadata for one step; block_size None: no caches (profiling)."""
    query_start, seq_lens, slots = [0], [], []
    for r, n in active:
        query_start.append(query_start[-1] + n)
        seq_lens.append(r.computed + n)
        if block_size is not None:
            slots += [r.block_ids[p // block_size] * block_size + p % block_size
                      for p in range(r.computed, r.computed + n)]
    qsl = torch.tensor(query_start, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    max_blocks = max((len(r.block_ids) for r, _ in active), default=1) + 1
    tables = torch.full((len(active), max_blocks), -1, dtype=torch.int32)
    for i, (r, _) in enumerate(active):
        tables[i, :len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.int32)
    max_query = max(n for _, n in active)
    attn = AttentionMetadata(
        num_reqs=len(active), num_tokens=query_start[-1], query_start_loc=qsl, seq_lens=lens,
        block_tables=tables, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max_query, max_seq_len=max(seq_lens), query_start_loc_cpu=qsl.clone(),
        seq_lens_cpu=lens.clone())
    state_indices = torch.tensor([r.slot for r, _ in active], dtype=torch.int32)
    has_initial = torch.tensor([r.computed > 0 for r, _ in active])
    mamba = MambaMetadata(
        num_reqs=len(active), num_tokens=query_start[-1], query_start_loc=qsl.clone(),
        state_indices=state_indices, has_initial_state=has_initial, max_query_len=max_query,
        query_start_loc_cpu=qsl.clone(), has_initial_state_cpu=has_initial.clone(),
        state_indices_cpu=state_indices.clone())
    return [attn, mamba]


@torch.no_grad()
def run_steps(model: torch.nn.Module, requests: list[Request], block_size: int = 16,
              seed: int = 0) -> int:
    """Drive the requests through their prompt chunks and greedy decodes, recording
    every position's logits; returns the number of pure-decode steps run."""
    allocate_caches(model, requests, block_size, seed)
    step = decode_steps = 0
    while True:
        active = [(r, r.next_chunk(step)) for r in requests]
        active = [(r, n) for r, n in active if n > 0]
        if not active and all(r.start_step <= step for r in requests):
            return decode_steps
        step += 1
        if not active:
            continue
        decode_steps += all(n == 1 for _, n in active)
        ids = torch.tensor([t for r, n in active for t in r.tokens[r.computed:r.computed + n]])
        positions = torch.cat([torch.arange(r.computed, r.computed + n) for r, n in active])
        with forward_context(step_metadata(active, block_size)):
            logits = model.compute_logits(model(ids, positions))
        offset = 0
        for r, n in active:
            r.finish_step(n, logits[offset:offset + n])
            offset += n


def worst_diff(path: Path, requests: list[Request]) -> float:
    worst = 0.0
    for r in requests:
        got = r.all_logits()
        assert torch.isfinite(got).all()
        worst = max(worst, (got - hf_logits(path, r.tokens[:r.computed])).abs().max().item())
    return worst


# ----------------------------------------------------------------------------- (a) packed prefill + decode
def test_packed_prefill_then_decode_matches_transformers(tiny_model):
    """Two prompts of different lengths prefilled in one step, then decoded together;
    the greedy tokens are also transformers' generate()'s."""
    path = tiny_model("bamba", **SHAPES["g2-chunk8"])
    model = spindle_model(path)
    prompts = [random_prompt(23, seed=1), random_prompt(9, seed=2)]
    requests = [Request(tokens=list(p), chunks=[len(p)], num_decode=8) for p in prompts]
    decode_steps = run_steps(model, requests)
    assert decode_steps == 7
    worst = worst_diff(path, requests)
    assert worst < LOGIT_ATOL, f"max |logit diff| vs transformers = {worst:.3g}"
    for prompt, r in zip(prompts, requests):
        generated = hf_model(path).generate(torch.tensor([prompt]), max_new_tokens=8,
                                            do_sample=False)
        assert generated[0].tolist() == r.tokens


# ----------------------------------------------------------------------------- (b) shapes, chunked prefill
@pytest.mark.parametrize("shape", list(SHAPES))
def test_chunked_prefill_and_decode_match_transformers(tiny_model, shape):
    """Steps mixing prompt chunks (the states carried from one chunk to the next),
    whole prompts, a one-token prompt joining a decode batch, and pure decodes."""
    path = tiny_model("bamba", **SHAPES[shape])
    model = spindle_model(path)
    # The last two join at a step where every other request decodes: a pure-decode
    # batch with a request at its first token (its slot holds NaN, it must start from
    # zeros), and one fed its prompt a token at a time.
    plans = [(37, [16, 13, 8], 0), (20, [20], 1), (5, [3, 2], 3), (1, [1], 2), (11, [11], 0),
             (1, [1], 6), (3, [1, 1, 1], 6)]
    requests = [Request(tokens=random_prompt(n, seed=10 + i), chunks=list(chunks),
                        start_step=start, num_decode=5)
                for i, (n, chunks, start) in enumerate(plans)]
    assert run_steps(model, requests, block_size=8, seed=3) > 0
    worst = worst_diff(path, requests)
    assert worst < LOGIT_ATOL, f"max |logit diff| vs transformers = {worst:.3g}"


def test_profiling_forward_keeps_requests_apart(tiny_model):
    """No caches (the memory-profiling pass): packed requests start from zero states."""
    path = tiny_model("bamba", **SHAPES["g2-chunk8"])
    model = spindle_model(path)
    assign_cache_groups(model)
    prompts = [random_prompt(n, seed=n) for n in (13, 1, 30)]
    active = [(Request(tokens=p, chunks=[len(p)]), len(p)) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.no_grad(), forward_context(step_metadata(active, block_size=None)):
        logits = model.compute_logits(model(ids, positions))
    start = 0
    for p in prompts:
        torch.testing.assert_close(logits[start:start + len(p)], hf_logits(path, p),
                                   atol=LOGIT_ATOL, rtol=0)
        start += len(p)


def test_forward_without_metadata_is_one_sequence(tiny_model):
    path = tiny_model("bamba")
    model = spindle_model(path)
    prompt = random_prompt(45, seed=4)
    with torch.no_grad(), forward_context(None):
        logits = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt))))
        embeds = model(None, torch.arange(len(prompt)),
                       inputs_embeds=model.embed_tokens(torch.tensor(prompt)))
    torch.testing.assert_close(logits, hf_logits(path, prompt), atol=LOGIT_ATOL, rtol=0)
    torch.testing.assert_close(model.compute_logits(embeds), logits, atol=0, rtol=0)


def test_pipeline_stages_chain_to_the_full_model(tiny_model):
    path = tiny_model("bamba", **SHAPES["h3g3-odd"])
    config = ModelConfig.create(EngineArgs(model=str(path), dtype="float32"), "cpu")
    single = TensorParallelGroup.single()
    first = load_model(config, torch.device("cpu"), single,
                       PipelineStage(rank=0, size=2, start_layer=0, end_layer=2))
    last = load_model(config, torch.device("cpu"), single,
                      PipelineStage(rank=1, size=2, start_layer=2, end_layer=4))
    prompt = random_prompt(19, seed=5)
    positions = torch.arange(len(prompt))
    with torch.no_grad(), forward_context(None):
        handoff = first(torch.tensor(prompt), positions)
        assert isinstance(handoff, IntermediateTensors)
        logits = last.compute_logits(last(None, positions, intermediate_tensors=handoff))
    torch.testing.assert_close(logits, hf_logits(path, prompt), atol=LOGIT_ATOL, rtol=0)


# ----------------------------------------------------------------------------- config checks
def test_cache_specs_of_the_layers(tiny_model):
    model = spindle_model(tiny_model("bamba", **SHAPES["h3g3-odd"]))
    attention, mixers = assign_cache_groups(model)
    assert len(attention) == 2 and len(mixers) == 2
    spec = mixers[0].cache_spec(torch.bfloat16)
    # conv channels: x (3 heads * 32) + B + C (3 groups * 8 each); kernel 3 keeps 2 inputs
    assert spec.shapes == ((96 + 2 * 24, 2), (3, 32, 8))
    assert spec.dtypes == (torch.bfloat16, torch.bfloat16)


def test_unsupported_configs_are_refused(tiny_model, tmp_path):
    import shutil

    path = Path(shutil.copytree(tiny_model("bamba"), tmp_path / "ckpt"))
    original = json.loads((path / "config.json").read_text())
    for change, message in [({"hidden_act": "gelu"}, "hidden_act"),
                            ({"attn_layer_indices": [7]}, "attn_layer_indices"),
                            ({"mamba_d_conv": 1}, "mamba_d_conv")]:
        (path / "config.json").write_text(json.dumps({**original, **change}))
        with pytest.raises(ValueError, match=message):
            spindle_model(path)


def test_tensor_parallel_group_layouts():
    """Which rows of in_proj each rank loads: groups split (4 groups on 2 ranks), one
    group replicated (1 on 2), each group on two ranks (2 on 4); and a combination
    that cannot be laid out (3 groups on 2 ranks)."""
    hidden, heads, head_dim, state = 6, 8, 2, 3
    kwargs = dict(hidden_size=hidden, num_heads=heads, head_dim=head_dim, state_size=state,
                  conv_kernel=4, chunk_size=4, eps=1e-6, time_step_limit=(0.0, math.inf),
                  conv_bias=True, proj_bias=False)
    inter = heads * head_dim
    for groups, tp in [(4, 2), (1, 2), (2, 4)]:
        gw = groups * state
        full = torch.arange(2 * inter + 2 * gw + heads, dtype=torch.float32)[:, None].repeat(1, hidden)
        gate, x, B, C, dt = full.split([inter, inter, gw, gw, heads])
        for rank in range(tp):
            mixer = MambaMixer(n_groups=groups, tp_group=TensorParallelGroup(rank=rank, size=tp),
                               **kwargs)
            mixer.in_proj.weight.weight_loader(mixer.in_proj.weight, full)
            mine = slice(rank * inter // tp, (rank + 1) * inter // tp)
            first_group = rank * groups // tp if groups >= tp else rank // (tp // groups)
            local_groups = max(groups // tp, 1)
            g = slice(first_group * state, (first_group + local_groups) * state)
            expected = torch.cat([gate[mine], x[mine], B[g], C[g],
                                  dt[rank * heads // tp:(rank + 1) * heads // tp]])
            torch.testing.assert_close(mixer.in_proj.weight.data, expected, atol=0, rtol=0)
            # head h reads group h // (heads // groups): this rank's heads, its groups
            assert mixer.num_heads // mixer.n_groups == min(heads // groups, heads // tp)
    with pytest.raises(ValueError, match="mamba_n_groups \\(3\\)"):
        MambaMixer(n_groups=3, tp_group=TensorParallelGroup(rank=0, size=2),
                   **{**kwargs, "num_heads": 6})


# ----------------------------------------------------------------------------- (c) tensor parallel
TP_SHAPES = ["g2-chunk8", "default"]  # groups split across the two ranks; one group replicated
TP_PLANS = [(30, [17, 13], 0), (9, [9], 0), (1, [1], 1)]


def tp_requests(vocab_size: int = 512) -> list[Request]:
    return [Request(tokens=random_prompt(n, seed=20 + i, vocab_size=vocab_size),
                    chunks=list(chunks), start_step=start, num_decode=4)
            for i, (n, chunks, start) in enumerate(TP_PLANS)]


def _tp_worker(rank: int, world_size: int, store_file: str, paths: list[str],
               out_file: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=world_size)
    try:
        torch.set_num_threads(1)
        group = TensorParallelGroup(rank=rank, size=world_size, group=dist.group.WORLD)
        results = []
        for path in paths:
            # The raw config.json as the HF config (what a worker without transformers'
            # config classes would see: infinity as {"__float__": "Infinity"}).
            hf_config = types.SimpleNamespace(**json.loads((Path(path) / "config.json").read_text()))
            config = ModelConfig(model=path, tokenizer=path, dtype=torch.float32,
                                 max_model_len=hf_config.max_position_embeddings, seed=0,
                                 hf_config=hf_config)
            model = load_model(config, torch.device("cpu"), group)
            requests = tp_requests()
            run_steps(model, requests, block_size=8, seed=1)
            results.append([(r.tokens, r.all_logits()) for r in requests])
        if rank == 0:
            torch.save(results, out_file)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_tensor_parallel_two_ranks_equal_one(tiny_model, tmp_path):
    import torch.multiprocessing as mp

    paths = [tiny_model("bamba", **SHAPES[s]) for s in TP_SHAPES]
    out_file = tmp_path / "tp.pt"
    mp.spawn(_tp_worker, args=(2, str(tmp_path / "store"), [str(p) for p in paths],
                               str(out_file)), nprocs=2)
    results = torch.load(out_file)
    for path, tp_result in zip(paths, results):
        requests = tp_requests()
        run_steps(spindle_model(path), requests, block_size=8, seed=1)
        for r, (tokens, logits) in zip(requests, tp_result):
            assert tokens == r.tokens
            torch.testing.assert_close(logits, r.all_logits(), atol=LOGIT_ATOL, rtol=0)
            torch.testing.assert_close(logits, hf_logits(path, tokens[:-1]),
                                       atol=LOGIT_ATOL, rtol=0)
