"""Sliding-window attention end to end: spindle's greedy tokens and logprobs equal
transformers' generate on tiny Mistral (every layer windowed) and Qwen2/Qwen3
(use_sliding_window: the layers from max_window_layers on) checkpoints, with prompts and
generations well past the window, blocks small enough that several fall out of it, and
small chunked-prefill budgets; and which layer gets which window, as transformers
derives it."""

from __future__ import annotations

import json
import random

import pytest
import torch
from test_generate_vs_hf import assert_matches, hf_greedy

from spindle import LLM, SamplingParams

MAX_NEW = 40
# Around and well past the windows below (8 and 12); 1: decoding alone crosses them.
PROMPT_LENGTHS = [1, 8, 9, 12, 13, 40, 57]

# name -> (arch, make_tiny_model keywords)
CHECKPOINTS = {
    "mistral-w8": ("mistral", dict(sliding_window=8)),
    "mistral-w12": ("mistral", dict(sliding_window=12)),
    "phi3-w8": ("phi3", dict(sliding_window=8)),  # Phi-3 windows every layer, as Mistral
    # layer 0 full, layer 1 sliding
    "qwen2-w8-2layers": ("qwen2", dict(use_sliding_window=True, sliding_window=8,
                                       max_window_layers=1)),
    # layer 0 full, layers 1 and 2 sliding
    "qwen2-w12-3layers": ("qwen2", dict(use_sliding_window=True, sliding_window=12,
                                        max_window_layers=1, num_layers=3)),
    # layers 0 and 1 full, layer 2 sliding
    "qwen3-w8-3layers": ("qwen3", dict(use_sliding_window=True, sliding_window=8,
                                       max_window_layers=2, num_layers=3)),
}


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny models: one intra-op thread is faster, and immune to OpenMP stalls when
    another process holds a core."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """name -> (checkpoint dir, prompts, transformers' greedy tokens and logprobs)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            arch, kwargs = CHECKPOINTS[name]
            path = tiny_model(arch, **kwargs)
            vocab = json.loads((path / "config.json").read_text())["vocab_size"]
            rng = random.Random(7)
            prompts = [_decisive_prompt(path, rng, vocab, n) for n in PROMPT_LENGTHS]
            cache[name] = (path, prompts, hf_greedy(path, prompts, MAX_NEW))
        return cache[name]

    return get


# A greedy step whose top two logprobs are closer than this is a tie: transformers' own
# eager and sdpa attention were seen to pick different tokens at a 7e-6 gap (one CPU
# model's summation order), so such a step cannot tell a right engine from a wrong one.
DECISIVE_GAP = 1e-4


def _decisive_prompt(path, rng: random.Random, vocab: int, length: int,
                     attempts: int = 20) -> list[int]:
    """A random prompt of length tokens whose greedy continuation (MAX_NEW steps, by
    transformers) has no tie at any step; the first of the rng's draws that has none."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for _ in range(attempts):
        prompt = [rng.randrange(vocab) for _ in range(length)]
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                 min_new_tokens=0, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        top2 = torch.stack([torch.log_softmax(step[0].float(), -1).topk(2).values
                            for step in out.logits])
        if (top2[:, 0] - top2[:, 1]).min() >= DECISIVE_GAP:
            return prompt
    raise RuntimeError(f"no prompt of {length} tokens without a greedy tie in {attempts} draws")


def generate(path, prompts, **engine_kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    kwargs = dict(dtype="float32", device="cpu", max_model_len=256, seed=0)
    llm = LLM(str(path), **{**kwargs, **engine_kwargs})
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
@pytest.mark.parametrize("block_size", [4, 8])
def test_greedy_matches_transformers_past_the_window(reference, name, block_size):
    path, prompts, expected = reference(name)
    assert_matches(generate(path, prompts, block_size=block_size), expected)


@pytest.mark.parametrize("name", ["mistral-w12", "qwen2-w8-2layers", "qwen2-w12-3layers"])
@pytest.mark.parametrize("budget", [5, 16])
def test_small_chunked_prefill_budget(reference, name, budget):
    """Prompts cut into chunks of at most `budget` tokens (5: less than a window, so a
    chunk's queries see keys of earlier chunks only through the cache), mixed with
    other requests' decodes."""
    path, prompts, expected = reference(name)
    outputs = generate(path, prompts, block_size=4, max_num_batched_tokens=budget,
                       enable_chunked_prefill=True)
    assert_matches(outputs, expected)


def test_mistral_without_window_matches_transformers(tiny_model):
    """sliding_window null in a Mistral config: full attention, as in transformers."""
    path = tiny_model("mistral", sliding_window=None)
    assert json.loads((path / "config.json").read_text())["sliding_window"] is None
    rng = random.Random(3)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (30, 5)]
    assert_matches(generate(path, prompts, block_size=4), hf_greedy(path, prompts, MAX_NEW))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mistral-w8", "qwen2-w12-3layers"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_greedy_matches_transformers_past_the_window(reference, name, enforce_eager):
    """The Triton kernels' windows end to end (small prefill chunks; decode captured in
    CUDA graphs unless eager), in float32 against transformers on the CPU."""
    path, prompts, expected = reference(name)
    outputs = generate(path, prompts, device="cuda", block_size=8, max_num_batched_tokens=16,
                       enforce_eager=enforce_eager)
    assert_matches(outputs, expected)


# ----------------------------------------------------------------------------- windows
def _config(model_type: str, **fields):
    import transformers

    cls = {"mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[model_type]
    return cls(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, vocab_size=300, **fields)


def _windows(model_type: str, **fields) -> list[int | None]:
    """Per-layer windows of the spindle model built from this config."""
    from spindle.attention import Attention
    from spindle.distributed.parallel_state import TensorParallelGroup
    from spindle.models import llama

    cls = {"mistral": llama.MistralForCausalLM, "qwen2": llama.Qwen2ForCausalLM,
           "qwen3": llama.Qwen3ForCausalLM, "llama": llama.LlamaForCausalLM}[model_type]
    model = cls(_config(model_type, **fields), TensorParallelGroup.single())
    return [m.sliding_window for m in model.modules() if isinstance(m, Attention)]


@pytest.mark.parametrize("model_type,fields,expected", [
    ("mistral", dict(num_hidden_layers=3, sliding_window=8), [8, 8, 8]),
    ("mistral", dict(num_hidden_layers=2, sliding_window=None), [None, None]),
    # Qwen: transformers drops the window unless use_sliding_window ...
    ("qwen2", dict(num_hidden_layers=3, sliding_window=8), [None, None, None]),
    # ... then layers i >= max_window_layers slide ...
    ("qwen2", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=8,
                   max_window_layers=1), [None, 8, 8]),
    ("qwen3", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=16,
                   max_window_layers=3), [None, None, None, 16]),
    # ... unless layer_types says which.
    ("qwen2", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
     [8, None, 8]),
    ("llama", dict(num_hidden_layers=2), [None, None]),
], ids=["mistral", "mistral-null", "qwen2-off", "qwen2-max-window-layers", "qwen3",
        "qwen2-layer-types", "llama"])
def test_layer_windows_follow_transformers(model_type, fields, expected):
    assert _windows(model_type, **fields) == expected
    config = _config(model_type, **fields)
    if model_type != "llama":  # transformers' own per-layer reading of the same config
        hf_attention = _hf_attention_windows(config)
        assert hf_attention == expected


def _hf_attention_windows(config) -> list[int | None]:
    """The window transformers' modeling code uses per layer: Qwen attention modules
    keep one (self.sliding_window); Mistral passes config.sliding_window to every layer."""
    if config.model_type == "mistral":
        return [config.sliding_window] * config.num_hidden_layers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    return [layer.self_attn.sliding_window for layer in model.model.layers]


@pytest.mark.parametrize("model_type,fields,message", [
    ("qwen2", dict(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"]),
     "no window"),
    ("qwen2", dict(num_hidden_layers=2, use_sliding_window=True, sliding_window=8,
                   layer_types=["full_attention", "chunked_attention"]), "chunked_attention"),
    ("mistral", dict(num_hidden_layers=2, sliding_window=0), "positive integer"),
])
def test_bad_window_configs_are_refused(model_type, fields, message):
    with pytest.raises(ValueError, match=message):
        _windows(model_type, **fields)
