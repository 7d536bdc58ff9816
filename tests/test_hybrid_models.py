"""Models with state-space layers (Bamba and Granite 4.0's GraniteMoeHybrid: Mamba2
layers beside attention; NemotronH: Mamba2, attention and MLP layers each on its own;
FalconH1: attention and Mamba2 side by side in every layer; LFM2 and LFM2-MoE: gated short
convolutions beside attention; Qwen3-Next, Qwen3.5 and Qwen3.5-MoE: Gated DeltaNet beside
gated attention; OLMo Hybrid: Gated DeltaNet beside OLMo 3 attention; KimiLinear: Kimi
delta attention (a decay per key feature) beside latent attention; Jamba: Mamba1
beside attention; Zamba2: Mamba2 layers, some after a shared transformer block; Mamba,
FalconMamba (Mamba1) and Mamba2: nothing but state-space layers,
so a cache of state slots and no paged blocks) end to
end against the oracle: spindle's greedy tokens and logprobs equal transformers' generate on tiny
random checkpoints, in float32 on CPU, under the regimes that cut the work
differently (chunked prefill, prefix-cache hits served by state snapshots,
preemption, async scheduling off), tensor parallelism and sleep mode."""

from __future__ import annotations

import random
import zlib

import pytest

from spindle import LLM, SamplingParams
from test_generate_vs_hf import hf_float32_noise, hf_greedy

MAX_NEW = 12
LOGPROB_TOL = 1e-4
PROMPT_LENGTHS = [1, 3, 7, 16, 17, 33, 70]
QWEN3_NEXT_ODD_HEADS = dict(hidden_size=48, num_layers=4, num_heads=3, num_kv_heads=1,
                           linear_num_key_heads=1, linear_num_value_heads=3,
                           linear_key_head_dim=8, linear_value_head_dim=16,
                           linear_conv_kernel_dim=3)
QWEN3_NEXT_SHAPES = {
    "default": {},
    "groups2": dict(num_layers=3, tie_word_embeddings=True, linear_num_value_heads=8,
                    linear_value_head_dim=8),
    "odd-heads": dict(QWEN3_NEXT_ODD_HEADS, decoder_sparse_step=2, attention_bias=True,
                      partial_rotary_factor=0.5),
}
SHAPES = {
    "bamba": {
        "default": {},
        "groups2": dict(num_layers=3, mamba_n_groups=2, mamba_chunk_size=8),
        "odd-heads": dict(hidden_size=48, num_layers=4, attn_layer_indices=(0, 3),
                          mamba_n_heads=3, mamba_n_groups=3, mamba_d_state=8,
                          mamba_chunk_size=4, mamba_d_conv=3),
    },
    "nemotron_h": {
        "default": {},
        # (Nemotron 3's layer kinds: experts between Mamba2 and attention layers.)
        "groups2": dict(num_layers=4, n_groups=2, chunk_size=8,
                        layers_block_type=("linear_attention", "moe", "full_attention",
                                           "moe")),
        "odd-heads": dict(hidden_size=48, num_layers=5, num_heads=3, num_kv_heads=1,
                          n_groups=3, ssm_state_size=8, chunk_size=4, conv_kernel=3,
                          mlp_bias=True, use_conv_bias=False, use_bias=True),
    },
    # Granite 4.0: Bamba's layout with Granite's multipliers (tiny_model's defaults); a
    # mixture of experts beside the shared MLP; whole-head rotary, a tied head, biases.
    "granite_hybrid": {
        "default": {},
        "groups2": dict(num_layers=3, mamba_n_groups=2, mamba_chunk_size=8,
                        num_local_experts=4, num_experts_per_tok=2),
        "odd-heads": dict(hidden_size=48, num_layers=4, num_heads=3, num_kv_heads=1,
                          layer_types=("attention", "mamba", "mamba", "attention"),
                          mamba_n_heads=3, mamba_n_groups=3, mamba_d_state=8,
                          mamba_chunk_size=4, mamba_d_conv=3, position_embedding_type="rope",
                          tie_word_embeddings=True, attention_bias=True),
    },
    # FalconH1: attention and the mixer side by side in every layer, tiny_model's
    # multipliers away from 1; the mixer's three ways to meet its gate: the norm first
    # (default), the gate first (groups2), no norm (odd-heads).
    "falcon_h1": {
        "default": {},
        "groups2": dict(num_layers=3, mamba_n_groups=2, mamba_chunk_size=8,
                        mamba_norm_before_gate=False),
        "odd-heads": dict(hidden_size=48, num_layers=3, num_heads=3, num_kv_heads=1,
                          mamba_n_heads=3, mamba_d_ssm=96, mamba_n_groups=3, mamba_d_state=8,
                          mamba_chunk_size=4, mamba_d_conv=3, mamba_rms_norm=False,
                          mamba_proj_bias=True, projectors_bias=True, attention_bias=True,
                          mlp_bias=True, mamba_conv_bias=False, tie_word_embeddings=True),
    },
    # LFM2: gated short convolutions (a state of the last inputs only) and attention
    # with per-head q/k norms. (No B/C groups here: "groups2" is the shape the chunked
    # prefill and TP tests take, with a tied head and conv biases.)
    "lfm2": {
        "default": {},
        "groups2": dict(num_layers=3, tie_word_embeddings=True, conv_bias=True),
        "odd-heads": dict(hidden_size=48, num_layers=3, num_heads=3, num_kv_heads=1,
                          conv_L_cache=4, block_auto_adjust_ff_dim=False,
                          layer_types=("full_attention", "conv", "conv")),
    },
    # LFM2-MoE: LFM2 with experts (sigmoid routing with an expert bias, scaled) after
    # its dense layers.
    "lfm2_moe": {
        "default": {},
        "groups2": dict(num_layers=3, use_expert_bias=False, norm_topk_prob=False,
                        tie_word_embeddings=True),
        "odd-heads": dict(hidden_size=48, num_layers=4, num_heads=3, num_kv_heads=1,
                          num_dense_layers=2, num_experts=6, num_experts_per_tok=3),
    },
    # Qwen3-Next: Gated DeltaNet layers (the gated delta rule, float32 states) and gated
    # attention with a partial rotary, Gemma-style norms; experts with a shared expert
    # (every layer by default, every other layer in odd-heads).
    "qwen3_next": QWEN3_NEXT_SHAPES,
    # Qwen3.5: Qwen3-Next's layers with the linear attention's projections apart, a dense
    # MLP (Qwen3.5) or experts in every layer (Qwen3.5-MoE, stacked in the checkpoint);
    # a multimodal rotary section that text leaves the plain rotary embedding.
    "qwen3_5": {
        "default": {},
        "groups2": QWEN3_NEXT_SHAPES["groups2"],
        "odd-heads": dict(QWEN3_NEXT_ODD_HEADS,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.5,
                                           "mrope_section": [2, 1, 1],
                                           "mrope_interleaved": True}),
    },
    "qwen3_5_moe": {
        "default": {},
        "groups2": dict(num_layers=3, tie_word_embeddings=True),
        "odd-heads": dict(hidden_size=48, num_layers=3, num_heads=3, num_kv_heads=1,
                          linear_num_key_heads=3, linear_num_value_heads=3,
                          linear_key_head_dim=8, linear_value_head_dim=8,
                          num_experts=6, num_experts_per_tok=3),
    },
    # OLMo Hybrid: Gated DeltaNet layers with separate projections and beta doubled (but
    # odd-heads), pre-norm; OLMo 3 attention, post-norm, q/k normalised over their whole
    # width, rotary (none in odd-heads, as the released checkpoints).
    "olmo_hybrid": {
        "default": {},
        "groups2": dict(num_layers=3, tie_word_embeddings=True),
        "odd-heads": dict(QWEN3_NEXT_ODD_HEADS, linear_allow_neg_eigval=False,
                          layer_types=("full_attention", "linear_attention",
                                       "linear_attention", "full_attention"),
                          rope_parameters={"rope_type": "default", "rope_theta": None}),
    },
    # KimiLinear: Kimi delta attention (the gated delta rule, a decay per key feature,
    # low-rank decay and output gate), latent attention without positions, a dense first
    # layer then experts in groups; low-rank queries and two shared experts in groups2;
    # in odd-heads, latent attention first and last, experts everywhere, one group of 3.
    "kimi_linear": {
        "default": {},
        "groups2": dict(num_layers=3, q_lora_rank=24, n_shared_experts=2),
        "odd-heads": dict(hidden_size=48, num_layers=4, num_heads=3, linear_head_dim=8,
                          linear_conv_kernel_dim=3,
                          layer_types=("full_attention", "linear_attention",
                                       "linear_attention", "full_attention"),
                          mlp_layer_types=("sparse",) * 4, n_group=1, num_local_experts=3),
    },
    # Jamba: Mamba1 layers (a state per channel, its own decay per state element; norms on
    # dt, B and C), attention without positions, experts in every other layer.
    "jamba": {
        "default": {},
        "groups2": dict(num_layers=3, tie_word_embeddings=True),
        "odd-heads": dict(hidden_size=48, num_layers=4, num_heads=3, num_kv_heads=1,
                          attn_layer_period=3, attn_layer_offset=0, expert_layer_offset=0,
                          num_experts=3, mamba_d_state=8, mamba_d_conv=3, mamba_dt_rank=5,
                          mamba_proj_bias=True, mamba_conv_bias=False),
    },
    # Mamba and FalconMamba: Mamba1 mixers only (FalconMamba's dt, B and C normalised
    # without weights), the SSM state in float32; biases, a float32 residual or not.
    "mamba": {
        "default": {},
        "groups2": dict(num_layers=3, tie_word_embeddings=True),
        "odd-heads": dict(hidden_size=48, num_layers=3, state_size=8, conv_kernel=3,
                          time_step_rank=7, use_bias=True, use_conv_bias=False,
                          residual_in_fp32=False),
    },
    "falcon_mamba": {
        "default": {},
        "groups2": dict(num_layers=3, tie_word_embeddings=True, mixer_rms_eps=1e-3),
        "odd-heads": dict(hidden_size=48, num_layers=3, state_size=8, conv_kernel=3,
                          time_step_rank=3, use_bias=True),
    },
    # Zamba2: Mamba2 layers, every other one first running one of the shared transformer
    # blocks on [x, embeddings] (two blocks with per-position adapters and rotary by
    # default; one block, biases and no rotary in groups2; attention without adapters,
    # grouped KV heads and a hybrid first layer in odd-heads).
    "zamba2": {
        "default": dict(num_layers=4),
        "groups2": dict(num_layers=5, mamba_ngroups=2, chunk_size=8, num_mem_blocks=1,
                        use_mem_rope=False, add_bias_linear=True, hidden_act="silu",
                        tie_word_embeddings=False),
        "odd-heads": dict(hidden_size=48, num_layers=4, num_heads=3, num_key_value_heads=1,
                          n_mamba_heads=3, mamba_ngroups=3, mamba_d_state=8,
                          chunk_size=4, mamba_d_conv=3, use_shared_attention_adapter=False,
                          hidden_act="gelu_pytorch_tanh",
                          layers_block_type=("hybrid", "linear_attention", "hybrid",
                                             "hybrid")),
    },
    "mamba2": {
        "default": {},
        "groups2": dict(num_layers=3, n_groups=2, chunk_size=8),
        "odd-heads": dict(hidden_size=48, num_layers=3, num_heads=3, n_groups=3,
                          state_size=8, chunk_size=4, conv_kernel=3, tie_word_embeddings=True),
    },
}
ARCHS = list(SHAPES)
PURE_STATE_SPACE = ("mamba", "falcon_mamba", "mamba2")


def prompts_for(seed: int, shared_prefix: int = 0, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(vocab) for _ in range(max(1, n - shared_prefix))]
            for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(tiny_model):
    cache = {}

    def get(arch: str, shape: str, shared_prefix: int = 0):
        key = (arch, shape, shared_prefix)
        if key not in cache:
            path = tiny_model(arch, **SHAPES[arch][shape])
            # (A seed of the case's own, not of the order the cases run in: the prompts,
            # and any near-tie among them, stay the same whichever tests are selected.)
            seed = zlib.crc32(f"{arch}/{shape}/{shared_prefix}".encode())
            prompts = prompts_for(seed=seed, shared_prefix=shared_prefix)
            cache[key] = (path, prompts, Expected(path, prompts, hf_greedy(path, prompts,
                                                                           MAX_NEW)))
        return cache[key]

    return get


def generate(path, prompts, repeat: int = 1, **engine_kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    kwargs = dict(dtype="float32", device="cpu", max_model_len=256, seed=0)
    kwargs.update(engine_kwargs)
    with LLM(str(path), **kwargs) as llm:
        runs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(repeat)]
        core = llm.engine.core
        stats = (core.scheduler.num_preemptions, core.scheduler.prefix_cache_stats.hits,
                 core.kv_config)
    return [[(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                        o.outputs[0].token_ids)])
             for o in outputs] for outputs in runs], stats


class Expected(list):
    """transformers' greedy (tokens, logprobs) per prompt, with the logprob tolerance
    of a comparison against them: LOGPROB_TOL, or twice transformers' own float32
    noise on this model where that is more. (Transformers' chunked Gated DeltaNet is
    up to 1.7e-4 away from a float64 run on these tiny models, Mamba and attention
    layers about 1e-5; spindle's float32 was 1.0e-4 from transformers' and 1.1e-4 from
    float64 on a Qwen3-Next case where transformers was 0.9e-4 from it.)"""

    def __init__(self, path, prompts, results) -> None:
        super().__init__(results)
        self.tol = max(LOGPROB_TOL, 2 * hf_float32_noise(path, prompts, results))


def assert_equal(expected, got):
    tol = getattr(expected, "tol", LOGPROB_TOL)
    for (hf_tokens, hf_lps), (tokens, lps) in zip(expected, got):
        assert list(tokens) == hf_tokens
        assert max(abs(a - b) for a, b in zip(hf_lps, lps)) < tol


@pytest.mark.parametrize("arch,shape", [(a, s) for a in ARCHS for s in SHAPES[a]])
def test_greedy_equals_transformers(reference, arch, shape):
    path, prompts, expected = reference(arch, shape)
    (got,), (_, _, kv) = generate(path, prompts)
    assert kv.num_state_slots > 0
    assert (kv.num_blocks > 0) == (arch not in PURE_STATE_SPACE)  # (nothing paged)
    assert_equal(expected, got)


@pytest.mark.parametrize("arch", ARCHS)
def test_small_chunked_prefill_budget_carries_the_state(reference, arch):
    path, prompts, expected = reference(arch, "groups2")
    (got,), _ = generate(path, prompts, max_num_batched_tokens=8, max_num_seqs=4)
    assert_equal(expected, got)


def test_preemption_recomputes_the_state(reference):
    """(Bamba only: a model with nothing paged never runs out of cache, its state
    slots are sized for max_num_seqs running sequences.)"""
    path, prompts, expected = reference("bamba", "default")
    # Room for about two long sequences at a time: requests preempt each other.
    (got,), (preemptions, _, kv) = generate(path, prompts, block_size=4, max_model_len=96,
                                           kv_cache_memory_bytes=100_000, max_num_seqs=4)
    assert kv.num_blocks < 2 * 24
    assert preemptions > 0
    assert_equal(expected, got)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_hits_start_from_state_snapshots(reference, arch):
    path, prompts, expected = reference(arch, "default", shared_prefix=20)
    (first, second), (_, hits, kv) = generate(path, prompts, repeat=2, block_size=4)
    assert hits > 0
    assert_equal(expected, first)
    assert_equal(expected, second)


@pytest.mark.parametrize("arch", ARCHS)
def test_without_async_scheduling(reference, arch):
    path, prompts, expected = reference(arch, "odd-heads")
    (got,), _ = generate(path, prompts, async_scheduling=False)
    assert_equal(expected, got)


@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_parallel_equals_transformers(reference, arch):
    path, prompts, expected = reference(arch, "groups2")
    (got,), _ = generate(path, prompts, tensor_parallel_size=2)
    assert_equal(expected, got)


@pytest.mark.parametrize("arch,level", [("bamba", 1), ("bamba", 2), ("nemotron_h", 2),
                                        ("granite_hybrid", 1), ("falcon_h1", 2),
                                        ("lfm2", 1), ("lfm2_moe", 2), ("qwen3_next", 1),
                                        ("qwen3_5", 2), ("qwen3_5_moe", 1), ("jamba", 1),
                                        ("olmo_hybrid", 2), ("kimi_linear", 1),
                                        ("kimi_linear", 2), ("mamba", 1),
                                        ("falcon_mamba", 2), ("mamba2", 2),
                                        ("zamba2", 2)])
def test_sleep_and_wake_keep_the_output(reference, arch, level):
    path, prompts, expected = reference(arch, "default")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(str(path), dtype="float32", device="cpu", max_model_len=256,
             enable_sleep_mode=True) as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.sleep(level=level)
        llm.wake_up()
        after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert before == after == [tokens for tokens, _ in expected]


def test_a_follow_up_turn_hits_the_state_its_decode_left(tiny_model):
    """A second turn (first prompt + answer + more) hits past the first prompt: the
    decode steps left snapshots at block boundaries (with async scheduling, whose
    decode inputs are registered once sampled); its tokens stay transformers'."""
    path = tiny_model("bamba")
    first = prompts_for(seed=9)[4]  # 17 tokens
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(str(path), dtype="float32", device="cpu", max_model_len=256, block_size=4) as llm:
        assert llm.engine.core.async_scheduling
        answer = list(llm.generate([first], params, use_tqdm=False)[0].outputs[0].token_ids)
        second = first + answer + [5, 6, 7]
        stats = llm.engine.core.scheduler.prefix_cache_stats
        hits_before = stats.hits
        got = list(llm.generate([second], params, use_tqdm=False)[0].outputs[0].token_ids)
        hit = stats.hits - hits_before
    # 17 + 12 = 29 tokens went through the model; the state at 28 was kept.
    assert hit == 28
    assert got == hf_greedy(path, [second], MAX_NEW)[0][0]


def test_no_snapshot_slots_turns_prefix_caching_off_with_a_warning(reference):
    import logging

    path, prompts, expected = reference("bamba", "default")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    engine_logger = logging.getLogger("spindle.engine.engine_core")  # ("spindle" does not
    engine_logger.addHandler(handler)                               # propagate to root)
    try:
        (first, second), (_, hits, kv) = generate(path, prompts, repeat=2,
                                                  state_snapshot_slots=0)
    finally:
        engine_logger.removeHandler(handler)
    assert hits == 0 and kv.num_state_slots == 256  # one per sequence (max_num_seqs)
    assert any("prefix caching is off" in r.getMessage() for r in records)
    assert_equal(expected, first)
    assert_equal(expected, second)


def test_a_bad_snapshot_count_is_refused(reference):
    path, _, _ = reference("bamba", "default")
    with pytest.raises(ValueError, match="state_snapshot_slots"):
        LLM(str(path), device="cpu", state_snapshot_slots=-1)


def test_a_model_without_positions_takes_prompts_of_any_length(tiny_model, tmp_path):
    """Mamba's config names no max_position_embeddings (transformers' has none): its
    length is not capped at a default of 2048, and a longer prompt equals transformers."""
    import json
    import shutil

    from spindle.models.mamba2 import NO_POSITIONS_LIMIT

    path = shutil.copytree(tiny_model("mamba"), tmp_path / "mamba")
    config = json.loads((path / "config.json").read_text())
    del config["max_position_embeddings"]  # (tiny_model writes one for every family)
    (path / "config.json").write_text(json.dumps(config))
    prompt = prompts_for(seed=3, vocab=500)[-1] * 31  # 2,170 tokens
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(str(path), dtype="float32", device="cpu") as llm:
        assert llm.config.model.max_model_len == NO_POSITIONS_LIMIT
        got = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    assert got == hf_greedy(path, [prompt], 4)[0][0]
