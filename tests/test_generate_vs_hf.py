"""End to end against the oracle: spindle's greedy output and logprobs equal
transformers' generate on the same tiny checkpoint, in float32 on CPU, across the
scheduling regimes that change how the work is cut (chunked prefill, block sizes,
prefix-cache hits, preemption under a small KV budget)."""

from __future__ import annotations

import random

import pytest
import torch

from spindle import LLM, SamplingParams

# (phi3: fused qkv and gate_up tensors; olmo2: post-norm layers, q/k normalised over their
# whole width; olmo3: olmo2 with every other layer in a window of 8, a rotary per layer type;
# granite: Llama with multipliers on the embeddings, the sublayers' outputs, the scores and
# the logits)
ARCHS = ["llama", "qwen2", "qwen3", "phi3", "olmo2", "olmo3", "granite"]
MAX_NEW = 20
PROMPT_LENGTHS = [1, 2, 3, 7, 15, 16, 17, 31, 33, 64, 100, 128, 150, 200, 257, 300]
LOGPROB_TOL = 1e-4


def make_prompts(vocab_size: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(shared_prefix)]
    prompts = []
    for n in PROMPT_LENGTHS:
        own = max(1, n - shared_prefix) if shared_prefix else n
        prompts.append(prefix + [rng.randrange(vocab_size) for _ in range(own)])
    return prompts


def hf_greedy(model_dir, prompts: list[list[int]], max_new: int, prepare=None,
              auto_class: str = "AutoModelForCausalLM",
              **load_kwargs) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and the logprob of each, EOS never stopping it
    (prepare: called on the loaded model first; auto_class: the transformers class that
    loads it; load_kwargs: more from_pretrained arguments, e.g. attn_implementation)."""
    import transformers

    model = getattr(transformers, auto_class).from_pretrained(
        model_dir, dtype=torch.float32, **load_kwargs).eval()
    if prepare is not None:
        prepare(model)
    config = model.generation_config
    config.eos_token_id = None
    config.pad_token_id = 0
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                 min_new_tokens=0, do_sample=False, generation_config=config,
                                 output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                    for step, t in zip(out.logits, tokens)]
        results.append((tokens, logprobs))
    return results


def hf_float32_noise(model_dir, prompts: list[list[int]],
                     results: list[tuple[list[int], list[float]]]) -> float:
    """How far transformers' own float32 logprobs (hf_greedy's results) are from a
    float64 run of the same model on the same tokens (teacher-forced): the rounding
    noise of float32 for this model, which a comparison of two float32 engines must
    allow twice over. Experts run as plain loops (transformers' grouped GEMM takes no
    float64)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float64, experts_implementation="eager").eval()
    worst = 0.0
    for prompt, (tokens, logprobs) in zip(prompts, results):
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1]
        exact = torch.log_softmax(logits.double(), -1)[torch.arange(len(tokens)), tokens]
        worst = max(worst, max(abs(a - b) for a, b in zip(exact.tolist(), logprobs)))
    return worst


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Per arch: (checkpoint dir, prompts, shared-prefix prompts, HF results for both)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = tiny_model(arch=arch)
            import json

            vocab = json.loads((path / "config.json").read_text())["vocab_size"]
            plain = make_prompts(vocab, seed=1)
            shared = make_prompts(vocab, seed=2, shared_prefix=40)
            cache[arch] = (path, plain, shared, hf_greedy(path, plain, MAX_NEW),
                           hf_greedy(path, shared, MAX_NEW))
        return cache[arch]

    return get


def run_spindle(path, prompts, **engine_kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    kwargs = dict(dtype="float32", device="cpu", max_model_len=512, seed=0)
    kwargs.update(engine_kwargs)
    llm = LLM(str(path), **kwargs)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        scheduler = llm.engine.core.scheduler
        return outputs, scheduler
    finally:
        llm.shutdown()


def assert_matches(outputs, expected):
    for i, (out, (tokens, logprobs)) in enumerate(zip(outputs, expected)):
        got = out.outputs[0]
        assert got.token_ids == tokens, f"prompt {i}: tokens differ from transformers"
        got_lp = [next(iter(d.values())).logprob for d in got.logprobs]
        for j, (a, b) in enumerate(zip(got_lp, logprobs)):
            assert abs(a - b) <= LOGPROB_TOL, f"prompt {i} token {j}: logprob {a} vs {b}"
        assert got.finish_reason == "length"


@pytest.mark.parametrize("arch", ARCHS)
def test_default_config_matches_transformers(reference, arch):
    path, prompts, _, expected, _ = reference(arch)
    outputs, _ = run_spindle(path, prompts)
    assert_matches(outputs, expected)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size,budget", [(16, 48), (32, 100)])
def test_chunked_prefill_and_block_sizes(reference, arch, block_size, budget):
    path, prompts, _, expected, _ = reference(arch)
    outputs, _ = run_spindle(path, prompts, block_size=block_size, max_num_batched_tokens=budget)
    assert_matches(outputs, expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_caching_with_shared_prefixes(reference, arch):
    path, _, prompts, _, expected = reference(arch)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=512,
              enable_prefix_caching=True, max_num_batched_tokens=128)
    try:
        first = llm.generate(prompts, params, use_tqdm=False)
        second = llm.generate(prompts, params, use_tqdm=False)  # every prompt block is cached now
        hits = llm.engine.core.scheduler.kv_cache_manager.prefix_cache_stats
    finally:
        llm.shutdown()
    assert_matches(first, expected)
    assert_matches(second, expected)
    assert hits.hits > 0, "the shared prefixes and the repeated batch must hit the prefix cache"


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_under_small_kv_budget(reference, arch, tiny_model):
    path, prompts, _, expected, _ = reference(arch)
    import json

    config = json.loads((path / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    block_bytes = 2 * 16 * config["num_key_value_heads"] * head_dim * 4 * config["num_hidden_layers"]
    # 48 blocks = 768 tokens for 16 prompts that need about 3,000: preemption is forced.
    outputs, scheduler = run_spindle(path, prompts, kv_cache_memory_bytes=48 * block_bytes,
                                     block_size=16)
    assert_matches(outputs, expected)
    assert scheduler.num_preemptions > 0, "the small KV budget must have forced preemption"


def test_processed_logprobs_against_transformers_logits(tiny_model):
    """logprobs_mode="processed_logprobs": the first sampled token's logprob is that of
    transformers' next-token logits after temperature and top-k (the distribution it
    was drawn from); the default mode gives the raw log-softmax."""
    from transformers import AutoModelForCausalLM

    path = tiny_model(arch="llama")
    prompt = make_prompts(512, seed=4)[6]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        next_logits = hf(torch.tensor([prompt])).logits[0, -1].double()
    temperature, top_k = 0.7, 5
    scaled = next_logits / temperature
    kept = scaled.topk(top_k).indices
    processed = torch.full_like(scaled, float("-inf"))
    processed[kept] = scaled[kept]
    processed = torch.log_softmax(processed, -1)
    raw = torch.log_softmax(next_logits, -1)
    params = SamplingParams(temperature=temperature, top_k=top_k, seed=3, max_tokens=1,
                            logprobs=top_k)
    for mode, want in (("processed_logprobs", processed), ("raw_logprobs", raw)):
        llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=512,
                  logprobs_mode=mode)
        try:
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        finally:
            llm.shutdown()
        token = out.token_ids[0]
        assert token in kept.tolist()
        entry = out.logprobs[0]
        for tok, lp in entry.items():
            assert abs(lp.logprob - want[tok].item()) <= LOGPROB_TOL, (mode, tok)
    with pytest.raises(ValueError, match="logprobs_mode"):
        LLM(str(path), device="cpu", logprobs_mode="logits")


def test_phi3_fused_tensors_shard_across_two_ranks(reference):
    """Phi-3's fused qkv_proj and gate_up_proj are split into their parts before the
    merged layers take each rank's shard of each part."""
    path, prompts, _, expected, _ = reference("phi3")
    outputs, _ = run_spindle(path, prompts, tensor_parallel_size=2)
    assert_matches(outputs, expected)


def test_logit_bias_against_transformers_logits(tiny_model):
    """logit_bias is added to the logits before sampling: greedy picks the argmax of
    transformers' next-token logits plus the biases (the best token pushed down, a
    weak one pushed up); processed logprobs are the log-softmax of the biased logits,
    raw ones of the logits as they are. Ids past the vocabulary are refused."""
    from transformers import AutoModelForCausalLM

    path = tiny_model(arch="llama")
    prompt = make_prompts(512, seed=5)[3]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1].double()
    order = logits.argsort(descending=True).tolist()
    best, weak = order[0], order[40]
    bias = {best: -100.0, weak: float(logits[best] - logits[weak]) + 0.5}
    biased = logits.clone()
    for token, value in bias.items():
        biased[token] += value
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2, logit_bias=bias)
    for mode, want in (("processed_logprobs", torch.log_softmax(biased, -1)),
                       ("raw_logprobs", torch.log_softmax(logits, -1))):
        with LLM(str(path), dtype="float32", device="cpu", max_model_len=512,
                 logprobs_mode=mode) as llm:
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            if mode == "raw_logprobs":
                with pytest.raises(ValueError, match="logit_bias must be token ids"):
                    llm.generate([prompt], SamplingParams(logit_bias={10**6: 1.0}),
                                 use_tqdm=False)
        assert out.token_ids[0] == weak == int(biased.argmax())
        for tok, lp in out.logprobs[0].items():
            assert abs(lp.logprob - want[tok].item()) <= LOGPROB_TOL, (mode, tok)
    for bad in ({1: 101.0}, {-1: 1.0}, {1: "big"}, [1, 2]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
