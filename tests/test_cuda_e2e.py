"""End to end on CUDA: Triton attention + CUDA graphs against transformers."""

from __future__ import annotations

import random

import pytest
import torch

from spindle import LLM, SamplingParams

pytestmark = pytest.mark.gpu

# bf16: spindle and transformers round differently (fused vs unfused ops, paged vs
# dense attention); the logprob of the same token under teacher forcing stays close.
BF16_LOGPROB_TOL = 0.25


def _prompts(vocab: int, lengths=(1, 5, 17, 64, 129, 300, 700, 33)) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _hf_greedy(path, prompts, max_new, dtype, device, **load_kwargs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                 **load_kwargs).to(device).eval()
    config = model.generation_config
    config.eos_token_id, config.pad_token_id = None, 0
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                 do_sample=False, generation_config=config, output_logits=True,
                                 return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]
        results.append((tokens, lps))
    return results


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_float32_greedy_matches_transformers(tiny_model, arch, enforce_eager):
    path = tiny_model(arch=arch, max_position_embeddings=2048)
    prompts = _prompts(512)
    expected = _hf_greedy(path, prompts, 24, torch.float32, "cuda")
    llm = LLM(str(path), dtype="float32", device="cuda", max_model_len=1024,
              enforce_eager=enforce_eager, max_num_batched_tokens=256)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                    logprobs=0), use_tqdm=False)
        graphs = llm.engine.core.executor.worker.runner.graph_runner
    finally:
        llm.shutdown()
    assert (graphs is None) == enforce_eager
    for out, (tokens, lps) in zip(outs, expected):
        assert out.outputs[0].token_ids == tokens
        got = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-4


@pytest.mark.parametrize("graph_feed,advance,to_host", [
    ("1", "1", "1"), ("1", "1", "0"), ("1", "0", "0"), ("0", "0", "0")])
def test_greedy_tokens_from_the_graphs_argmax(tiny_model, monkeypatch, graph_feed, advance,
                                              to_host):
    """Greedy requests that want nothing but their tokens (no logprobs) take them from
    the decode graphs' argmax (runner/cuda_graph.py; the Triton argmax of
    runner/sample/argmax_kernel.py): float32 tokens equal transformers', for eight
    requests together, one at a time and two of different lengths (the batch changes
    when the shorter ends), and the sampler returned the graphs' argmax on every decode
    step of the lone requests. With SPINDLE_GRAPH_FEED the graphs leave that argmax in
    their input ids, and a lone request's decode steps after its first take it from
    there; a sampled request's never do (its tokens are not the argmax). With
    SPINDLE_GRAPH_ADVANCE those steps stage nothing either, but where a request enters
    a new block (16 tokens a block: once or twice in 23 steps); with
    SPINDLE_GRAPH_TOKENS_TO_HOST too, every graph step of a lone request leaves its token
    in the host ring, where the host reads it."""
    from spindle.runner.sample import Sampler

    taken = []
    forward = Sampler.forward

    def recording(self, logits, metadata, argmax=None):
        taken.append(argmax is not None)
        return forward(self, logits, metadata, argmax)

    monkeypatch.setattr(Sampler, "forward", recording)
    monkeypatch.setenv("SPINDLE_GRAPH_FEED", graph_feed)
    monkeypatch.setenv("SPINDLE_GRAPH_ADVANCE", advance)
    monkeypatch.setenv("SPINDLE_GRAPH_TOKENS_TO_HOST", to_host)
    path = tiny_model(arch="qwen3", max_position_embeddings=2048)
    prompts = _prompts(512)
    expected = _hf_greedy(path, prompts, 24, torch.float32, "cuda")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(str(path), dtype="float32", device="cuda", max_model_len=1024,
             max_num_batched_tokens=256) as llm:
        graphs = llm.engine.core.executor.worker.runner.graph_runner
        together = llm.generate(prompts, params, use_tqdm=False)
        taken.clear()
        in_place, advanced = graphs.num_in_place, graphs.num_advanced
        from_ring = graphs.num_read_from_ring
        alone = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts[1:4]]
        lone_in_place = graphs.num_in_place - in_place
        lone_advanced = graphs.num_advanced - advanced
        lone_from_ring = graphs.num_read_from_ring - from_ring
        pair = llm.generate(prompts[4:6], [SamplingParams(temperature=0, max_tokens=n,
                                                          ignore_eos=True) for n in (9, 24)],
                            use_tqdm=False)
        in_place = graphs.num_in_place
        llm.generate(prompts[1:2], SamplingParams(temperature=1.0, seed=3, max_tokens=24,
                                                  ignore_eos=True), use_tqdm=False)
        sampled_in_place = graphs.num_in_place - in_place
    assert sum(taken) >= 3 * 23  # (each lone request: a prefill step, then 23 in a graph)
    # (each lone request's second to 23rd decode steps follow a graph's argmax; async
    # scheduling may launch one more past the last token)
    if graph_feed == "1":
        assert 3 * 22 <= lone_in_place <= 3 * 23
    else:
        assert lone_in_place == 0
    if advance == "1":
        assert lone_in_place - 3 * 3 <= lone_advanced <= lone_in_place - 3
    else:
        assert lone_advanced == 0
    assert (lone_from_ring >= 3 * 23) == (to_host == "1")
    assert sampled_in_place == 0
    for out, (tokens, _) in zip(together + alone, expected + expected[1:4]):
        assert out.outputs[0].token_ids == tokens
    assert pair[0].outputs[0].token_ids == expected[4][0][:9]
    assert pair[1].outputs[0].token_ids == expected[5][0]


# Cases of an architecture with config fields of their own: (arch, fields).
VARIANTS = {"phi3-partial": ("phi3", dict(rope_parameters={  # (Phi-4-mini's rotary)
    "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})),
    # LongRoPE with an original length of 80: prompts of 64 cross it, longer ones start
    # past it (the long rows read by the fused rotary in CUDA graphs)
    "phi3-longrope": ("phi3", dict(original_max_position_embeddings=80, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 80,
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [1.0 + 0.9 * i for i in range(8)]}))}


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3", "qwen3_moe", "mixtral",
                                  "granite", "granite_moe_shared", "gemma", "smollm3",
                                  "cohere2", "granite_swa", "glm4", "exaone4", "ministral3",
                                  "gpt_neox", "phi", "gpt2", "stablelm", "gpt_bigcode",
                                  "opt", "gptj", "codegen", "falcon", "gpt_neo", "olmo",
                                  "nemotron", "glm", "exaone", "bloom", "mpt",
                                  "helium", "phi3-partial", "llama4", "phi3-longrope"])
def test_more_families_float32_greedy(tiny_model, arch):
    """The families after the first three, decoding in CUDA graphs: Gemma 2's attention
    soft cap and alternating window in the Triton kernels, Gemma 3's per-layer-type
    rotary tables, Phi-3's fused checkpoint tensors, the fused MoE kernel, Granite's
    multipliers (its MoE with a shared MLP), Gemma's plain layers and SmolLM3's NoPE
    layers (the Triton decode kernel without the fused rotary), Cohere2's parallel
    layers (windows, unrotated global layers), GraniteSWA's sinks in the Triton kernels,
    GLM-4's partial rotary, EXAONE 4's post-norm layers and Ministral 3's queries scaled
    by position before the fused rotary, GPT-NeoX's parallel layers with a quarter-head
    rotary, Phi's LM head bias, GPT-2's learned positions, StableLM's grouped-query
    partial rotary, GPTBigCode's one key/value head, OPT's offset positions, GPT-J's
    interleaved partial rotary, Falcon's multi-query parallel layers, GPT-Neo's unscaled
    scores in windowed layers, OLMo's clamped q/k/v, Nemotron's LayerNorm1P, CodeGen's
    sharded qkv, GLM-4-9B's partial interleaved rotary, EXAONE 3's renamed tensors,
    BLOOM's and MPT's ALiBi in both Triton kernels, Helium's unfused norms (no split-K
    partials deferred to them), Phi-4-mini's rotary over part of each head, Llama 4's
    chunked attention in both Triton kernels, its weightless q/k norms in the fused
    rotary and its top-1 experts fed the scaled input, Phi-3's LongRoPE past its
    original length (the long rows of the table, a request encoded again).
    (transformers' eager attention: its SDPA path leaves Gemma 2's cap out.)"""
    arch, variant = VARIANTS.get(arch, (arch, {}))
    path = tiny_model(arch=arch, max_position_embeddings=2048, **variant)
    _assert_float32_greedy_equals_eager_transformers(path, _prompts(512), 24,
                                                     max_model_len=1024,
                                                     max_num_batched_tokens=256)


def _assert_float32_greedy_equals_eager_transformers(path, prompts, max_new, **engine_args):
    """spindle's float32 greedy tokens on CUDA equal transformers' (its eager attention),
    their logprobs within 1e-4."""
    expected = _hf_greedy(path, prompts, max_new, torch.float32, "cuda",
                          attn_implementation="eager")
    with LLM(str(path), dtype="float32", device="cuda", **engine_args) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new,
                                                    ignore_eos=True, logprobs=0),
                            use_tqdm=False)
    for out, (tokens, lps) in zip(outs, expected):
        assert out.outputs[0].token_ids == tokens
        got = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-4


@pytest.mark.parametrize("arch,block_size", [("qwen3", 16), ("llama", 16), ("gemma2", 16),
                                             ("bloom", 16), ("qwen3", 32)])
def test_head_major_pages_greedy_matches_transformers(tiny_model, monkeypatch, arch,
                                                       block_size):
    """SPINDLE_KV_HEAD_MAJOR=1: the engine allocates its pages heads first and the Triton
    kernels read them through their strides (Qwen3's fused q/k norm, Llama's rotary,
    Gemma 2's soft cap and window, BLOOM's ALiBi with the separate KV store), on 16- and
    32-token pages: float32 greedy tokens and logprobs equal transformers', prompts in
    chunks of 256 tokens, decoding in CUDA graphs. (A model of one KV head, latent
    attention's, has the same pages either way.)"""
    monkeypatch.setenv("SPINDLE_KV_HEAD_MAJOR", "1")
    from spindle.runner import model_runner

    allocated = []
    allocate = model_runner.ModelRunner.allocate_kv_cache

    def recording(self, config):
        result = allocate(self, config)
        allocated.append(self.cache_layout)
        return result

    monkeypatch.setattr(model_runner.ModelRunner, "allocate_kv_cache", recording)
    path = tiny_model(arch=arch, max_position_embeddings=2048)
    _assert_float32_greedy_equals_eager_transformers(path, _prompts(512), 16,
                                                     max_model_len=1024,
                                                     max_num_batched_tokens=256,
                                                     block_size=block_size)
    assert [(layout.attention_page.head_major, layout.block_size)
            for layout in allocated] == [(True, block_size)]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma2", "bloom"])
def test_mixed_steps_send_single_token_requests_to_the_decode_kernel(tiny_model, monkeypatch,
                                                                     arch):
    """Steps holding prompt chunks beside many decoding requests attend for those in the
    decode kernel (TritonAttentionBackend._single_token_requests; its bound lowered from
    264 programs to 16 so that a tiny model's steps meet it): float32 greedy tokens and
    logprobs equal transformers' (Qwen3's fused q/k norm, Llama's rotary, Gemma 2's soft
    cap and window, BLOOM's ALiBi), and many steps took that path."""
    from spindle.attention.backends import triton_attn

    monkeypatch.setattr(triton_attn, "_TARGET_PROGRAMS", 16)
    split = []
    choose = triton_attn.TritonAttentionBackend._single_token_requests

    def recording(self, meta):
        chosen = choose(self, meta)
        split.append(chosen is not None)
        return chosen

    monkeypatch.setattr(triton_attn.TritonAttentionBackend, "_single_token_requests",
                        recording)
    arch, variant = VARIANTS.get(arch, (arch, {}))
    path = tiny_model(arch=arch, max_position_embeddings=2048, **variant)
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(3, 90))] for _ in range(40)]
    _assert_float32_greedy_equals_eager_transformers(path, prompts, 16, max_model_len=512,
                                                     max_num_batched_tokens=64)
    assert sum(split) >= 10, f"{sum(split)} layer calls of mixed steps took the decode kernel"


def test_bf16_teacher_forced_logprobs(tiny_model):
    """transformers' greedy continuation, fed back token by token: spindle's logprob
    of each of transformers' tokens stays within BF16_LOGPROB_TOL."""
    path = tiny_model(arch="qwen3", dtype="bfloat16")
    prompts = _prompts(512, lengths=(9, 70, 250))
    expected = _hf_greedy(path, prompts, 12, torch.bfloat16, "cuda")
    llm = LLM(str(path), dtype="bfloat16", device="cuda", max_model_len=1024)
    worst = 0.0
    try:
        for prompt, (tokens, hf_lps) in zip(prompts, expected):
            prefixes = [prompt + tokens[:j] for j in range(len(tokens))]
            outs = llm.generate(prefixes, SamplingParams(temperature=0, max_tokens=1, logprobs=20),
                                use_tqdm=False)
            for out, token, hf_lp in zip(outs, tokens, hf_lps):
                entry = out.outputs[0].logprobs[0]
                assert token in entry, "transformers' greedy token is not in spindle's top 20"
                worst = max(worst, abs(entry[token].logprob - hf_lp))
    finally:
        llm.shutdown()
    print(f"worst bf16 logprob difference: {worst:.4f}")
    assert worst < BF16_LOGPROB_TOL


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_bf16_one_request_decode_logprobs(tiny_model, arch, enforce_eager):
    """Decode steps of one request (on Hopper, TMA GEMVs that apply the decoder layers'
    norms as they load: layers/tma_gemv.py), in CUDA graphs and eagerly: each token
    spindle picks greedily has, within BF16_LOGPROB_TOL, the logprob transformers gives
    it after the same prefix."""
    from transformers import AutoModelForCausalLM

    path = tiny_model(arch=arch, dtype="bfloat16")
    prompts = _prompts(512, lengths=(9, 70))
    llm = LLM(str(path), dtype="bfloat16", device="cuda", max_model_len=1024,
              enforce_eager=enforce_eager)
    try:
        outs = [llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, logprobs=1),
                             use_tqdm=False)[0].outputs[0] for prompt in prompts]
    finally:
        llm.shutdown()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt + list(out.token_ids[:-1])], device="cuda")
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:].float()
        expected = torch.log_softmax(logits, -1)
        for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            worst = max(worst, abs(entry[token].logprob - expected[j, token].item()))
    print(f"worst bf16 logprob difference: {worst:.4f}")
    assert worst < BF16_LOGPROB_TOL


def test_steps_copy_nothing_from_pageable_memory(tiny_model):
    """Every host-to-device copy of a step comes from pinned memory. A copy from
    pageable memory (e.g. of a strided slice of a pinned buffer, which torch first
    packs into a pageable temporary) makes the host wait for the device, so the next
    step can no longer be launched while this one runs. Prompts of different lengths
    give block tables narrower than their buffer (the strided case), and CUDA graphs
    and eager prefill steps both run."""
    from torch.profiler import ProfilerActivity, profile

    path = tiny_model(arch="qwen3", dtype="bfloat16")
    prompts = _prompts(512, lengths=(3, 40, 90, 200, 17))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(str(path), dtype="bfloat16", device="cuda", max_model_len=1024,
             max_num_seqs=8) as llm:
        llm.generate(prompts, params, use_tqdm=False)  # warm: nothing compiles below
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    copies = [e.name for e in prof.events() if "Memcpy HtoD" in e.name]
    assert copies, "the profile saw no host-to-device copy at all"
    pageable = [name for name in copies if "Pageable" in name]
    assert not pageable, f"{len(pageable)} of {len(copies)} copies from pageable memory"
