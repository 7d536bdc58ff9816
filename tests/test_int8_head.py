"""A GGUF model's LM head on the CPU as int8 codes with float32 group scales and
offsets, multiplied in float32 (spindle/layers/int8_head.py, the C++ kernel
int8_group_matmul in spindle/csrc/cpu_kernels.cpp).

The kernel against float64 on fresh random inputs (rows in and out not multiples of
its blocks, nonzero offsets, bf16 and float32 activations), each row's result
independent of the others; the weight's writes and lookups; and the real model
(SmolLM2's GGUF, whose tied head is Q8_0): its logits are the float32 product with the
file's dequantized weight (where the bf16 int4 path is off by ~1e-2), its embedding
lookups equal the dense copy's, a weight update writes the shared tensors, the
packed-weight cache keeps them, and tensor-parallel ranks give one rank's logits bit
for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spindle import LLM, SamplingParams
from spindle.layers import cpu_kernels, int8_head
from spindle.layers.int4 import GroupQuantized, quantize_groups
from spindle.layers.int8_head import Int8Weight
from test_gguf import gguf_file  # noqa: F401 (the fixture: the real model's GGUF file)
from test_gguf_int4 import random_codes as random_weight

QUESTIONS = ["What is the capital of France?", "Name three primary colors."]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not (cpu_kernels.switched_on() and cpu_kernels.available()):
        pytest.skip("the fused CPU kernels are not built (or SPINDLE_CPU_KERNELS=0)")


@pytest.fixture(autouse=True)
def int8_head_on(monkeypatch):
    monkeypatch.delenv(int8_head.SWITCH_ENV, raising=False)  # (the default: on)


def matmul(x, gq):
    return cpu_kernels.int8_group_matmul(x, gq.codes.to(torch.int8), gq.scale, gq.offset)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,low,high", [
    (1, 37, 64, -128, 127), (2, 259, 576, -128, 127), (5, 100, 96, 0, 15),
    (8, 1000, 576, -8, 7), (9, 83, 32, 0, 31), (13, 211, 160, -16, 15),
    (40, 150, 288, -128, 127)])
def test_the_kernel_is_the_float32_product(dtype, m, n, k, low, high):
    """Against float64 with the same inputs: off only by float32 summation, so within
    1e-5 of the sum of the products' magnitudes (the error bound of any float32 order;
    a bf16 result is off by some 4e-3 of it)."""
    gq = random_weight(n, k, low, high, seed=m * n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    y = matmul(x, gq)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    w = gq.dequantize(torch.float64)
    ref = x.double() @ w.t()
    scale = x.double().abs() @ w.abs().t()
    assert ((y.double() - ref).abs() <= 1e-5 * scale).all(), \
        float(((y.double() - ref).abs() / scale).max())
    # (the check can tell: the same result rounded to bf16 fails it)
    assert not ((y.bfloat16().double() - ref).abs() <= 1e-5 * scale).all()


def test_each_row_is_computed_alone():
    """A row's result is the same bits whatever the other rows (its sums never mix
    with theirs: batch invariant), for strided input too."""
    gq = random_weight(300, 192, -128, 127, seed=3)
    x = torch.randn(13, 2 * 192)[:, ::2]
    together = matmul(x, gq)
    for i in range(13):
        assert torch.equal(matmul(x[i:i + 1], gq), together[i:i + 1])
    assert torch.equal(matmul(x[3:11].bfloat16(), gq), matmul(x.bfloat16(), gq)[3:11])


def test_the_kernel_refuses_what_it_cannot_take():
    gq = random_weight(16, 64, -128, 127, seed=4)
    codes = gq.codes.to(torch.int8)
    with pytest.raises(RuntimeError, match="codes must be contiguous int8"):
        cpu_kernels.int8_group_matmul(torch.randn(2, 64), gq.codes, gq.scale, gq.offset)
    with pytest.raises(RuntimeError, match="x has 32 columns"):
        cpu_kernels.int8_group_matmul(torch.randn(2, 32), codes, gq.scale, gq.offset)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_kernels.int8_group_matmul(torch.randn(2, 64).half(), codes, gq.scale, gq.offset)
    with pytest.raises(RuntimeError, match="scale and offset must be"):
        cpu_kernels.int8_group_matmul(torch.randn(2, 64), codes, gq.scale.t(), gq.offset)
    assert cpu_kernels.int8_group_matmul(torch.randn(0, 64), codes, gq.scale,
                                         gq.offset).shape == (0, 16)


class Holder(nn.Module):
    def __init__(self, rows, cols, dtype=torch.bfloat16):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype), requires_grad=False)
        self.int8 = Int8Weight(self, rows, cols)


def test_the_weight_takes_rows_in_any_order_and_looks_them_up_as_dequantized():
    rows, cols = 50, 96
    full = random_weight(rows, cols, -128, 127, seed=5)
    holder = Holder(rows, cols)
    params = [holder.weight, holder.weight_group_scale, holder.weight_group_offset]
    assert [p.dtype for p in params] == [torch.int8, torch.float32, torch.float32]
    for start, length in ((30, 20), (0, 30)):
        holder.int8.write_rows(full.narrow(0, start, length), start)
    assert torch.equal(holder.int8.dequantize(), full.dequantize())
    ids = torch.tensor([[3, 49], [0, 3]])
    assert torch.equal(holder.int8.lookup(ids), full.dequantize(torch.bfloat16)[ids])
    # Another dtype in (multiplied as float32); within float32 summation of the float64
    # product, as in test_the_kernel_is_the_float32_product.
    x = torch.randn(2, 4, cols, generator=torch.Generator().manual_seed(12)).half()
    w = full.dequantize(torch.float64)
    error = (holder.int8.matmul(x).double() - x.double() @ w.t()).abs()
    assert (error <= 1e-5 * (x.double().abs() @ w.abs().t())).all()
    # A dense write: quantized as Q8_0, into the same tensors.
    dense = torch.randn(10, cols)
    holder.int8.write_rows(dense, 20)
    assert [holder.weight, holder.weight_group_scale, holder.weight_group_offset] == params
    assert torch.equal(holder.int8.dequantize()[20:30], quantize_groups(dense, 8).dequantize())
    assert torch.equal(holder.int8.dequantize()[:20], full.dequantize()[:20])
    with pytest.raises(ValueError, match="do not fit an int8 weight"):
        holder.int8.write_rows(random_weight(4, cols, 0, 255, seed=6), 0)
    with pytest.raises(ValueError, match="shape mismatch"):
        holder.int8.write_rows(random_weight(4, 64, 0, 15, seed=6), 0)
    with pytest.raises(ValueError, match="shape mismatch"):
        holder.int8.write_rows(random_weight(4, cols, 0, 15, seed=6), 48)


def test_an_untied_head_takes_its_vocabulary_shard():
    """An untied head (its own checkpoint tensor), vocabulary-parallel over 3 ranks
    (1000 rows padded to 1002): each rank loads its rows of the group-quantized tensor
    into its int8 weight, padding zero, and the ranks' logits side by side are the
    whole weight's."""
    from spindle.distributed.parallel_state import TensorParallelGroup
    from spindle.layers.embedding import ParallelLMHead

    full = random_weight(1000, 64, -128, 127, seed=11)
    x = torch.randn(3, 64).bfloat16()
    parts = []
    for rank in range(3):
        head = ParallelLMHead(1000, 64, tp_group=TensorParallelGroup(rank=rank, size=3))
        head.use_int4_weight()
        assert head.int8 is not None and head.int4 is None and not head.tied
        assert {name: p.dtype for name, p in head.named_parameters()} == {
            "weight": torch.int8, "weight_group_scale": torch.float32,
            "weight_group_offset": torch.float32}
        assert head.weight_group_scale.loaded_with == "weight"
        head.weight.weight_loader(head.weight, full)
        parts.append(head.int8.matmul(x))
        if rank == 2:  # (its last two rows are padding)
            assert not head.weight[-2:].any() and not head.weight_group_scale[-2:].any()
    assert [p.shape[1] for p in parts] == [334] * 3
    assert torch.equal(torch.cat(parts, dim=1)[:, :1000], matmul(x, full))


# ---- the real model ---------------------------------------------------------------------------
def head_parts(llm):
    model = llm.engine.core.executor.worker.runner.model
    return model, model.lm_head, model.model.embed_tokens


def file_embedding(gguf_file):
    from transformers import AutoConfig

    from spindle.config import model_directory
    from spindle.models.gguf_weights import GGUFWeights

    config = AutoConfig.from_pretrained(str(model_directory(gguf_file)))
    gq = GGUFWeights(gguf_file, config).read("model.embed_tokens.weight", torch.float32)
    assert isinstance(gq, GroupQuantized)  # (Q8_0)
    return gq.dequantize(torch.float64)


def test_the_real_heads_logits_are_float32_precise(gguf_file, monkeypatch):
    """SmolLM2's tied Q8_0 head (the default: bf16, quantized): int8 codes shared with
    the embedding, no dense copy; its logits for bf16 hidden states are the float32
    product with the file's dequantized weight (1e-6 of the largest logit); with
    SPINDLE_CPU_INT8_HEAD=0 the head is the int4 one, bf16 logits some 1e-3..1e-2
    off. The embedding looks up the same values either way, bit for bit."""
    reference_weight = file_embedding(gguf_file)
    hidden = (torch.randn(6, 576, generator=torch.Generator().manual_seed(7)) * 2).bfloat16()
    ids = torch.tensor([0, 1, 17, 504, 49151, 3000])
    reference = hidden.double() @ reference_weight.t()
    biggest = reference.abs().max()

    def start():  # (bf16: the default where the CPU computes in bf16, pinned here)
        with LLM(str(gguf_file), device="cpu", dtype="bfloat16", max_model_len=256) as llm:
            model, head, embedding = head_parts(llm)
            names = {name for name, _ in model.named_parameters()}
            return (head, embedding, names, model.compute_logits(hidden), embedding(ids),
                    llm.generate(QUESTIONS[:1], SamplingParams(max_tokens=4), use_tqdm=False))

    head, embedding, names, logits, embedded, _ = start()
    assert head.int8 is not None and head.int4 is None and head.tied
    assert head.weight is embedding.weight and head.int8 is embedding.int8
    assert embedding.weight.dtype == torch.int8
    assert {"model.embed_tokens.weight", "model.embed_tokens.weight_group_scale",
            "model.embed_tokens.weight_group_offset"} <= names
    assert not any(name.startswith("lm_head.") for name in names)
    assert logits.dtype == torch.float32
    error = ((logits.double() - reference).abs().max() / biggest).item()
    assert error < 1e-6, error
    assert embedded.dtype == torch.bfloat16

    monkeypatch.setenv(int8_head.SWITCH_ENV, "0")
    head, embedding, names, int4_logits, dense_embedded, _ = start()
    assert head.int8 is None and head.int4 is not None and embedding.int8 is None
    int4_error = ((int4_logits.double() - reference).abs().max() / biggest).item()
    assert int4_error > 1e-3, int4_error
    assert torch.equal(embedded, dense_embedded)


@pytest.fixture(scope="module")
def two_layer_cut(gguf_file, tmp_path_factory):
    """SmolLM2's first two layers as a GGUF file (Q8_0 head and embedding, a Q4_1 and a
    Q5_0 layer), made once for the tests below (each caches into its own directory)."""
    from test_gguf import requantize

    cut = tmp_path_factory.mktemp("int8-head") / "smollm2-2-layers.gguf"
    requantize(gguf_file, cut, {"token_embd": "Q8_0", "blk.0": "Q4_1", "blk.1": "Q5_0"})
    return cut


def test_a_weight_update_writes_the_shared_int8_tensors(two_layer_cut, tmp_path, monkeypatch):
    """update_weights with a dense embedding: quantized (as Q8_0) into the same int8
    tensors, which both the lookups and the logits read; every other tensor as it was.
    Sleep level 2 then reloads the file into them (the file's bytes again)."""
    monkeypatch.setenv("SPINDLE_GGUF_CACHE", str(tmp_path / "cache"))
    cut = two_layer_cut
    new = torch.randn(49152, 576, generator=torch.Generator().manual_seed(8)) * 0.05
    hidden = torch.randn(3, 576, generator=torch.Generator().manual_seed(9)).bfloat16()
    with LLM(str(cut), device="cpu", dtype="bfloat16", max_model_len=256,
             enable_sleep_mode=True) as llm:
        model, head, embedding = head_parts(llm)
        before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
        llm.update_weights({"model.embed_tokens.weight": new})
        # (the offsets stay zero: Q8_0's, in the file and as the update is quantized)
        changed = {"model.embed_tokens.weight", "model.embed_tokens.weight_group_scale"}
        for name, (param, value) in before.items():
            assert dict(model.named_parameters())[name] is param
            assert torch.equal(param, value) == (name not in changed), name
        expected = quantize_groups(new.bfloat16(), 8).dequantize()  # (cast as any update)
        assert torch.equal(head.int8.dequantize(), expected)
        ids = torch.tensor([5, 40000])
        assert torch.equal(embedding(ids), expected[ids].bfloat16())
        reference = hidden.double() @ expected.double().t()
        logits = model.compute_logits(hidden).double()
        assert ((logits - reference).abs().max() / reference.abs().max()).item() < 1e-6
        llm.generate(QUESTIONS[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # runs
        llm.sleep(2)
        llm.wake_up()
        for name, (param, value) in before.items():
            assert dict(model.named_parameters())[name] is param and torch.equal(param, value)


def test_the_packed_cache_keeps_the_int8_head_apart(two_layer_cut, tmp_path, monkeypatch):
    """The packed-weight cache holds the int8 head's tensors and reads them back (same
    answers, nothing decoded); a start with the int4 head (SPINDLE_CPU_INT8_HEAD=0) has
    a cache file of another name, so neither reads the other's."""
    from spindle.models import packed_cache
    from spindle.models.gguf_weights import GGUFWeights

    monkeypatch.setenv("SPINDLE_GGUF_CACHE", str(tmp_path / "cache"))
    cut = two_layer_cut
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)

    def start():
        hits = []
        load = packed_cache.load
        monkeypatch.setattr(packed_cache, "load", lambda *a: hits.append(load(*a)) or hits[-1])
        with LLM(str(cut), device="cpu", max_model_len=256) as llm:
            out = llm.generate(QUESTIONS, params, use_tqdm=False)
            head = head_parts(llm)[1]
            form = "int8" if head.int8 is not None else "int4"
        monkeypatch.setattr(packed_cache, "load", load)
        return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in out], \
            hits, form

    first, hits, form = start()
    assert hits == [False] and form == "int8"
    (int8_file,) = (tmp_path / "cache").glob(f"*/{packed_cache.DIRECTORY}/*.safetensors")
    from safetensors import safe_open

    with safe_open(str(int8_file), framework="pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.int8
        assert "lm_head.weight" not in f.keys()
    decoded = []
    read_tensor = GGUFWeights.read
    monkeypatch.setattr(GGUFWeights, "read", lambda *a: decoded.append(a) or read_tensor(*a))
    second, hits, _ = start()
    assert hits == [True] and not decoded and second == first
    monkeypatch.setattr(GGUFWeights, "read", read_tensor)

    monkeypatch.setenv(int8_head.SWITCH_ENV, "0")
    _, hits, form = start()
    assert hits == [False] and form == "int4"  # (the int8 file is not this start's)
    (int4_file,) = (tmp_path / "cache").glob(f"*/{packed_cache.DIRECTORY}/*.safetensors")
    assert int4_file.name != int8_file.name


def _head_outputs(worker, hidden, ids):
    model = worker.runner.model
    head = model.lm_head
    return (head.int8 is not None, head.weight.shape[0], model.compute_logits(hidden),
            model.model.embed_tokens(ids))


def test_tensor_parallel_ranks_split_the_int8_vocabulary(two_layer_cut, tmp_path, monkeypatch):
    """TP=3 (SmolLM2's 9 heads): each rank holds a third of the vocabulary's int8 rows,
    and the gathered logits and the all-reduced embeddings equal one rank's bit for bit
    (every logit is one row's own float32 sum); greedy answers run."""
    monkeypatch.setenv("SPINDLE_GGUF_CACHE", str(tmp_path / "cache"))
    cut = two_layer_cut
    hidden = torch.randn(4, 576, generator=torch.Generator().manual_seed(10)).bfloat16()
    ids = torch.tensor([2, 30000, 49151])
    with LLM(str(cut), device="cpu", max_model_len=256) as llm:
        ((int8, rows, logits, embedded),) = llm.engine.core.executor.collective_rpc(
            _head_outputs, args=(hidden, ids))
    assert int8 and rows == 49152
    with LLM(str(cut), device="cpu", max_model_len=256, tensor_parallel_size=3) as llm:
        replies = llm.engine.core.executor.collective_rpc(_head_outputs, args=(hidden, ids))
        out = llm.generate(QUESTIONS, SamplingParams(max_tokens=6, temperature=0.0,
                                                     ignore_eos=True), use_tqdm=False)
    assert [(i8, r) for i8, r, _, _ in replies] == [(True, 16384)] * 3
    for _, _, rank_logits, rank_embedded in replies:
        assert torch.equal(rank_logits, logits)
        assert torch.equal(rank_embedded, embedded)
    assert all(len(o.outputs[0].token_ids) == 6 for o in out)
