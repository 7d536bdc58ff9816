"""quantization="gguf": a GGUF file's 4- and 8-bit matrices kept as stored, through
torch's int4 CPU matmul (spindle/layers/int4.py, spindle/models/gguf_weights.py).

The block decoders against the gguf package's own dequantization (exact, every type
read); the int4 matmul against the dequantized weight it holds; a layer's rows staged
in any order, a later partial write keeping the other rows; and the real model
(SmolLM2-135M-Instruct's Q4_1 / Q8_0 GGUF) against its float32 dequantized self,
teacher-forced (spindle.tools.agreement), also for a cut with other tensor types."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from spindle import LLM, SamplingParams
from spindle.layers import int8_head
from spindle.layers.int4 import (GroupQuantized, Int4Weight, int4_matmul, pack, planes_for,
                                 quantize_groups, to_nibbles, unpack)
from test_gguf import gguf_file  # noqa: F401 (the fixture: the real model's GGUF file)

QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "Write a haiku about the sea.", "How do I boil an egg?"]




def random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid blocks of type_name for a [rows, cols] matrix: the gguf package's own
    quantizer for the simple types; for the K-quants random bytes (every byte pattern
    is a valid one) with finite float16 block scales."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[type_name]
    if not type_name.endswith("_K"):
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block_values, block_bytes), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.1, (blocks.shape[0], 2)).astype(np.float16)
    blocks[:, :4] = scales.view(np.uint8)  # d and dmin
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"])
def test_decoded_blocks_equal_the_gguf_packages_dequantization(type_name):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from spindle.models.gguf_weights import decode_groups

    rows, cols = 48, 512
    blocks = random_blocks(type_name, rows, cols, seed=len(type_name))
    expected = dequantize(blocks, GGMLQuantizationType[type_name]).reshape(rows, cols)
    decoded = decode_groups(blocks, type_name, rows, cols)
    assert torch.equal(decoded.dequantize(), torch.from_numpy(np.array(expected)))
    assert planes_for(*decoded.code_range()) == (1 if type_name in ("Q4_0", "Q4_1", "Q4_K")
                                                 else 2)


def random_codes(rows, cols, low, high, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(low, high + 1, (rows, cols), generator=gen, dtype=torch.int16)
    scale = torch.rand(rows, cols // 32, generator=gen) * 0.02 + 0.001
    offset = torch.randn(rows, cols // 32, generator=gen) * 0.05
    return GroupQuantized(codes, scale, offset)


def kernel_weight(gq: GroupQuantized, planes: int) -> torch.Tensor:
    """The weight the kernel multiplies by: gq's with the scales and zeros in bf16."""
    nibbles, scale_zero = to_nibbles(gq, planes)
    scale_zero = scale_zero.bfloat16().double()
    per_value = scale_zero.repeat_interleave(32, dim=1)
    w = (nibbles.double() - 8) * per_value[..., 0] + per_value[..., 1]
    cols = gq.shape[1]
    return w if planes == 1 else w[:, :cols] + w[:, cols:]


@pytest.mark.parametrize("low,high", [(0, 15), (-8, 7), (-128, 127), (0, 31), (-32, 31)])
@pytest.mark.parametrize("rows_in", [1, 7, 40])
def test_int4_matmul_equals_its_weight(low, high, rows_in):
    """x @ W^T through the packed kernel, against float64 with the same bf16 inputs;
    and that weight is the codes' own within bf16's rounding of the scales."""
    gq = random_codes(96, 320, low, high, seed=rows_in + low)
    planes = planes_for(low, high)
    assert planes == (1 if high - low <= 15 else 2)
    nibbles, scale_zero = to_nibbles(gq, planes)
    packed = pack(nibbles)
    assert torch.equal(unpack(packed, nibbles.shape[1]), nibbles.to(torch.uint8))
    x = torch.randn(rows_in, 320).bfloat16()
    out = int4_matmul(x, packed, scale_zero.transpose(0, 1).bfloat16().contiguous(), planes)
    ref = x.double() @ kernel_weight(gq, planes).t()
    assert out.dtype == torch.bfloat16
    assert ((out.double() - ref).norm() / ref.norm()).item() < 4e-3
    exact = gq.dequantize().double()
    assert ((kernel_weight(gq, planes) - exact).norm() / exact.norm()).item() < 4e-3


class Holder(nn.Module):
    """A module holding just an int4 weight, as the linear layers do."""

    def __init__(self, rows, cols):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols), requires_grad=False)
        self.int4 = Int4Weight(self, rows, cols)


def test_rows_load_in_any_order_and_a_partial_write_keeps_the_others():
    rows, cols = 192, 128
    full = random_codes(rows, cols, 0, 15, seed=1)
    holder = Holder(rows, cols)
    for start in (128, 0, 64):  # shards arriving out of order
        holder.int4.write_rows(full.narrow(0, start, 64), start)
    assert holder.int4.finish()
    packed = holder.weight
    x = torch.randn(3, cols)
    before = holder.int4.matmul(x)
    ref = x.bfloat16().double() @ kernel_weight(full, 1).t()
    assert ((before.double() - ref).norm() / ref.norm()).item() < 4e-3
    assert not holder.int4.finish()  # nothing staged since

    # A dense write of some rows (a weight update): quantized as Q4_1 is, the rest kept.
    new_rows = torch.randn(32, cols)
    holder.int4.write_rows(new_rows, 96)
    assert holder.int4.finish()
    assert holder.weight is packed  # written in place
    after = holder.int4.matmul(x)
    unchanged = torch.cat([torch.arange(0, 96), torch.arange(128, rows)])
    assert torch.equal(after[:, unchanged], before[:, unchanged])
    expected = x.bfloat16().double() @ kernel_weight(quantize_groups(new_rows, 4), 1).t()
    assert ((after[:, 96:128].double() - expected).norm() / expected.norm()).item() < 4e-3


def test_what_an_int4_weight_cannot_take_is_refused():
    holder = Holder(64, 64)
    holder.int4.write_rows(random_codes(32, 64, 0, 15, seed=2), 0)
    with pytest.raises(ValueError, match="32 of the 64 rows of an int4 weight were never"):
        holder.int4.finish()
    holder.int4.write_rows(random_codes(64, 64, 0, 15, seed=3), 0)
    holder.int4.finish()
    with pytest.raises(ValueError, match="need more bits than this int4 weight holds"):
        holder.int4.write_rows(random_codes(64, 64, -128, 127, seed=4), 0)
    with pytest.raises(ValueError, match="shape mismatch"):
        holder.int4.write_rows(random_codes(64, 96, 0, 15, seed=5), 0)
    with pytest.raises(ValueError, match="multiples of 16"):
        Holder(40, 64)
    with pytest.raises(ValueError, match="do not fall on group boundaries"):
        random_codes(64, 64, 0, 15, seed=6).narrow(1, 16, 32)


def test_real_model_agrees_with_its_float32_self(gguf_file):
    """SmolLM2's Q4_1 / Q8_0 GGUF served quantized (the default on the CPU) against the
    same file dequantized to float32 (which equals transformers reading it:
    test_gguf.py), the next token after every prefix of float32's greedy answers."""
    from spindle.tools.agreement import top1_agreement

    with LLM(str(gguf_file), device="cpu", max_model_len=256) as llm:
        assert llm.config.model.quantization == "gguf"
        model = llm.engine.core.executor.worker.runner.model
        if int8_head.enabled():  # (the fused CPU kernels: tests/test_int8_head.py)
            assert model.lm_head.int8 is not None and model.lm_head.int4 is None
        else:
            assert model.lm_head.int4 is not None and model.lm_head.int4.planes == 2  # Q8_0
        layer = model.model.layers[0]
        assert layer.mlp.down_proj.int4.planes == 1  # Q4_1
        assert layer.mlp.down_proj.weight.dtype == torch.uint8
    baseline = dict(device="cpu", dtype="float32", quantization="none", max_model_len=256)
    result = top1_agreement(str(gguf_file), QUESTIONS, 32, baseline,
                            dict(device="cpu", max_model_len=256))
    assert result["baseline_self_agreement"] == 1.0, result
    assert result["top1_agreement"] >= 0.9, result
    assert result["mean_abs_logprob_gap"] < 0.1, result


def test_a_float32_residual_stream_brings_bf16_closer_to_float32(gguf_file, monkeypatch):
    """bf16 on the CPU carries the residual stream in float32 (norm.fp32_residual_stream;
    both the modules and the C++ decode layer): the residual reaching the final norm is
    float32 on prefill and decode steps, and SmolLM2's final hidden states over a
    200-token prompt (dense bf16 weights, so that only the arithmetic differs) sit
    closer to the float32 model's than with a bf16 stream (SPINDLE_CPU_FP32_RESIDUAL=0)."""
    from spindle.layers.norm import FP32_RESIDUAL_ENV
    from spindle.tools.agreement import chat_prompts

    with LLM(str(gguf_file), device="cpu", max_model_len=256) as llm:
        model = llm.engine.core.executor.worker.runner.model
        seen = []
        model.model.norm.register_forward_pre_hook(lambda _, args: seen.append(args[1].dtype))
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
        assert seen and set(seen) == {torch.float32}  # prefill and decode steps
    prompt = (chat_prompts(str(gguf_file), QUESTIONS[:1])[0] * 20)[:200]

    def final_hidden(dtype: str) -> torch.Tensor:
        with LLM(str(gguf_file), device="cpu", dtype=dtype, quantization="none",
                 max_model_len=256) as llm:
            model = llm.engine.core.executor.worker.runner.model
            out = []
            model.model.norm.register_forward_hook(lambda _, args, y: out.append(y[0].float()))
            llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1),
                         use_tqdm=False)
        return out[0]

    reference = final_hidden("float32")
    fp32_stream = (final_hidden("bfloat16") - reference).norm() / reference.norm()
    monkeypatch.setenv(FP32_RESIDUAL_ENV, "0")
    bf16_stream = (final_hidden("bfloat16") - reference).norm() / reference.norm()
    assert fp32_stream < bf16_stream, (float(fp32_stream), float(bf16_stream))


def test_other_tensor_types_run_quantized_or_dense(gguf_file, tmp_path, monkeypatch):
    """A two-layer cut with Q4_0, Q8_0 and Q4_K matrices (int4) beside Q6_K, F16 and
    BF16 ones (kept dense), read with float32 activations around the int4 matmuls.
    (K-quant rows hold 256-value blocks: of SmolLM2's matrices only ffn_down's.)"""
    from test_gguf import requantize

    from spindle.tools.agreement import top1_agreement

    monkeypatch.setenv("SPINDLE_GGUF_CACHE", str(tmp_path / "cache"))
    cut = tmp_path / "smollm2-2-layers.gguf"
    requantize(gguf_file, cut, {"token_embd": "Q8_0", "blk.0.attn_v": "F16",
                                "blk.0.attn": "Q4_0", "blk.0.ffn_down": "Q4_K",
                                "blk.0.ffn": "Q8_0", "blk.1.attn": "BF16",
                                "blk.1.ffn_down": "Q6_K", "blk.1.ffn": "Q4_0"})
    with LLM(str(cut), device="cpu", dtype="float32", max_model_len=256) as llm:
        model = llm.engine.core.executor.worker.runner.model
        first, second = model.model.layers
        assert first.self_attn.qkv_proj.int4 is None  # its v is F16
        assert first.self_attn.o_proj.int4.planes == 1
        assert first.mlp.down_proj.int4.planes == 1  # Q4_K
        assert first.mlp.gate_up_proj.int4.planes == 2  # Q8_0
        assert second.self_attn.qkv_proj.int4 is None and second.mlp.down_proj.int4 is None
        assert second.mlp.gate_up_proj.int4.planes == 1
    baseline = dict(device="cpu", dtype="float32", quantization="none", max_model_len=256)
    result = top1_agreement(str(cut), QUESTIONS[:2], 16, baseline,
                            dict(baseline, quantization="gguf"))
    assert result["top1_agreement"] >= 0.9, result


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q5_1"])
def test_each_simple_type_agrees_with_its_float32_self(gguf_file, tmp_path, monkeypatch,
                                                       qtype):
    """The simple types the other tests do not hold a whole layer in (Q4_0, Q8_0 and
    Q4_K: above): a two-layer cut with every matrix in qtype, served quantized with
    bf16 activations (the default), against its own float32 dequantization."""
    from test_gguf import requantize

    from spindle.tools.agreement import top1_agreement

    monkeypatch.setenv("SPINDLE_GGUF_CACHE", str(tmp_path / "cache"))
    cut = tmp_path / f"smollm2-2-layers-{qtype}.gguf"
    requantize(gguf_file, cut, {"token_embd": "Q8_0", "": qtype})
    with LLM(str(cut), device="cpu", max_model_len=256) as llm:
        layer = llm.engine.core.executor.worker.runner.model.model.layers[0]
        assert layer.mlp.gate_up_proj.int4.planes == (1 if qtype == "Q4_1" else 2)
    baseline = dict(device="cpu", dtype="float32", quantization="none", max_model_len=256)
    result = top1_agreement(str(cut), QUESTIONS[:2], 16, baseline,
                            dict(device="cpu", max_model_len=256))
    assert result["top1_agreement"] >= 0.9, result
    assert result["mean_abs_logprob_gap"] < 0.1, result


def test_a_second_start_reads_the_packed_weights_the_first_cached(gguf_file, tmp_path,
                                                                   monkeypatch):
    """The first start of a GGUF file caches its packed weights beside the converted
    checkpoint (models/packed_cache.py); the second reads them, decodes and packs
    nothing, and answers token for token the same, as does a start that finds a cache
    file not matching the model (it loads the file and caches it again)."""
    from test_gguf import requantize

    from spindle.models import packed_cache
    from spindle.models.gguf_weights import GGUFWeights

    monkeypatch.setenv("SPINDLE_GGUF_CACHE", str(tmp_path / "cache"))
    cut = tmp_path / "smollm2-2-layers.gguf"
    requantize(gguf_file, cut, {"token_embd": "Q8_0", "blk.0.attn_v": "F16",
                                "blk.0": "Q4_1", "blk.1.ffn": "Q8_0", "blk.1": "Q4_0"})
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)

    def start():
        hits = []
        load = packed_cache.load
        monkeypatch.setattr(packed_cache, "load", lambda *a: hits.append(load(*a)) or hits[-1])
        with LLM(str(cut), device="cpu", dtype="float32", max_model_len=256) as llm:
            out = llm.generate(QUESTIONS[:2], params, use_tqdm=False)
            model = llm.engine.core.executor.worker.runner.model
            planes = model.model.layers[1].mlp.gate_up_proj.int4.planes
        monkeypatch.setattr(packed_cache, "load", load)
        return ([(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in out],
                hits == [True], planes)

    first, read, planes = start()
    assert not read and planes == 2
    (cached,) = (tmp_path / "cache").glob(f"*/{packed_cache.DIRECTORY}/*.safetensors")
    decoded = []
    read_tensor = GGUFWeights.read
    monkeypatch.setattr(GGUFWeights, "read", lambda *a: decoded.append(a) or read_tensor(*a))
    second, read, planes = start()
    assert read and planes == 2 and not decoded
    assert second == first
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.ones(3)}, str(cached))  # not this model's
    third, read, _ = start()
    assert not read and third == first
    assert packed_cache.load(_FakeModel(), cached) is False


class _FakeModel(nn.Module):
    """A model with one dense parameter, for a cache file that holds another."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Linear(2, 2)


def test_quantization_gguf_is_refused_where_it_cannot_run(tiny_model, gguf_file):
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLM(str(tiny_model("llama")), device="cpu", quantization="gguf")
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(gguf_file), device="cpu", load_format="dummy")
    from spindle.config import _resolve_quantization

    with pytest.raises(ValueError, match="runs on the CPU"):
        _resolve_quantization("gguf", None, gguf_file, "cuda")
    assert _resolve_quantization(None, None, gguf_file, "cuda") is None  # dequantized


def test_sleep_level_2_reloads_the_file_into_the_same_packed_tensors(gguf_file, tmp_path,
                                                                     monkeypatch):
    """Sleep level 2 drops the weights; waking reads the GGUF file again and packs it
    into the same parameters (the portable backend keeps their identity, not their
    addresses): the same bytes, the same tokens and logprobs."""
    from test_gguf import requantize

    monkeypatch.setenv("SPINDLE_GGUF_CACHE", str(tmp_path / "cache"))
    cut = tmp_path / "smollm2-2-layers.gguf"
    requantize(gguf_file, cut, {"token_embd": "Q8_0", "blk.0": "Q4_1", "blk.1": "Q4_0"})
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)

    def answers(llm):
        return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
                for o in llm.generate(QUESTIONS[:2], params, use_tqdm=False)]

    with LLM(str(cut), device="cpu", dtype="float32", max_model_len=256,
             enable_sleep_mode=True) as llm:
        model = llm.engine.core.executor.worker.runner.model
        before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
        assert model.model.layers[0].mlp.gate_up_proj.int4.packed
        baseline = answers(llm)
        llm.sleep(2)
        llm.wake_up()
        after = dict(model.named_parameters())
        assert set(after) == set(before)
        for name, (param, value) in before.items():
            assert after[name] is param and torch.equal(param, value), name
        assert answers(llm) == baseline


def test_a_weight_update_writes_into_the_packed_tensors(gguf_file, tmp_path, monkeypatch):
    """update_weights with a dense tensor for an int4 layer quantizes it into the same
    parameters (a zero matrix comes back exactly zero) and leaves every other tensor's
    bytes as they were."""
    from test_gguf import requantize

    from spindle.layers.int4 import from_nibbles

    monkeypatch.setenv("SPINDLE_GGUF_CACHE", str(tmp_path / "cache"))
    cut = tmp_path / "smollm2-2-layers.gguf"
    requantize(gguf_file, cut, {"token_embd": "Q8_0", "blk.0": "Q4_1", "blk.1": "Q4_0"})
    with LLM(str(cut), device="cpu", dtype="float32", max_model_len=256) as llm:
        model = llm.engine.core.executor.worker.runner.model
        o_proj = model.model.layers[0].self_attn.o_proj
        before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
        llm.update_weights({"model.layers.0.self_attn.o_proj.weight": torch.zeros(576, 576)})
        changed = {"model.layers.0.self_attn.o_proj.weight",
                   "model.layers.0.self_attn.o_proj.weight_scale_zero"}
        for name, (param, value) in before.items():
            assert dict(model.named_parameters())[name] is param
            assert torch.equal(param, value) == (name not in changed), name
        held = from_nibbles(unpack(o_proj.weight, 576), o_proj.weight_scale_zero.transpose(0, 1),
                            o_proj.int4.planes)
        assert torch.count_nonzero(held.dequantize()) == 0
        llm.generate(QUESTIONS[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # still runs


@pytest.mark.parametrize("rows", [4096 * 2 + 48, 4096 + 16, 4992])
def test_packing_in_chunks_gives_torchs_bytes(rows):
    """pack() goes PACK_ROWS rows at a time past PACK_ROWS rows: the same bytes as
    torch packing the whole weight at once (row counts off the 64-row blocks too)."""
    from spindle.layers.int4 import PACK_ROWS

    nibbles = torch.randint(0, 16, (rows, 96), dtype=torch.int32,
                            generator=torch.Generator().manual_seed(rows))
    assert rows > PACK_ROWS
    assert torch.equal(pack(nibbles.to(torch.uint8)),
                       torch._convert_weight_to_int4pack_for_cpu(nibbles, 1))
