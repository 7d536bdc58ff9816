"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral, MiniMax-M2) against transformers on
tiny random checkpoints (CPU, float32): greedy tokens equal and logprobs within 1e-4,
under the default config, a small chunked-prefill budget and tensor parallelism (experts
split across two ranks), and with Qwen3-MoE's dense layers and routing options. MiniMax-M2
also: sigmoid routing with a correction bias, q/k normalised over their whole width (the
sums of squares all-reduced under TP), half of each head rotated. GLM-4.5: a dense
first layer, DeepSeek-V3 routing (groups, a correction bias, scaling) with a shared expert,
biases on q/k/v only, per-head q/k norms, half of each head rotated. DeepSeek-V3: that MoE
behind multi-head latent attention, served from a cached latent (the absorbed form).
gpt-oss: attention sinks, alternating windows, biased experts with a clamped SwiGLU, and
its released MXFP4 expert weights. Hunyuan-A13B: a float32 router, a shared MLP in every
layer, top-k given per layer. Phi-3.5-MoE: sparsemixer routing, LayerNorms, biases, and
LongRoPE past its original length."""

from __future__ import annotations

import random

import pytest
import torch

from spindle import LLM, SamplingParams
from test_generate_vs_hf import hf_greedy

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
CASES = {
    "qwen3_moe": {},
    "qwen3_moe-dense-layer-top1-unnormalised": dict(arch="qwen3_moe", mlp_only_layers=(1,),
                                                    num_experts_per_tok=1,
                                                    norm_topk_prob=False),
    "qwen3_moe-sparse-every-second-layer": dict(arch="qwen3_moe", decoder_sparse_step=2,
                                                num_experts=6, num_experts_per_tok=3),
    # Qwen2-MoE: Qwen2's attention biases, a sigmoid-gated shared expert beside the routed
    # ones, unnormalised top-k (then every other layer sparse, renormalised).
    "qwen2_moe": {},
    "qwen2_moe-sparse-every-second-layer": dict(arch="qwen2_moe", num_layers=4,
                                                decoder_sparse_step=2, norm_topk_prob=True),
    # OLMoE: q/k normalised over their whole width, q/k/v clamped, Qwen-style routing.
    "olmoe": dict(num_layers=3),
    # dots.llm1: Qwen3's attention with DeepSeek-V3's experts.
    "dots1": dict(num_layers=3),
    # ERNIE 4.5 MoE: a dense first layer, a correction bias for the choice, renormalised
    # float32 probabilities, a shared expert; interleaved rotary pairs.
    "ernie4_5_moe": dict(num_layers=3),
    # Hunyuan-A13B: Hunyuan's attention (q/k normed after the rotation), a float32 router,
    # renormalised top-k weights, a shared MLP beside the experts; then top-k per layer.
    "hunyuan_moe": dict(num_layers=2),
    "hunyuan_moe-top_k-per-layer": dict(arch="hunyuan_moe", num_layers=2, num_experts=6,
                                        moe_topk=[1, 3]),
    "mixtral": {},
    # Phi-3.5-MoE: sparsemixer's two experts, LayerNorms, biases everywhere, LongRoPE
    # with a scale per table (within its original length, 64); then a window of 8.
    "phimoe": {},
    "phimoe-window": dict(arch="phimoe", sliding_window=8),
    "minimax_m2": {},
    "glm4_moe": {},
    # DeepSeek-V3: GLM-4.5's experts behind multi-head latent attention (queries through
    # a low-rank pair, interleaved rotary); then without the pair, rotate-half rotary,
    # biases and YaRN with mscale_all_dim (a softmax scale and a cos/sin factor).
    "deepseek_v3": {},
    "deepseek_v3-yarn": dict(arch="deepseek_v3", q_lora_rank=None, rope_interleave=False,
                             attention_bias=True,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                              "factor": 4.0, "mscale": 1.0,
                                              "mscale_all_dim": 0.8,
                                              "original_max_position_embeddings": 512,
                                              "beta_fast": 32, "beta_slow": 1}),
    # DeepSeek-V2: the same attention (complex-number rotary in transformers), softmax
    # routing limited to the best group, or greedy, and the low-rank query pair.
    "deepseek_v2": {},
    "deepseek_v2-greedy": dict(arch="deepseek_v2", topk_method="greedy", q_lora_rank=24),
    # gpt-oss: attention sinks, a window of 8 on every other layer, biased experts with the
    # clamped SwiGLU, a router with a bias (YaRN rotary).
    "gpt_oss": dict(num_layers=3),
    "granite_moe": {},  # (Granite 3.x: the experts stacked, Granite's multipliers)
    "granite_moe_shared": {},  # (and a shared SwiGLU MLP beside the experts)
    # (and windows, attention sinks, a rotary base per layer: transformers' own names,
    # which transformers 5.25 reads for this model, unlike the hub's)
    "granite_moe_swa": dict(num_layers=4),
}


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(512) for _ in range(n)] for n in (3, 17, 40, 9)]


def check(llm: LLM, expected, asked: list[list[int]] | None = None) -> None:
    """llm's greedy answers to asked (default: prompts()) are expected's."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in asked or prompts()], GREEDY,
                           use_tqdm=False)
    for output, (tokens, logprobs) in zip(outputs, expected):
        answer = output.outputs[0]
        assert answer.token_ids == tokens
        got = [d[t].logprob for d, t in zip(answer.logprobs, tokens)]
        assert got == pytest.approx(logprobs, abs=1e-4)


@pytest.fixture(scope="module")
def checkpoint(tiny_model):
    made = {}

    def get(case: str):
        if case not in made:
            kwargs = dict(CASES[case])
            arch = kwargs.pop("arch", case)
            path = tiny_model(arch, **kwargs)
            made[case] = path, hf_greedy(path, prompts(), MAX_NEW)
        return made[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_transformers(checkpoint, case):
    path, expected = checkpoint(case)
    assert len({tuple(t) for t, _ in expected}) > 1  # (distinct answers: routing matters)
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=256) as llm:
        check(llm, expected)


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral", "minimax_m2", "glm4_moe",
                                  "granite_moe_shared", "deepseek_v3-yarn", "gpt_oss",
                                  "deepseek_v2", "qwen2_moe", "olmoe", "granite_moe_swa",
                                  "dots1", "ernie4_5_moe", "hunyuan_moe", "phimoe-window"])
def test_chunked_prefill_and_two_tensor_parallel_ranks(checkpoint, case):
    path, expected = checkpoint(case)
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=256,
             max_num_batched_tokens=8) as llm:
        check(llm, expected)
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=256,
             tensor_parallel_size=2) as llm:
        check(llm, expected)


def test_experts_that_do_not_split_across_ranks_are_refused(tiny_model):
    path = tiny_model("qwen3_moe", moe_intermediate_size=33)
    with pytest.raises(Exception, match="moe intermediate size"):
        LLM(str(path), device="cpu", dtype="float32", max_model_len=256,
            tensor_parallel_size=2)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral", "minimax_m2", "glm4_moe",
                                  "deepseek_v3", "gpt_oss", "qwen2_moe", "hunyuan_moe",
                                  "phimoe"])
def test_cuda_fused_experts_in_cuda_graphs_equal_transformers(checkpoint, case):
    """The fused grouped GEMMs end to end on CUDA (float32, decode replayed from CUDA
    graphs), against transformers on the CPU."""
    path, expected = checkpoint(case)
    with LLM(str(path), device="cuda", dtype="float32", max_model_len=256,
             max_num_batched_tokens=16) as llm:
        check(llm, expected)
        graphs = llm.engine.core.executor.worker.runner.graph_runner
        assert graphs is not None and sum(graphs.num_replays.values()) > 0


def test_minimax_m2_stacked_experts_load_too(checkpoint, tmp_path):
    """tiny_model writes the hub's block_sparse_moe.experts.E.w1 / w3 / w2; transformers'
    own modules keep mlp.experts.gate_up_proj / down_proj, stacked."""
    from checkpoint_utils import rewritten_checkpoint, stacked_experts

    path, expected = checkpoint("minimax_m2")

    def stacked(tensors):
        out = {name.replace(".block_sparse_moe.", ".mlp."): t for name, t in
               stacked_experts(tensors, "w1", "w3", "w2", block="block_sparse_moe").items()}
        assert "model.layers.0.mlp.experts.gate_up_proj" in out
        return out

    with LLM(str(rewritten_checkpoint(path, tmp_path / "stacked", stacked)), device="cpu",
             dtype="float32", max_model_len=256) as llm:
        check(llm, expected)


@pytest.mark.parametrize("case", ["glm4_moe", "deepseek_v3"])
def test_multi_token_prediction_layers_are_not_loaded(checkpoint, tmp_path, case):
    """GLM-4.5 and DeepSeek-V3 checkpoints store their MTP layer after the model's layers
    (model.layers.<num_hidden_layers>.*)."""
    import json

    from checkpoint_utils import rewritten_checkpoint

    path, expected = checkpoint(case)
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]

    def with_mtp(tensors):
        last = f"model.layers.{layers - 1}."
        extra = {f"model.layers.{layers}." + name[len(last):]: t.clone()
                 for name, t in tensors.items() if name.startswith(last)}
        extra[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(64, 128)
        return {**tensors, **extra}

    with LLM(str(rewritten_checkpoint(path, tmp_path / "mtp", with_mtp)), device="cpu",
             dtype="float32", max_model_len=256) as llm:
        check(llm, expected)


def test_deepseek_v3_caches_the_latent_once_and_survives_sleep(checkpoint):
    """Latent attention's cache holds its keys only (they are its values too): one plane
    of kv_lora_rank + qk_rope_head_dim per token and layer, the layer reading it as
    both; the output stays transformers' across sleep at level 1 and 2."""
    path, expected = checkpoint("deepseek_v3")
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=256,
             enable_sleep_mode=True) as llm:
        runner = llm.engine.core.executor.worker.runner
        pages = runner.kv_caches[0]
        assert pages.shape[0] == 1 and pages.shape[-2:] == (1, 32 + 8)
        layer = runner.cache_layout.group_layers[0][0]
        assert layer.kv_cache.shape[0] == 2 and layer.kv_cache.stride(0) == 0
        assert layer.kv_cache.data_ptr() == pages.data_ptr()
        check(llm, expected)
        for level in (1, 2):
            llm.sleep(level=level)
            llm.wake_up()
            check(llm, expected)


def test_latent_attention_refuses_values_other_than_its_keys():
    from spindle.attention import Attention

    attn = Attention(2, 8, 0.3, 1, values_are_keys=True)
    k = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="pass v = k"):
        attn(torch.zeros(3, 16), k, k.clone())


def _mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., K] -> MXFP4 (blocks uint8 [..., K / 32, 16], scales uint8 [..., K / 32]):
    per 32 values the power of two that brings the largest to at most 6, each value the
    nearest e2m1 code (the low nibble first)."""
    from spindle.models.gpt_oss import FP4_VALUES

    groups = weight.float().reshape(*weight.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(FP4_VALUES[:8])
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) + 8 * (scaled < 0)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def test_gpt_oss_mxfp4_experts_load_dequantized(tiny_model, tmp_path):
    """The released checkpoints keep the experts' weights as MXFP4 blocks and scales:
    spindle on such a checkpoint equals transformers on the same weights dequantized
    (written as a plain checkpoint), tokens and logprobs."""
    import json

    from checkpoint_utils import rewritten_checkpoint
    from spindle.models.gpt_oss import mxfp4_dequantize

    path = tiny_model("gpt_oss", num_layers=3, hidden_size=64, intermediate_size=64)
    packed = {}

    def quantized(tensors):  # gate_up_proj [E, H, 2I], down_proj [E, I, H]: per output row
        out = {}
        for name, tensor in tensors.items():
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                blocks, scales = _mxfp4(tensor.transpose(1, 2))
                packed[name] = mxfp4_dequantize(blocks, scales,
                                                torch.float32).transpose(1, 2).contiguous()
                out[name + "_blocks"], out[name + "_scales"] = blocks, scales
            else:
                out[name] = tensor
        return out

    mxfp4 = rewritten_checkpoint(path, tmp_path / "mxfp4", quantized)
    config = json.loads((mxfp4 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (mxfp4 / "config.json").write_text(json.dumps(config))
    original = {}
    plain = rewritten_checkpoint(path, tmp_path / "plain",
                                 lambda t: original.update(t) or {**t, **packed})
    # (the codes round: the plain checkpoint is another model than the one quantized)
    assert any(not torch.equal(packed[name], original[name]) for name in packed)
    expected = hf_greedy(plain, prompts(), MAX_NEW)
    with LLM(str(mxfp4), device="cpu", dtype="float32", max_model_len=256) as llm:
        check(llm, expected)


def test_mxfp4_dequantization_equals_transformers():
    """The dequantization against transformers' own (convert_moe_packed_tensors, which
    also transposes to its [E, in, out] layout), on random codes and scales."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from spindle.models.gpt_oss import mxfp4_dequantize

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 10, 4), generator=gen, dtype=torch.uint8)
    ours = mxfp4_dequantize(blocks, scales).transpose(1, 2)
    theirs = convert_moe_packed_tensors(blocks, scales)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours, theirs)


def test_hunyuan_moe_refuses_experts_of_another_size():
    from types import SimpleNamespace

    from spindle.models.hunyuan import HunYuanMoEV1ForCausalLM

    config = SimpleNamespace(hidden_act="silu", intermediate_size=64,
                             moe_intermediate_size=[64, 32])
    with pytest.raises(ValueError, match=r"moe_intermediate_size \[64, 32\] differs"):
        HunYuanMoEV1ForCausalLM.check_config(config)
    HunYuanMoEV1ForCausalLM.check_config(SimpleNamespace(hidden_act="silu",
                                                         intermediate_size=64))


def _phimoe_long_factors_past_original(model) -> None:
    """transformers' PhiMoE with the long factors past the original length. Its port
    recomputes the frequencies each forward without the sequence length (always the
    short factors; only the scale switches); the model's own code, and its long_factor,
    rotate by the long ones there. This gives its rotary the length, as transformers'
    Phi-3 does; the rest (the scales, the re-encoding at the length) is its own."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = model.config
    params = config.rope_parameters
    original = params["original_max_position_embeddings"]

    def forward(x, position_ids):
        length = int(position_ids.max()) + 1
        inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, x.device, seq_len=length)
        mscale = params["long_mscale" if length > original else "short_mscale"]
        freqs = position_ids[..., None].float() * inv_freq.float()
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * mscale).to(x.dtype), (angles.sin() * mscale).to(x.dtype)

    model.model.rotary_emb.forward = forward


@pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 16},
                                           {"tensor_parallel_size": 2}],
                         ids=["default", "chunked", "tp2"])
def test_phimoe_past_its_original_length(tiny_model, engine_kwargs):
    """Phi-3.5-MoE's LongRoPE (original length 64, long_mscale apart from short_mscale):
    prompts within it, crossing it while decoding (encoded again, long) and past it from
    the start, against transformers given the long factors past the length."""
    path = tiny_model("phimoe")
    rng = random.Random(5)
    lengths = (9, 58, 64, 80)
    long_prompts = [[rng.randrange(512) for _ in range(n)] for n in lengths]
    expected = hf_greedy(path, long_prompts, MAX_NEW,
                         prepare=_phimoe_long_factors_past_original)
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=256,
             **engine_kwargs) as llm:
        assert llm.config.model.long_rope_from == 64
        check(llm, expected, long_prompts)


def test_sparsemixer_routes_as_transformers():
    """Both choices and weights, on logits with near ties (several experts inside the
    jitter margin) and far apart, negative and positive, against transformers'
    sparsemixer."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    from spindle.models.phimoe import sparsemixer_top2

    torch.manual_seed(0)
    logits = torch.cat([torch.randn(64, 8), torch.randn(64, 8) * 0.01 + 1.0,
                        -torch.rand(64, 8) - 0.5])
    for eps in (0.01, 0.3):
        weights, ids = sparsemixer(logits, jitter_eps=eps, training=False)
        our_ids, our_weights = sparsemixer_top2(logits, eps)
        assert torch.equal(our_ids, ids)
        torch.testing.assert_close(our_weights, weights, atol=0, rtol=0)
        assert (weights < 1).any()  # (the margin weighs several experts somewhere)
