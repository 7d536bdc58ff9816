"""FP8 weights (quantization="fp8") on the CPU, against transformers.

The reference is transformers' model on the same checkpoint with the quantization
written out here independently of spindle: every linear layer but the LM head gets its
weight rounded to float8 e4m3 per output row (scale = row max / 448) and its input
rounded per token the same way; under TP=2 the row-parallel layers (o_proj,
down_proj) round each rank's half of the columns on its own, as each rank does. Greedy
tokens must be equal and logprobs within float32 noise. Checkpoints stored in fp8
(compressed-tensors per channel, transformers' block format) are written here and
loaded: the per-channel one gives exactly what quantizing its source gives, the block
one equals transformers' own loading of it (quantization="none"), and its fp8 load
equals the reference above applied to those dequantized weights. Sleep and wake keep
the answers; bad inputs are refused by name.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from torch import nn

from spindle import LLM, SamplingParams
from test_generate_vs_hf import hf_greedy

FP8 = torch.float8_e4m3fn
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
ROW_PARALLEL = ("o_proj", "down_proj")


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(512) for _ in range(n)] for n in (3, 8, 21, 40)]


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded to float8 e4m3 with one scale per row (its max / 448), in float32."""
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (x / scale).clamp(-448, 448).to(FP8).float() * scale


def round_chunks(x: torch.Tensor, chunks: int) -> torch.Tensor:
    return torch.cat([round_rows(c) for c in x.chunk(chunks, dim=-1)], dim=-1)


def fake_fp8(tp: int = 1):
    """A transformers model's linear layers computing as spindle's fp8 layers do."""
    def prepare(model: nn.Module) -> None:
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear) or name.endswith("lm_head"):
                continue
            chunks = tp if name.endswith(ROW_PARALLEL) else 1
            module.weight.data = round_chunks(module.weight.data, chunks)
            module.register_forward_pre_hook(
                lambda m, args, chunks=chunks: (round_chunks(args[0], chunks),))
    return prepare


def generate(path, **kwargs):
    kwargs.setdefault("dtype", "float32")
    with LLM(str(path), device="cpu", max_model_len=256, **kwargs) as llm:
        return llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY,
                            use_tqdm=False)


def answers(outputs):
    return [(o.outputs[0].token_ids,
             [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outputs]


def check(outputs, expected, all_close=True):
    """Greedy tokens equal; logprobs within 1e-4 everywhere, or (all_close False) at 9
    positions in 10.

    The second is for runs whose float32 sums go in another order than transformers'
    (chunked attention). An activation lying within a few ulp of an
    e4m3 rounding boundary then rounds either way, moving it by 1/16 and a logprob by
    up to about 0.2: measured, a few such activations per run of these prompts, each
    moving one or two logprobs. A wrong scale or rounding moves them all."""
    close = total = 0
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(answers(outputs), expected):
        assert tokens == ref_tokens
        if all_close:
            assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)
        close += sum(abs(a - b) <= 1e-4 for a, b in zip(logprobs, ref_logprobs))
        total += len(logprobs)
    assert close >= 0.9 * total, f"only {close} of {total} logprobs within 1e-4"


# ----------------------------------------------------------------------- the layer math
def test_quantize_rows_uses_the_whole_e4m3_range():
    from spindle.layers.fp8 import quantize_rows

    x = torch.randn(64, 96) * torch.logspace(-4, 3, 64)[:, None]
    x[7] = 0.0
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.dtype == torch.float32
    assert scale[7] == 1 and (q[7].float() == 0).all()
    rows = [i for i in range(64) if i != 7]
    assert torch.equal(q[rows].float().abs().amax(1), torch.full((63,), 448.0))
    torch.testing.assert_close(q.float() * scale[:, None], round_rows(x), rtol=0, atol=0)
    # e4m3 keeps 3 mantissa bits: within 1/16 of each value, or half its spacing near 0
    err = (q.float() * scale[:, None] - x).abs()
    assert (err <= torch.maximum(x.abs() / 16, scale[:, None] * 2.0 ** -10)).all()


@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_linear_equals_the_rounded_product(with_bias):
    from spindle.layers.fp8 import fp8_linear, quantize_rows

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 37, 64, generator=gen)
    w = torch.randn(48, 64, generator=gen) / 8
    b = torch.randn(48, generator=gen) if with_bias else None
    q, scale = quantize_rows(w)
    ref = round_rows(x) @ round_rows(w).T + (b if b is not None else 0)
    torch.testing.assert_close(fp8_linear(x, q, scale, b), ref, rtol=1e-5, atol=1e-5)
    assert fp8_linear(x[:, :0], q, scale, b).shape == (2, 0, 48)


# -------------------------------------------------------------------- model vs transformers
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_equals_fake_quantized_transformers(tiny_model, arch):
    path = tiny_model(arch)
    check(generate(path, quantization="fp8"), hf_greedy(path, prompts(), MAX_NEW, fake_fp8()))


def test_chunked_prefill_and_tp2(tiny_model):
    path = tiny_model("llama")
    check(generate(path, quantization="fp8", max_num_batched_tokens=8, block_size=4),
          hf_greedy(path, prompts(), MAX_NEW, fake_fp8()), all_close=False)
    check(generate(path, quantization="fp8", tensor_parallel_size=2),
          hf_greedy(path, prompts(), MAX_NEW, fake_fp8(tp=2)))
    # ... and the per-rank scales matter: the single-rank reference is far off
    tp1 = hf_greedy(path, prompts(), MAX_NEW, fake_fp8())
    with pytest.raises(AssertionError):
        check(generate(path, quantization="fp8", tensor_parallel_size=2), tp1)


def test_the_quantization_matters(tiny_model):
    """Unquantized transformers answers differently on these prompts: the comparison
    above would see the rounding left out."""
    path = tiny_model("llama")
    plain = [t for t, _ in hf_greedy(path, prompts(), MAX_NEW)]
    assert plain != [t for t, _ in answers(generate(path, quantization="fp8"))]


def test_weights_take_a_byte_each(tiny_model):
    from spindle.layers.linear import _ParallelLinearBase

    with LLM(str(tiny_model("llama")), device="cpu", quantization="fp8") as llm:
        model = llm.engine.core.executor.worker.runner.model
        layers = [m for m in model.modules() if isinstance(m, _ParallelLinearBase)]
        assert layers and all(m.weight.dtype == FP8 and m.weight_scale.dtype == torch.float32
                              for m in layers)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_keep_the_answers(tiny_model, level):
    path = tiny_model("qwen3")
    expected = answers(generate(path, quantization="fp8"))
    with LLM(str(path), device="cpu", dtype="float32", quantization="fp8",
             enable_sleep_mode=True, max_model_len=256) as llm:
        llm.sleep(level)
        llm.wake_up()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY,
                               use_tqdm=False)
    assert answers(outputs) == expected


# ----------------------------------------------------------------- checkpoints in fp8
LINEAR_WEIGHTS = tuple(f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                "gate_proj", "up_proj", "down_proj"))


def write_fp8_checkpoint(src, dst, quantize, quantization_config):
    """A copy of checkpoint src whose linear weights quantize(w) turns into
    {name suffix: tensor} (the float8 weight and its scales)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    out = {}
    for name, tensor in state.items():
        if name.endswith(LINEAR_WEIGHTS):
            base = name[: -len("weight")]
            out.update({base + suffix: t for suffix, t in quantize(tensor).items()})
        else:
            out[name] = tensor
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def per_channel(w):
    amax = w.abs().amax(1, keepdim=True)
    scale = amax / 448.0
    return {"weight": (w / scale).clamp(-448, 448).to(FP8), "weight_scale": scale,
            "input_scale": torch.ones(1)}  # a static scale: read, not used


COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "quantization_status": "compressed", "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                    "symmetric": True, "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "symmetric": True, "dynamic": True}}}}
BLOCK = 32


def per_block(w):
    n, k = w.shape
    blocks = w.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(FP8).reshape(n, k)
    return {"weight": q, "weight_scale_inv": scale}


HF_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic",
          "weight_block_size": [BLOCK, BLOCK]}


def test_per_channel_checkpoint_loads_the_same_fp8_weights(tiny_model, tmp_path):
    src = tiny_model("qwen3")
    path = write_fp8_checkpoint(src, tmp_path / "ct", per_channel, COMPRESSED_TENSORS)
    assert answers(generate(path)) == answers(generate(src, quantization="fp8"))


def test_block_checkpoint_equals_transformers(tiny_model, tmp_path):
    src = tiny_model("llama")
    path = write_fp8_checkpoint(src, tmp_path / "hf", per_block, HF_FP8)
    # transformers on a CPU dequantizes the blocks to the model dtype
    dequantized = hf_greedy(path, prompts(), MAX_NEW)
    check(generate(path, quantization="none"), dequantized)
    check(generate(path), hf_greedy(path, prompts(), MAX_NEW, fake_fp8()))
    assert dequantized != hf_greedy(src, prompts(), MAX_NEW)  # the blocks did round


def dequantized_blocks(src, dst):
    """A copy of the block checkpoint src with its weights multiplied out (float32) and
    no quantization_config: what the float8 weights stand for."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    out = {}
    for name, tensor in state.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale = state.get(name + "_scale_inv")
        if scale is not None:
            blocks = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
            tensor = tensor.float() * blocks
        out[name] = tensor
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_an_image_text_checkpoint_declares_its_float8_outside_the_text_config(tiny_model,
                                                                               tmp_path):
    """Qwen3.5's FP8 checkpoints: quantization_config sits on the image-text config,
    whose text_config spindle serves; the blocks still dequantize."""
    path = write_fp8_checkpoint(tiny_model("qwen3_5_vl"), tmp_path / "fp8", per_block, HF_FP8)
    reference = dequantized_blocks(path, tmp_path / "dequantized")
    check(generate(path, quantization="none"), hf_greedy(reference, prompts(), MAX_NEW))


def test_checkpoint_errors(tiny_model, tmp_path):
    src = tiny_model("llama")
    gptq = write_fp8_checkpoint(src, tmp_path / "gptq", per_channel,
                                {"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match="'gptq' is not supported.*compressed-tensors"):
        LLM(str(gptq), device="cpu")
    int8 = dict(COMPRESSED_TENSORS, config_groups={"g": {"weights": {
        "num_bits": 8, "type": "int", "strategy": "channel"}}})
    int8_path = write_fp8_checkpoint(src, tmp_path / "int8", per_channel, int8)
    with pytest.raises(ValueError, match="8-bit int weights"):
        LLM(str(int8_path), device="cpu")
    unscaled = write_fp8_checkpoint(src, tmp_path / "unscaled",
                                    lambda w: {"weight": per_channel(w)["weight"]}, HF_FP8)
    with pytest.raises(ValueError, match="has no scale"):
        LLM(str(unscaled), device="cpu")
    undeclared = write_fp8_checkpoint(src, tmp_path / "undeclared", per_block, None)
    config = json.loads((undeclared / "config.json").read_text())
    del config["quantization_config"]
    (undeclared / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="float8, but config.json declares no"):
        LLM(str(undeclared), device="cpu")


def test_bad_options(tiny_model):
    path = str(tiny_model("llama"))
    with pytest.raises(ValueError, match="quantization must be one of fp8 or none"):
        LLM(path, device="cpu", quantization="int4")
    with pytest.raises(ValueError, match="batch_invariant cannot be combined with quantization"):
        LLM(path, device="cpu", quantization="fp8", batch_invariant=True)
    odd = tiny_model("llama", hidden_size=72, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="multiples of 16"):
        LLM(str(odd), device="cpu", quantization="fp8")


def test_real_model_mostly_agrees_with_float32(smollm2):
    """SmolLM2-135M-Instruct: after every prefix of its own greedy float32 answers, the
    fp8 model's top token is float32's at 85% of positions or more (measured here:
    92% over 6 questions x 48 tokens; a wrong scale or rounding gives far less)."""
    from spindle.tools.agreement import top1_agreement

    questions = ["What is the capital of France?", "Name three primary colors.",
                 "Write a haiku about the sea.", "How do I boil an egg?"]
    plain = dict(device="cpu", dtype="float32")
    result = top1_agreement(str(smollm2), questions, 32, plain, dict(plain, quantization="fp8"))
    assert result["baseline_self_agreement"] == 1.0, result
    assert result["top1_agreement"] >= 0.85, result


def test_weight_updates_requantize_in_place(tiny_model):
    """An RL rollout engine in fp8 takes a trainer's high-precision weights: each
    update is quantized into the same tensors, giving exactly what an engine started
    on those weights gives."""
    from safetensors.torch import load_file

    old, new = tiny_model("llama"), tiny_model("llama", seed=7)
    expected = answers(generate(new, quantization="fp8"))
    with LLM(str(old), device="cpu", dtype="float32", quantization="fp8",
             max_model_len=256) as llm:
        model = llm.engine.core.executor.worker.runner.model
        addresses = [p.data_ptr() for p in model.parameters()]
        llm.update_weights(load_file(str(new / "model.safetensors")))
        assert [p.data_ptr() for p in model.parameters()] == addresses
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY,
                               use_tqdm=False)
    assert answers(outputs) == expected
