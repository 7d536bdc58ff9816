"""The tiny-checkpoint maker writes real HF checkpoints with well-separated logits."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from spindle.tools.tiny_model import (CHAT_TEMPLATE, EOS_ID, IM_END_ID, SPECIAL_TOKENS,
                                      add_cli_arguments, run_cli)

ARCHS = ["llama", "qwen2", "qwen3"]
# Checked for sound logits only (no tokenizer class of their own).
HYBRID_ARCHS = ["bamba", "zamba2"]


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def hf_load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(path))


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_checkpoint_and_tokenizer(tiny_model, arch):
    path = tiny_model(arch)
    model, tokenizer = hf_load(path)
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                    "qwen3": "Qwen3ForCausalLM"}[arch]
    assert model.config.tie_word_embeddings == (arch == "qwen3")
    assert len(tokenizer) == model.config.vocab_size == 512
    assert [tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token] == list(SPECIAL_TOKENS[:3])
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(len(SPECIAL_TOKENS)))
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [EOS_ID, IM_END_ID]

    # transformers may wrap tokenizer.json in a model-specific class (Qwen2Tokenizer for
    # qwen2); it must still encode exactly like the raw `tokenizers` file.
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    for text in ["def add(a, b):\n    return a + b  # ünïcode ✓",
                 "It's  2024;\n\n\tx=3.14<|im_end|>"]:
        ids = tokenizer(text)["input_ids"]
        assert ids == raw.encode(text).ids
        assert tokenizer.decode(ids) == text
        assert all(0 <= i < 512 for i in ids)


def test_chat_template_renders(tiny_model):
    _, tokenizer = hf_load(tiny_model("llama"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not plain.endswith("assistant\n")
    assert tokenizer.chat_template == CHAT_TEMPLATE
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert ids[0] == SPECIAL_TOKENS.index("<|im_start|>")
    assert ids.count(SPECIAL_TOKENS.index("<|im_end|>")) == 2


def test_deterministic_and_sharding_preserves_weights(tiny_model, tmp_path):
    from safetensors.torch import load_file

    from spindle.tools.tiny_model import make_tiny_model

    single = tiny_model("llama")
    again = make_tiny_model(tmp_path / "again", arch="llama")
    assert (single / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    assert (single / "tokenizer.json").read_text() == (again / "tokenizer.json").read_text()

    sharded = tiny_model("llama", num_shards=2)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    merged = {}
    for f in files:
        merged.update(load_file(sharded / f))
    reference = load_file(single / "model.safetensors")
    assert merged.keys() == reference.keys()
    assert all(torch.equal(merged[k], reference[k]) for k in reference)

    other_seed = load_file(tiny_model("llama", seed=1) / "model.safetensors")
    assert not torch.equal(other_seed["lm_head.weight"], reference["lm_head.weight"])


@pytest.mark.parametrize("arch", ARCHS + HYBRID_ARCHS)
def test_logits_have_no_near_ties(tiny_model, arch):
    """Greedy decoding is robust to float32 noise: logits spread over a few units and
    the top-1/top-2 gap, over 200 random positions, is essentially never tiny.

    The gap of a smooth random model has a density at 0 (~1/(4*logit std) per unit
    logit here), so a fixed threshold can only be rare, not impossible, unless the
    logits are made so peaked that sampling becomes greedy: about 0.1% of positions
    fall below 1e-3, none below 1e-5 (spindle's paged path and transformers differ by
    up to ~2e-5 on these logits, the full forward by 0).
    """
    model, _ = hf_load(tiny_model(arch))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 512, (4, 100), generator=g)
    with torch.no_grad():
        logits = model(ids).logits.reshape(-1, 512)
    logits = logits[torch.randperm(logits.shape[0], generator=g)[:200]]
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert torch.isfinite(logits).all()
    assert 2.0 < logits.std().item() < 8.0
    assert gaps.median().item() > 0.3
    assert (gaps < 1e-3).float().mean().item() <= 0.01
    assert gaps.min().item() > 1e-5


@pytest.mark.parametrize("arch", ARCHS + HYBRID_ARCHS)
def test_greedy_output_is_not_one_repeated_token(tiny_model, arch):
    model, tokenizer = hf_load(tiny_model(arch))
    prompt = tokenizer("import heapq\n\ndef merge(", return_tensors="pt")["input_ids"]
    out = model.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None,
                         pad_token_id=SPECIAL_TOKENS.index("<|pad|>"))
    new = out[0, prompt.shape[1]:].tolist()
    assert len(new) == 24
    assert len(set(new)) >= 6, new


def test_bamba_ssm_parameters_are_random_per_head(tiny_model):
    """A_log, D and dt_bias (ones / log(1..H) in transformers' init) get per-head random
    values in Mamba's ranges, not NaN from rescaling a constant."""
    from safetensors.torch import load_file

    path = tiny_model("bamba")
    config = json.loads((path / "config.json").read_text())
    assert config["mamba_n_heads"] == 4 and config["mamba_d_head"] == 32
    assert config["attn_layer_indices"] == [1]
    state = load_file(path / "model.safetensors")
    A = -torch.exp(state["model.layers.0.mamba.A_log"])
    D = state["model.layers.0.mamba.D"]
    step = torch.nn.functional.softplus(state["model.layers.0.mamba.dt_bias"])
    for values in (A, D, step):
        assert torch.isfinite(values).all() and values.unique().numel() == 4
    assert ((-16 <= A) & (A <= -1)).all()
    assert ((0.5 <= D) & (D <= 1.5)).all()
    assert ((1e-3 * 0.999 <= step) & (step <= 0.1 * 1.001)).all()


def test_cli(tmp_path):
    parser = add_cli_arguments(argparse.ArgumentParser())
    args = parser.parse_args([str(tmp_path / "m"), "--arch", "qwen2", "--num-layers", "1",
                              "--vocab-size", "300", "--num-shards", "2", "--dtype", "bfloat16"])
    path = run_cli(args)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] == 300
    assert config["dtype"] == "bfloat16"
    assert (path / "model.safetensors.index.json").is_file()
    model, tokenizer = hf_load(path)
    assert len(tokenizer) == 300


def test_every_registered_decoder_has_a_tiny_checkpoint():
    """A new architecture in the registry comes with tiny_model's support, so that it is
    compared with transformers (the encoders and Whisper have builders of their own)."""
    from spindle.models.registry import MODEL_REGISTRY
    from spindle.tools.tiny_model import ARCHITECTURES

    own_builders = {"BertModel", "RobertaModel", "XLMRobertaModel",
                    "WhisperForConditionalGeneration"}
    assert sorted(set(MODEL_REGISTRY) - set(ARCHITECTURES.values()) - own_builders) == []
