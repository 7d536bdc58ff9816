"""Programmatic dependent launch (layers/pdl.py): where it applies, and on the GPU the
same bits with it as without it, in a chain of kernels and through the engine.

Run the GPU cases with `python -m pytest -m gpu tests/test_pdl.py` (a Hopper GPU)."""

from __future__ import annotations

import pytest
import torch

from spindle.layers import pdl


@pytest.mark.parametrize("switch,device,capability,on", [
    ("1", "cuda", (9, 0), True), ("1", "cuda", (10, 0), True), ("1", "cuda", (8, 0), False),
    ("0", "cuda", (9, 0), False), (None, "cuda", (9, 0), True), ("1", "cpu", None, False)])
def test_pdl_only_where_switched_on_and_the_gpu_has_it(monkeypatch, switch, device,
                                                      capability, on):
    if switch is None:
        monkeypatch.delenv(pdl.SWITCH_ENV, raising=False)
    else:
        monkeypatch.setenv(pdl.SWITCH_ENV, switch)
    monkeypatch.setattr(pdl, "capability", lambda d: capability)
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    assert pdl.enabled(dev) is on
    assert pdl.launch_options(dev) == ({"launch_pdl": True} if on else {})
    monkeypatch.delenv(pdl.MAX_ROWS_ENV, raising=False)
    for rows in (1, pdl.max_rows(), pdl.max_rows() + 1, 256):
        expected = on and rows <= pdl.max_rows()
        args = pdl.kernel_args(dev, rows)
        assert args["PDL"] is expected
        assert args.get("launch_pdl", False) is expected


def test_pdl_rows_bound_is_the_skinny_gemms(monkeypatch):
    """PDL pays where the decode GEMMs are the skinny Triton kernel (measured: from 16
    rows, with cuBLAS between the kernels, it was slower), so one setting,
    SPINDLE_SKINNY_MAX_M, moves both bounds; a value the kernel cannot take is refused
    by name."""
    from spindle.layers import skinny_gemm

    assert pdl._KERNEL_MAX_ROWS == skinny_gemm.MAX_M
    monkeypatch.setattr(pdl, "capability", lambda d: (9, 0))
    monkeypatch.delenv(pdl.SWITCH_ENV, raising=False)
    dev = torch.device("cuda", 0)
    w = torch.randn(64, 256, dtype=torch.bfloat16)
    for setting, bound in ((None, pdl.DEFAULT_MAX_ROWS), ("64", 64), ("256", 256)):
        if setting is None:
            monkeypatch.delenv(pdl.MAX_ROWS_ENV, raising=False)
        else:
            monkeypatch.setenv(pdl.MAX_ROWS_ENV, setting)
        assert skinny_gemm.max_rows() == pdl.max_rows() == bound
        for rows in (bound, bound + 1):
            x = torch.randn(rows, 256, dtype=torch.bfloat16)
            assert skinny_gemm.skinny_gemm_applies(x, w) is (rows <= bound)
            assert pdl.kernel_args(dev, rows)["PDL"] is (rows <= bound)
    for bad in ("0", "257", "sixteen", "-1"):
        monkeypatch.setenv(pdl.MAX_ROWS_ENV, bad)
        with pytest.raises(ValueError, match="SPINDLE_SKINNY_MAX_M must be an integer from 1 "
                                             "to 256"):
            pdl.max_rows()


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="PDL needs compute capability 9.0")
def test_decode_kernels_in_a_graph_give_the_same_bits_with_pdl(monkeypatch):
    """A chain as a decode layer runs it at 4 rows (norm, GEMM, q/k norm and rotary, a
    split-K GEMM left unmerged, the norm that sums it with the residual, GEMM, SiLU and
    the GEMM with the SiLU fused), captured in a CUDA graph and replayed on new inputs:
    the same bits with PDL on as off."""
    from spindle.layers.fused_kernels import qk_norm_rope_, rms_norm, silu_and_mul
    from spindle.layers.linear import new_split_counters
    from spindle.layers.rotary import RotaryEmbedding
    from spindle.layers.skinny_gemm import skinny_linear

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, hidden, inter, heads, dim = 4, 1024, 3072, 8, 128

    def rand(*shape):
        return (torch.randn(shape, generator=gen, device="cuda") / 8).bfloat16()

    w_qk, w_o = rand(heads * dim, hidden), rand(hidden, heads * dim // 2)
    w_gate_up, w_down = rand(2 * inter, hidden), rand(hidden, inter)
    norm_w, q_w, k_w = rand(hidden) + 1, rand(dim) + 1, rand(dim) + 1
    rope = RotaryEmbedding(dim, 256, {"rope_type": "default", "rope_theta": 10000.0}).cuda()
    counters = new_split_counters(hidden, "cuda")
    inputs = [(rand(rows, hidden),
               torch.randint(0, 256, (rows,), generator=gen, device="cuda")) for _ in range(3)]
    x = torch.zeros(rows, hidden, dtype=torch.bfloat16, device="cuda")
    positions = torch.zeros(rows, dtype=torch.int64, device="cuda")

    def layer():
        qk = skinny_linear(rms_norm(x, norm_w, 1e-6), w_qk).view(rows, heads, dim)
        q, k = qk[:, : heads // 2], qk[:, heads // 2:]
        qk_norm_rope_(q, k, positions, rope.cos_cache, rope.sin_cache, q_w, k_w, 1e-6)
        partials = skinny_linear(q.reshape(rows, -1), w_o, counters=counters,
                                 defer_merge=True)
        h, residual = rms_norm(partials, norm_w, 1e-6, residual=x)
        up = skinny_linear(h, w_gate_up)
        return residual, silu_and_mul(up), skinny_linear(up, w_down, silu_and_mul=True)

    results = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(pdl.SWITCH_ENV, switch)
        assert pdl.enabled(x.device) == (switch == "1")  # (this Triton has PDL)
        layer()  # (compiles outside the graph)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = layer()
        results[switch] = []
        for new_x, new_positions in inputs:
            x.copy_(new_x)
            positions.copy_(new_positions)
            graph.replay()
            results[switch].append([o.clone() for o in outs])
    for off, on in zip(results["0"], results["1"]):
        for a, b in zip(off, on):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="PDL needs compute capability 9.0")
@pytest.mark.parametrize("arch", ["qwen3", "bamba"])
def test_greedy_tokens_and_logprobs_are_the_same_with_pdl(tiny_model, monkeypatch, arch):
    """Through the engine (decode in CUDA graphs, eager prefill): attention and Mamba
    layers give the same tokens and log-probs with PDL on as off."""
    from spindle import LLM, SamplingParams

    path = tiny_model(arch=arch, max_position_embeddings=2048)
    prompts = [[(7 * i + 3 * j) % 200 + 5 for j in range(n)] for i, n in
               enumerate((1, 9, 33, 120))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    results = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(pdl.SWITCH_ENV, switch)
        assert pdl.enabled(torch.device("cuda")) == (switch == "1")
        llm = LLM(str(path), dtype="bfloat16", device="cuda", max_model_len=1024,
                  max_num_seqs=8)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.shutdown()
        results[switch] = [(o.outputs[0].token_ids,
                            [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
                           for o in outs]
    assert results["0"] == results["1"]
