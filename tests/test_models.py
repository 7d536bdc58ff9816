"""spindle's model code against transformers on tiny real checkpoints.

Tolerance: float32 on CPU, logits of std ~4. The full-prompt forward is bit-identical
to transformers on these checkpoints (same op order); the paged path (chunked prefill
with a cached prefix, batched decode through block tables: different SDPA kernels and
reduction orders) differs by up to ~2e-5. LOGIT_ATOL = 1e-4 leaves room for other
CPUs/BLAS builds while still catching any real mistake (a wrong mask, rotary offset or
weight shard moves logits by O(1)).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from spindle.attention import Attention, AttentionMetadata
from spindle.attention.backends.registry import get_backend, registered_backends
from spindle.config import EngineArgs, ModelConfig
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.forward_context import forward_context
from spindle.layers.rotary import RotaryEmbedding, compute_inv_freq, rope_parameters_from_config
from spindle.models.loader import load_model
from spindle.models.registry import resolve_model_class, supported_architectures

LOGIT_ATOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """These models are tiny: one intra-op thread is faster, and immune to the stalls
    OpenMP barriers suffer when another process holds a core."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

# (arch, make_tiny_model kwargs): every architecture, a sharded checkpoint, tied and
# untied heads, and a Qwen3 head_dim that is not hidden_size // num_heads.
CHECKPOINTS = [
    ("llama", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("llama", {"num_shards": 2}),
    ("llama", {"tie_word_embeddings": True}),
    ("qwen3", {"tie_word_embeddings": False, "head_dim": 32, "num_shards": 3}),
]
CHECKPOINT_IDS = ["llama", "qwen2", "qwen3", "llama-2shards", "llama-tied", "qwen3-untied-hd32"]


# ----------------------------------------------------------------------------- helpers
def spindle_model(path: Path, tp_group: TensorParallelGroup | None = None) -> torch.nn.Module:
    config = ModelConfig.create(EngineArgs(model=str(path), dtype="float32"), "cpu")
    return load_model(config, torch.device("cpu"), tp_group or TensorParallelGroup.single())


_HF_CACHE: dict[Path, torch.nn.Module] = {}


def hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if path not in _HF_CACHE:
        _HF_CACHE[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF_CACHE[path]


@torch.no_grad()
def hf_logits(path: Path, token_ids: list[int]) -> torch.Tensor:
    return hf_model(path)(torch.tensor([token_ids])).logits[0]


def attention_layers(model: torch.nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def random_prompt(length: int, seed: int, vocab_size: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab_size, (length,), generator=g).tolist()


# ----------------------------------------------------------------------------- (a) forward
@pytest.mark.parametrize("arch,kwargs", CHECKPOINTS, ids=CHECKPOINT_IDS)
def test_full_forward_matches_transformers(tiny_model, arch, kwargs):
    path = tiny_model(arch, **kwargs)
    model = spindle_model(path)
    prompt = random_prompt(97, seed=1)
    with torch.no_grad(), forward_context(None):  # no cache, no metadata: one sequence
        hidden = model(torch.tensor(prompt), torch.arange(len(prompt)))
        logits = model.compute_logits(hidden)
    expected = hf_logits(path, prompt)
    assert logits.shape == expected.shape == (len(prompt), 512)
    torch.testing.assert_close(logits, expected, atol=LOGIT_ATOL, rtol=0)


def test_cacheless_forward_keeps_requests_apart(tiny_model):
    """The memory-profiling pass: several requests in one step, no KV cache."""
    path = tiny_model("qwen2")
    model = spindle_model(path)
    prompts = [random_prompt(n, seed=n) for n in (13, 1, 40)]
    metadata = make_metadata([(p, 0, len(p)) for p in prompts], block_tables=None)
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.no_grad(), forward_context(metadata):
        logits = model.compute_logits(model(ids, positions))
    start = 0
    for p in prompts:
        torch.testing.assert_close(logits[start:start + len(p)], hf_logits(path, p),
                                   atol=LOGIT_ATOL, rtol=0)
        start += len(p)


def test_inputs_embeds_equals_input_ids(tiny_model):
    model = spindle_model(tiny_model("llama"))
    prompt = torch.tensor(random_prompt(20, seed=3))
    with torch.no_grad(), forward_context(None):
        a = model(prompt, torch.arange(20))
        b = model(None, torch.arange(20), inputs_embeds=model.embed_tokens(prompt))
    torch.testing.assert_close(a, b, atol=0, rtol=0)


# ----------------------------------------------------------------------------- (b) paged
@dataclass
class PagedRequest:
    tokens: list[int]
    chunks: list[int]  # prompt chunk sizes, in order
    start_step: int
    num_decode: int
    block_ids: list[int] = field(default_factory=list)
    computed: int = 0
    decoded: int = 0
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> logits

    def next_chunk(self, step: int) -> int:
        """Tokens this request feeds at step: its next prompt chunk, then its last
        sampled token until num_decode tokens were sampled; 0 when idle or done."""
        if step < self.start_step:
            return 0
        if self.chunks:
            return self.chunks[0]
        return 1 if self.decoded < self.num_decode else 0

    def finish_step(self, n: int, logits: torch.Tensor) -> None:
        """Record the logits [n, vocab] of the n tokens just fed; sample greedily once
        the prompt is done."""
        for j in range(n):
            self.logits[self.computed + j] = logits[j]
        self.computed += n
        if self.chunks:
            self.chunks.pop(0)
        if not self.chunks:
            self.tokens.append(int(logits[-1].argmax()))
            self.decoded += 1


def make_metadata(batch: list[tuple[list[int], int, int]], block_tables: torch.Tensor | None,
                  block_size: int = 16, block_ids: list[list[int]] | None = None) -> AttentionMetadata:
    """batch: (tokens, first new position, number of new tokens) per request."""
    query_start, seq_lens, slots = [0], [], []
    for i, (_, start, n) in enumerate(batch):
        query_start.append(query_start[-1] + n)
        seq_lens.append(start + n)
        if block_ids is not None:
            slots += [block_ids[i][p // block_size] * block_size + p % block_size
                      for p in range(start, start + n)]
    query_start_t = torch.tensor(query_start, dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        num_reqs=len(batch), num_tokens=query_start[-1], query_start_loc=query_start_t,
        seq_lens=seq_lens_t,
        block_tables=block_tables if block_tables is not None else torch.zeros(len(batch), 1, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(n for _, _, n in batch), max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_t.clone(), seq_lens_cpu=seq_lens_t.clone())


def run_paged(model: torch.nn.Module, requests: list[PagedRequest], block_size: int,
              seed: int) -> None:
    """Drive requests through chunked prefill and greedy decode on a paged KV cache
    (initialised to NaN, so any read of an unwritten slot poisons the logits),
    recording every computed position's logits on the requests."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = [math.ceil((sum(r.chunks) + r.num_decode) / block_size) for r in requests]
    num_blocks = sum(blocks_per_req) + 7
    free = torch.randperm(num_blocks, generator=g).tolist()
    for r, n in zip(requests, blocks_per_req):
        r.block_ids = [free.pop() for _ in range(n)]
    dtype = next(model.parameters()).dtype
    for layer in attention_layers(model):
        layer.kv_cache = torch.full((2, num_blocks, block_size, layer.num_kv_heads,
                                     layer.head_dim), float("nan"), dtype=dtype)
    max_blocks = max(blocks_per_req) + 2
    step = 0
    while True:
        active = [(r, r.next_chunk(step)) for r in requests]
        active = [(r, n) for r, n in active if n > 0]
        if not active and all(r.start_step <= step for r in requests):
            break
        step += 1
        if not active:
            continue
        # Rows padded with -1: entries past a request's blocks must never be read.
        tables = torch.full((len(active), max_blocks), -1, dtype=torch.int32)
        for i, (r, _) in enumerate(active):
            tables[i, :len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.int32)
        batch = [(r.tokens, r.computed, n) for r, n in active]
        metadata = make_metadata(batch, tables, block_size, [r.block_ids for r, _ in active])
        ids = torch.tensor([t for r, n in active for t in r.tokens[r.computed:r.computed + n]])
        positions = torch.cat([torch.arange(r.computed, r.computed + n) for r, n in active])
        with torch.no_grad(), forward_context(metadata):
            logits = model.compute_logits(model(ids, positions))
        offset = 0
        for r, n in active:
            r.finish_step(n, logits[offset:offset + n])
            offset += n


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("arch,kwargs", CHECKPOINTS[:3] + CHECKPOINTS[5:], ids=["llama", "qwen2", "qwen3", "qwen3-untied-hd32"])
def test_paged_kv_cache_matches_transformers(tiny_model, arch, kwargs, block_size):
    path = tiny_model(arch, **kwargs)
    model = spindle_model(path)
    # Prompts split into chunks, starting at different steps: steps mix prefill chunks
    # with a cached prefix, whole prompts, and decodes; the tail is pure decode.
    plans = [(37, [16, 13, 8], 0), (20, [20], 1), (50, [10, 25, 15], 0), (5, [5], 3), (1, [1], 2)]
    requests = [PagedRequest(tokens=random_prompt(n, seed=10 + i), chunks=list(chunks),
                             start_step=start, num_decode=6)
                for i, (n, chunks, start) in enumerate(plans)]
    run_paged(model, requests, block_size, seed=block_size)
    worst = 0.0
    for r in requests:
        assert r.decoded == r.num_decode
        expected = hf_logits(path, r.tokens[:r.computed])
        got = torch.stack([r.logits[p] for p in range(r.computed)])
        assert torch.isfinite(got).all()
        worst = max(worst, (got - expected).abs().max().item())
    assert worst < LOGIT_ATOL, f"max |logit diff| vs transformers = {worst:.3g}"


def test_decode_batch_larger_than_gather_budget(tiny_model, monkeypatch):
    """Batched decode split into several length-sorted groups gives the same logits."""
    import spindle.attention.backends.torch_sdpa as sdpa

    path = tiny_model("llama")
    model = spindle_model(path)
    monkeypatch.setattr(sdpa, "DECODE_GATHER_TOKEN_BUDGET", 40)
    requests = [PagedRequest(tokens=random_prompt(n, seed=n), chunks=[n], start_step=0,
                             num_decode=3) for n in (3, 30, 17, 8, 25)]
    run_paged(model, requests, block_size=16, seed=0)
    for r in requests:
        expected = hf_logits(path, r.tokens[:r.computed])
        got = torch.stack([r.logits[p] for p in range(r.computed)])
        torch.testing.assert_close(got, expected, atol=LOGIT_ATOL, rtol=0)


# ----------------------------------------------------------------------------- (c) loader errors
def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_loader_rejects_non_safetensors_checkpoint(tiny_model, tmp_path):
    path = copy_checkpoint(tiny_model("llama"), tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    torch.save({}, path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="only safetensors checkpoints are supported"):
        spindle_model(path)


def test_loader_names_corrupt_shard(tiny_model, tmp_path):
    path = copy_checkpoint(tiny_model("llama", num_shards=2), tmp_path / "ckpt")
    shard = path / "model-00002-of-00002.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        spindle_model(path)


def test_loader_lists_missing_parameters(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_checkpoint(tiny_model("qwen2"), tmp_path / "ckpt")
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    del state["model.layers.0.self_attn.k_proj.bias"]  # one shard of a merged parameter
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as info:
        spindle_model(path)
    message = str(info.value)
    assert "model.layers.1.mlp.down_proj.weight" in message
    assert "model.layers.0.self_attn.qkv_proj.bias" in message


def test_loader_rejects_unexpected_tensor(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_checkpoint(tiny_model("llama"), tmp_path / "ckpt")
    state = load_file(path / "model.safetensors")
    state["model.layers.0.mystery.weight"] = torch.zeros(3)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.0.mystery.weight"):
        spindle_model(path)


def test_unsupported_architecture_lists_supported(tiny_model, tmp_path):
    path = copy_checkpoint(tiny_model("llama"), tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:
        spindle_model(path)
    assert "FooForCausalLM" in str(info.value)
    for arch in supported_architectures():
        assert arch in str(info.value)
    assert resolve_model_class(["Foo", "Qwen3ForCausalLM"]).__name__ == "Qwen3ForCausalLM"


# ----------------------------------------------------------------------------- units
def test_backend_registry():
    assert "torch_sdpa" in registered_backends()
    assert get_backend(None) is get_backend("torch_sdpa")
    with pytest.raises(ValueError, match="torch_sdpa"):
        get_backend("nope")


def test_rope_parameters_old_and_new_config_styles():
    new = types.SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                                max_position_embeddings=64)
    old = types.SimpleNamespace(rope_theta=500.0, rope_scaling=None, max_position_embeddings=64)
    older = types.SimpleNamespace(rope_theta=500.0, max_position_embeddings=64,
                                  rope_scaling={"type": "llama3", "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 16})
    assert rope_parameters_from_config(new) == rope_parameters_from_config(old)
    assert rope_parameters_from_config(older)["rope_type"] == "llama3"
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'"):
        RotaryEmbedding(16, 64, {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="longrope needs short_factor"):
        RotaryEmbedding(16, 64, {"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0})


def test_llama3_rope_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=256,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                          "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 64})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, None)
    got = compute_inv_freq(32, rope_parameters_from_config(config))
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.parametrize("rope_parameters", [
    {"factor": 4.0, "original_max_position_embeddings": 512},  # (Qwen3's long context)
    {"factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2,
     "truncate": False},
    {"factor": 40.0, "original_max_position_embeddings": 128, "mscale": 1.0,
     "mscale_all_dim": 0.707},
    {"factor": 8.0, "original_max_position_embeddings": 256, "attention_factor": 1.2079},
    {"factor": None, "original_max_position_embeddings": 512},  # (from the two lengths)
])
def test_yarn_rope_matches_transformers(rope_parameters):
    """The frequencies and the attention factor on the cos/sin table, exactly."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from spindle.layers.rotary import attention_scaling

    config = Qwen3Config(hidden_size=64, num_attention_heads=2, head_dim=32,
                         max_position_embeddings=2048,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                          **rope_parameters})
    expected, scaling = ROPE_INIT_FUNCTIONS["yarn"](config, None)
    params = rope_parameters_from_config(config)
    torch.testing.assert_close(compute_inv_freq(32, params), expected, atol=0, rtol=0)
    assert attention_scaling(params) == scaling
    table = RotaryEmbedding(32, 2048, params)
    positions = torch.arange(2048, dtype=torch.float32)[:, None] * expected[None, :]
    torch.testing.assert_close(table.cos_cache[:, :16], positions.cos() * scaling,
                               atol=0, rtol=0)


def test_a_yarn_model_equals_transformers_past_its_original_context(tiny_model):
    """Qwen3 with YaRN (factor 4 over an original context of 32 positions): greedy
    tokens and log-probs stay transformers' on prompts up to 70 tokens."""
    from checkpoint_utils import spindle_greedy
    from test_generate_vs_hf import LOGPROB_TOL, hf_greedy

    path = tiny_model("qwen3", rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 32})
    prompts = [[5, 6, 7], list(range(10, 80)), list(range(100, 140))]
    expected, got = hf_greedy(path, prompts, 8), spindle_greedy(path, prompts)
    for (tokens, lps), (our_tokens, our_lps) in zip(expected, got):
        assert our_tokens == tokens
        assert max(abs(a - b) for a, b in zip(lps, our_lps)) < LOGPROB_TOL


def _longrope(head_dim: int, original: int, **extra) -> dict:
    half = head_dim // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [1.0 + 0.9 * i for i in range(half)],
            "original_max_position_embeddings": original, **extra}


@pytest.mark.parametrize("extra", [{}, {"attention_factor": 1.3}, {"factor": 2.0}])
def test_longrope_tables_are_transformers_short_and_long_ones(extra):
    """Phi-3.5's LongRoPE: rows [0, 512) are transformers' short table, rows [512, 1024)
    its long one (what a sequence past the original length reads), both times its
    attention factor, exactly."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from spindle.layers.rotary import attention_scaling, long_rope_rows

    config = Phi3Config(hidden_size=64, num_attention_heads=2, max_position_embeddings=512,
                        original_max_position_embeddings=64,
                        rope_parameters=_longrope(32, 64, **extra))
    short, scaling = ROPE_INIT_FUNCTIONS["longrope"](config, None)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=65)
    params = rope_parameters_from_config(config)
    assert attention_scaling(params, 512) == scaling != 1.0
    table = RotaryEmbedding(32, 512, params)
    assert table.long_rows == 512 and table.cos_cache.shape == (1024, 32)
    angles = torch.arange(512, dtype=torch.float32)[:, None]
    for rows, inv_freq in ((slice(0, 512), short), (slice(512, 1024), long)):
        torch.testing.assert_close(table.cos_cache[rows, :16], (angles * inv_freq).cos() * scaling,
                                   atol=0, rtol=0)
        torch.testing.assert_close(table.sin_cache[rows, 16:], (angles * inv_freq).sin() * scaling,
                                   atol=0, rtol=0)
    assert long_rope_rows(torch.nn.ModuleList([table]), 64) == 512
    with pytest.raises(ValueError, match="serve it with max_model_len <= 64"):
        long_rope_rows(torch.nn.ModuleList([RotaryEmbedding(32, 512, {"rope_theta": 1e4})]), 64)
    with pytest.raises(ValueError, match="long_factor must hold head_dim / 2 = 16 values"):
        RotaryEmbedding(32, 512, {**params, "long_factor": [1.0] * 8})
    # A config whose rope parameters leave the original length beside them (Phi-3's).
    bare = dict(config.rope_parameters)
    del bare["original_max_position_embeddings"]
    beside = types.SimpleNamespace(rope_parameters=bare, max_position_embeddings=512,
                                   original_max_position_embeddings=64)
    assert rope_parameters_from_config(beside)["original_max_position_embeddings"] == 64


# Prompts of a Phi-3 with LongRoPE, original length 48: within it all along, crossing it
# while decoding (at the first token for 47 and 48), and past it from the start.
_LONGROPE_PROMPTS = [[5, 6, 7], list(range(10, 50)), list(range(100, 147)),
                     list(range(100, 148)), list(range(200, 260))]
_LONGROPE_NEW = 30


@pytest.fixture(scope="module")
def longrope_phi3(tiny_model):
    """A tiny Phi-3 with LongRoPE (original length 48) and transformers' greedy answers
    to _LONGROPE_PROMPTS, computed once."""
    from test_generate_vs_hf import hf_greedy

    path = tiny_model("phi3", rope_parameters=_longrope(16, 48),
                      original_max_position_embeddings=48)
    return path, hf_greedy(path, _LONGROPE_PROMPTS, _LONGROPE_NEW)


def _assert_greedy_matches(outputs, expected) -> None:
    from test_generate_vs_hf import LOGPROB_TOL

    for output, (tokens, lps) in zip(outputs, expected):
        ours = output.outputs[0]
        assert list(ours.token_ids) == tokens, len(output.prompt_token_ids)
        assert max(abs(lp[t].logprob - b) for lp, t, b in zip(ours.logprobs, ours.token_ids,
                                                              lps)) < LOGPROB_TOL


# (Block bytes of the tiny Phi-3: 2 layers x K and V x 16 tokens x 4 x 8 features x 4.)
_PHI3_BLOCK_BYTES = 2 * 2 * 16 * 4 * 8 * 4


@pytest.mark.parametrize("engine_kwargs", [
    {}, {"max_num_batched_tokens": 16}, {"async_scheduling": False},
    {"max_model_len": 128, "kv_cache_memory_bytes": 9 * _PHI3_BLOCK_BYTES},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_min": 1, "prompt_lookup_max": 2}},
    {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
    ids=["default", "chunked", "sync", "preempted", "ngram", "tp2", "pp2"])
def test_a_longrope_model_equals_transformers_past_its_original_length(longrope_phi3,
                                                                        engine_kwargs):
    """Phi-3 with LongRoPE past its original length (48): transformers encodes a sequence
    up to 48 tokens with the short factors, a longer one with the long factors, every
    position of it, and re-encodes a sequence once as it grows past 48. The engine does
    the same (the request goes back to the queue and computes all its tokens again):
    greedy tokens and log-probs are transformers', under chunked prefill, without async
    scheduling, with preemptions (9 blocks for 5 requests), with n-gram drafts (cut at
    the original length), on two tensor-parallel ranks and in two pipeline stages."""
    from spindle import LLM, SamplingParams

    path, expected = longrope_phi3
    params = SamplingParams(temperature=0.0, max_tokens=_LONGROPE_NEW, ignore_eos=True,
                            logprobs=0)
    with LLM(str(path), dtype="float32", device="cpu", **engine_kwargs) as llm:
        assert llm.config.model.long_rope_from == 48
        outputs = llm.generate(_LONGROPE_PROMPTS, params, use_tqdm=False)
        if "kv_cache_memory_bytes" in engine_kwargs:
            assert llm.engine.core.scheduler.num_preemptions > 0
    _assert_greedy_matches(outputs, expected)


def test_longrope_prefix_cache_keeps_short_and_long_blocks_apart(longrope_phi3):
    """The same tokens are other keys and values under the long factors: a request past
    the original length never hits blocks a short one computed, nor the other way; hits
    within either kind still come (and equal transformers)."""
    from spindle import LLM, SamplingParams
    from test_generate_vs_hf import hf_greedy

    path, _ = longrope_phi3
    shared = list(range(300, 332))  # two blocks
    prompts = [shared, shared + list(range(400, 420)),  # 32 crossing 48; 52: long
               shared + list(range(450, 454)), shared + list(range(460, 480))]  # 36; 52
    expected = hf_greedy(path, prompts, 24)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    hits = []
    with LLM(str(path), dtype="float32", device="cpu", enable_prefix_caching=True) as llm:
        stats = llm.engine.core.scheduler.kv_cache_manager.prefix_cache_stats
        for prompt, reference in zip(prompts, expected):
            before = stats.hits
            _assert_greedy_matches(llm.generate([prompt], params, use_tqdm=False), [reference])
            hits.append(stats.hits - before)
    # The first request's re-encoding hits nothing long yet; the second (long) the first
    # one's long blocks of the shared prefix; the third the short ones when admitted
    # and the long ones when it re-encodes; the fourth the long ones.
    assert hits == [0, 32, 64, 32]


# ----------------------------------------------------------------------------- tensor parallel
def test_tensor_parallel_weight_shards():
    """Each rank's shard, per layer type, for tp=4 with 8 query heads and 2 KV heads
    (each KV head replicated on two consecutive ranks) and a vocabulary of 10 (padded
    to 12)."""
    from spindle.layers.embedding import ParallelLMHead
    from spindle.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    tp, hd, hidden = 4, 3, 5
    q_full, k_full, v_full = torch.randn(8 * hd, hidden), torch.randn(2 * hd, hidden), torch.randn(2 * hd, hidden)
    gate, up, down = torch.randn(8, hidden), torch.randn(8, hidden), torch.randn(hidden, 8)
    vocab = torch.randn(10, hidden)
    for rank in range(tp):
        group = TensorParallelGroup(rank=rank, size=tp)
        qkv = QKVParallelLinear(hidden, hd, 8, 2, bias=False, tp_group=group)
        for shard_id, full in (("q", q_full), ("k", k_full), ("v", v_full)):
            qkv.weight.weight_loader(qkv.weight, full, shard_id)
        kv_head = rank // 2
        expected = torch.cat([q_full[rank * 2 * hd:(rank + 1) * 2 * hd],
                              k_full[kv_head * hd:(kv_head + 1) * hd],
                              v_full[kv_head * hd:(kv_head + 1) * hd]])
        torch.testing.assert_close(qkv.weight.data, expected, atol=0, rtol=0)

        gate_up = MergedColumnParallelLinear(hidden, [8, 8], tp_group=group)
        gate_up.weight.weight_loader(gate_up.weight, gate, 0)
        gate_up.weight.weight_loader(gate_up.weight, up, 1)
        torch.testing.assert_close(gate_up.weight.data, torch.cat([gate[2 * rank:2 * rank + 2],
                                                                    up[2 * rank:2 * rank + 2]]))
        row = RowParallelLinear(8, hidden, tp_group=group)
        row.weight.weight_loader(row.weight, down)
        torch.testing.assert_close(row.weight.data, down[:, 2 * rank:2 * rank + 2])

        head = ParallelLMHead(10, hidden, tp_group=group)
        head.weight.weight_loader(head.weight, vocab)
        padded = torch.cat([vocab, torch.zeros(2, hidden)])
        torch.testing.assert_close(head.weight.data, padded[3 * rank:3 * rank + 3])


def _tp_worker(rank: int, world_size: int, store_file: str, path: str, prompt: list[int],
               out_file: str) -> None:
    import torch.distributed as dist

    # A file store has no server thread on rank 0 that could vanish while a peer
    # is still tearing down (seen as SIGABRT at exit with a TCP store).
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=world_size)
    try:
        torch.set_num_threads(1)
        group = TensorParallelGroup(rank=rank, size=world_size, group=dist.group.WORLD)
        # The raw config.json as the HF config: the model code needs only attributes,
        # and the workers start faster without importing transformers.
        hf_config = types.SimpleNamespace(**json.loads((Path(path) / "config.json").read_text()))
        config = ModelConfig(model=path, tokenizer=path, dtype=torch.float32,
                             max_model_len=hf_config.max_position_embeddings, seed=0,
                             hf_config=hf_config)
        model = load_model(config, torch.device("cpu"), group)
        with torch.no_grad(), forward_context(None):
            logits = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt))))
        if rank == 0:
            torch.save(logits, out_file)
        dist.barrier()  # no rank tears gloo down while a peer is still inside it
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown, as the mp executor's workers do: gloo's destructors
    # can abort the process (SIGABRT) when a peer has already gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_tensor_parallel_matches_transformers(tiny_model, tmp_path):
    """Two gloo ranks: one KV head replicated on both, a vocabulary (509) that needs
    padding, q/k/v biases, and a tied head."""
    import torch.multiprocessing as mp

    path = tiny_model("qwen2", num_kv_heads=1, vocab_size=509, tie_word_embeddings=True)
    prompt = random_prompt(33, seed=5, vocab_size=509)
    out_file = tmp_path / "logits.pt"
    mp.spawn(_tp_worker, args=(2, str(tmp_path / "store"), str(path), prompt, str(out_file)),
             nprocs=2)
    logits = torch.load(out_file)
    assert logits.shape == (33, 509)
    torch.testing.assert_close(logits, hf_logits(path, prompt), atol=LOGIT_ATOL, rtol=0)
