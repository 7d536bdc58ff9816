"""Dense families on their own layers, against transformers on tiny random checkpoints,
CPU float32 (tokens equal, logprobs within 1e-4), with chunked prefill and two
tensor-parallel ranks: Cohere (Command R) and Cohere2 (Command R7B / A): parallel
attention and MLP after one bias-free LayerNorm, interleaved rotary pairs, the logit
scale, Cohere2's windows on two of every three layers and unrotated global layers (and
Command R+'s q/k norms, refused by name); StarCoder2: LayerNorms with biases, biased
attention within a window, a plain GELU MLP; GLM-4: sandwich norms, a half-head rotary
of interleaved pairs, the fused gate/up checkpoint tensor (GLM-4-9B of 2024: the same
without the sandwich norms); SmolLM3: Llama's layers,
every other one here without rotary (NoPE), with and without windows, and in bf16 the
CPU's fused kernels leaving the NoPE layers unrotated; GraniteSWA: Granite's scalings
with windows, attention sinks and a rotary base per layer (none on one); Seed-OSS (q/k/v
biases, none on o); ERNIE 4.5 (biases everywhere, interleaved rotary pairs); EXAONE 4.0
(OLMo 2's post-norm layers, per-head q/k norms, windows with unrotated global layers,
or no window and every layer rotating); Arcee's AFM (a relu^2 MLP without a gate);
MiniCPM3 (latent attention with the plain rotary, maximal-update scalings); Hunyuan
(q/k normed after the rotation, an NTK alpha stretching the rotary base); Helium
(interleaved rotary pairs, float32-weight RMSNorms, q/k/v biases without o's); Phi-3
with a rotary over three quarters of each head (Phi-4-mini), with LongRoPE past its original
length and windows; Apertus (an
xIELU MLP without a gate, q/k norms); Jais 2 (StarCoder2's layer shape with a relu^2
MLP); InternLM3 (Llama with biases, served as transformers serves it); EXAONE 3 (Llama
under GPT-2-style tensor names); Ministral
(Mistral with a window on every other layer); Ministral 3 (queries scaled by position
past the original length, YaRN); GPT-NeoX (Pythia): LayerNorms and biases, a quarter of
each head rotated, parallel residual layers (and sequential ones), q/k/v fused per head
in the checkpoint; Phi (phi-2): parallel attention and MLP after one LayerNorm, half of
each head rotated, per-head q/k LayerNorms (phi's option), the LM head's bias; GPT-2:
learned positions, Conv1D weights, fused c_attn, the tied head, scores scaled by the
inverse layer index (an option); GPTBigCode (StarCoder 1): GPT-2 with Linear weights and
one key/value head (or c_attn interleaved per head without multi_query); OPT: learned
positions offset by two, pre-norm layers or OPT-350M's post-norm ones with the embedding
projected in and out; GPT-J: parallel layers, interleaved rotary pairs on part of each
head, the LM head's bias (CodeGen: the same with q/v/k fused across four shards);
Falcon: multi-query parallel layers (7B), grouped-query ones
with two norms or one (40B, 180B), sequential ones with biases; GPT-Neo: GPT-2's layers
with unscaled scores, global and windowed layers in turn; OLMo (the first): weightless
LayerNorms, q/k/v clamped; Nemotron: LayerNorm1P, a half-head rotary, a squared-ReLU MLP;
StableLM: LayerNorms,
Llama's MLP and grouped-query attention with a quarter-head rotary and q/k/v biases,
sequential or parallel layers; BLOOM: ALiBi (slopes past a power of two of heads, split
across ranks), the embedding's LayerNorm, q/k/v fused per head, residuals from the
normed input (an option); MPT: ALiBi, LayerNorms and projections without biases, q/k/v
clamped and a scale of its own (options), what transformers does not build refused."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from spindle import LLM, SamplingParams
from test_generate_vs_hf import hf_greedy

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
CASES = {"cohere": dict(num_layers=3, tie_word_embeddings=True),
         "cohere-biases": dict(num_layers=2, attention_bias=True),
         "cohere2": dict(num_layers=3),
         "starcoder2": dict(num_layers=3),
         "jais2": dict(num_layers=2),
         "internlm3": dict(num_layers=2),
         "ministral": dict(num_layers=2),
         "ministral3": dict(num_layers=2),
         "glm4": dict(num_layers=3),
         "glm": dict(num_layers=2),
         "exaone": dict(num_layers=2),
         "granite_swa": dict(num_layers=4),
         "seed_oss": dict(num_layers=2),
         "arcee": dict(num_layers=2),
         "apertus": dict(num_layers=2),
         "minicpm3": dict(num_layers=3),
         "hunyuan": dict(num_layers=3),
         "ernie4_5": dict(num_layers=2),
         "helium": dict(num_layers=3),
         "llama4": dict(num_layers=4),
         # (Phi-4-mini's three quarters of each head rotated; and with LongRoPE over
         # those features, a window on each layer, and an original length of 20 that the
         # prompts of 13 tokens cross and those of 40 start past)
         "phi3-partial": dict(num_layers=2, tie_word_embeddings=True, rope_parameters={
             "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}),
         "phi3-partial_longrope": dict(
             num_layers=2, sliding_window=24, original_max_position_embeddings=20,
             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.75,
                              "short_factor": [1.0 + 0.1 * i for i in range(6)],
                              "long_factor": [1.0 + 0.9 * i for i in range(6)],
                              "original_max_position_embeddings": 20}),
         "helium-biases": dict(num_layers=2, attention_bias=True, mlp_bias=True,
                               tie_word_embeddings=True),
         "exaone4": dict(num_layers=3),
         "exaone4-global": dict(num_layers=2, sliding_window=None,
                                layer_types=["full_attention"] * 2),
         "gpt_neox": dict(num_layers=3),
         "gpt_neox-sequential": dict(num_layers=2, use_parallel_residual=False),
         "phi": dict(num_layers=3),
         "gpt2": dict(num_layers=3, tie_word_embeddings=True),
         "gpt_bigcode": dict(num_layers=3, tie_word_embeddings=True),
         "gpt_bigcode-multi_head": dict(num_layers=2, multi_query=False),
         "opt": dict(num_layers=3, tie_word_embeddings=True),
         "opt-350m": dict(num_layers=2, do_layer_norm_before=False, word_embed_proj_dim=32,
                          tie_word_embeddings=True),
         "gptj": dict(num_layers=3),
         "codegen": dict(num_layers=2),
         "falcon": dict(num_layers=3, tie_word_embeddings=True),
         "falcon-new": dict(num_layers=2, new_decoder_architecture=True, num_kv_heads=2),
         "falcon-one_norm": dict(num_layers=2, new_decoder_architecture=True, num_kv_heads=2,
                                 num_ln_in_parallel_attn=1, bias=True),
         "falcon-sequential": dict(num_layers=2, parallel_attn=False, multi_query=False,
                                   bias=True),
         "gpt_neo": dict(num_layers=3, tie_word_embeddings=True),
         "olmo": dict(num_layers=3),
         "olmo-unclipped": dict(num_layers=2, clip_qkv=None, tie_word_embeddings=True),
         "nemotron": dict(num_layers=3),
         "stablelm": dict(num_layers=3),
         "stablelm-parallel": dict(num_layers=2, use_parallel_residual=True,
                                   use_qkv_bias=False),
         "gpt2-layer_scaled": dict(num_layers=2, scale_attn_by_inverse_layer_idx=True),
         "bloom": dict(num_layers=3, tie_word_embeddings=True),
         # (six heads: ALiBi's slopes past the largest power of two; TP=2 splits them)
         "bloom-six_heads": dict(num_layers=2, num_heads=6, hidden_size=96,
                                 apply_residual_connection_post_layernorm=True),
         "mpt": dict(num_layers=3, tie_word_embeddings=True),
         # (q/k/v clamped tightly, so that the clamp acts; a scale of its own)
         "mpt-clipped": dict(num_layers=2, num_heads=6, hidden_size=96,
                             attn_config={"clip_qkv": 0.5, "softmax_scale": 0.2}),
         "phi-qk_norms": dict(num_layers=2, qk_layernorm=True, tie_word_embeddings=True),
         "smollm3": dict(num_layers=4, no_rope_layer_interval=2),
         "smollm3-windows": dict(num_layers=4, no_rope_layer_interval=2,
                                 use_sliding_window=True, sliding_window=8)}


def prompts() -> list[list[int]]:
    rng = random.Random(9)
    return [[rng.randrange(512) for _ in range(n)] for n in (2, 13, 40)]


def greedy_tokens(checkpoint) -> list[list[int]]:
    """spindle's greedy answers to prompts() (CPU, float32)."""
    with LLM(str(checkpoint), device="cpu", dtype="float32", max_model_len=256) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY,
                               use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def copy_with_config(path, dest, edit):
    """A copy of the checkpoint at path, at dest, whose config.json is edit(its dict)."""
    shutil.copytree(path, dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(edit(config)))
    return dest


def copy_with_tensors(path, dest, edit):
    """A copy of the one-file checkpoint at path, at dest, holding edit(its tensors)
    (another checkpoint's names, extra buffers): the index dropped, if any."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, dest)
    (weights_file,) = dest.glob("*.safetensors")
    save_file(edit(load_file(weights_file)), weights_file)
    index = dest / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    return dest


@pytest.fixture(scope="module", params=list(CASES))
def reference(tiny_model, request):
    kwargs = dict(CASES[request.param])
    path = tiny_model(request.param.split("-")[0], **kwargs)
    return path, hf_greedy(path, prompts(), MAX_NEW)


@pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 8},
                                           {"tensor_parallel_size": 2}],
                         ids=["default", "chunked", "tp2"])
def test_greedy_equals_transformers(reference, engine_kwargs):
    path, expected = reference
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=256,
             **engine_kwargs) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY,
                               use_tqdm=False)
    for output, (tokens, logprobs) in zip(outputs, expected):
        answer = output.outputs[0]
        assert answer.token_ids == tokens
        got = [d[t].logprob for d, t in zip(answer.logprobs, tokens)]
        assert got == pytest.approx(logprobs, abs=1e-4)


def test_command_r_plus_q_k_norms_are_refused(tiny_model, tmp_path):
    path = copy_with_config(tiny_model("cohere", **CASES["cohere"]), tmp_path / "qk-norm",
                            lambda config: {**config, "use_qk_norm": True})
    with pytest.raises(ValueError, match="use_qk_norm"):
        LLM(str(path), device="cpu", dtype="float32", max_model_len=256)


def test_smollm3_bf16_on_the_cpu_keeps_close_to_float32(tiny_model):
    """bf16 runs the fused CPU kernels (rotary inside the KV store, a decode layer per
    C++ call) on the rotating layers only: the answers start as transformers' float32
    (with every layer rotated, two of the three did not)."""
    path = tiny_model("smollm3", **CASES["smollm3"])
    expected = hf_greedy(path, prompts(), MAX_NEW)
    with LLM(str(path), device="cpu", dtype="bfloat16", max_model_len=256) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY,
                               use_tqdm=False)
    agree = [o.outputs[0].token_ids[:3] == tokens[:3] for o, (tokens, _) in zip(outputs, expected)]
    assert sum(agree) >= 2, agree


def test_helium_bf16_on_the_cpu_keeps_its_norms_and_close_to_float32(tiny_model):
    """bf16 on the CPU: Helium's float32-weight norms keep the torch path (the fused C++
    decode layer has Llama's rounding), and the answers start as transformers' float32."""
    from spindle.layers.norm import Float32WeightRMSNorm

    path = tiny_model("helium", **CASES["helium"])
    expected = hf_greedy(path, prompts(), MAX_NEW)
    with LLM(str(path), device="cpu", dtype="bfloat16", max_model_len=256) as llm:
        model = llm.engine.core.executor.worker.runner.model
        norms = [m for m in model.modules() if isinstance(m, Float32WeightRMSNorm)]
        assert len(norms) == 2 * 3 + 1
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY,
                               use_tqdm=False)
    agree = [o.outputs[0].token_ids[:3] == tokens[:3] for o, (tokens, _) in zip(outputs, expected)]
    assert sum(agree) >= 2, agree


def test_gpt_neox_reads_the_hub_names_and_skips_old_buffers(tiny_model, tmp_path):
    """Pythia's hub checkpoints name the head ``embed_out`` (transformers 5 writes
    ``lm_head``) and older ones carry the causal mask and rotary frequencies as tensors:
    the same model loads from either."""
    def hub_form(tensors):
        tensors["embed_out.weight"] = tensors.pop("lm_head.weight")
        for i in range(2):
            tensors[f"gpt_neox.layers.{i}.attention.bias"] = torch.ones(1, 1, 8, 8).bool()
            tensors[f"gpt_neox.layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
            tensors[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = torch.ones(2)
        return tensors

    path = tiny_model("gpt_neox", num_layers=2)
    hub = copy_with_tensors(path, tmp_path / "hub", hub_form)
    assert greedy_tokens(path) == greedy_tokens(hub) == [
        tokens for tokens, _ in hf_greedy(path, prompts(), MAX_NEW)]


def test_gpt_neox_refuses_what_it_would_get_wrong():
    from types import SimpleNamespace

    from spindle.models.gpt_neox import GPTNeoXForCausalLM

    def config(**fields):
        base = dict(hidden_act="gelu", hidden_size=64, num_attention_heads=4,
                    max_position_embeddings=64,
                    rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.25})
        return SimpleNamespace(**{**base, **fields})

    GPTNeoXForCausalLM.check_config(config())
    with pytest.raises(ValueError, match="hidden_act 'relu' is not supported"):
        GPTNeoXForCausalLM.check_config(config(hidden_act="relu"))
    with pytest.raises(ValueError, match="turns 3 features of each head"):
        GPTNeoXForCausalLM.check_config(config(rope_parameters={
            "rope_theta": 10000.0, "partial_rotary_factor": 0.1875}))


def test_bloom_reads_the_hub_names(tiny_model, tmp_path):
    """BLOOM's hub checkpoints name their tensors without ``transformer.`` and hold no
    ``lm_head`` (tied): the same model loads from either form."""
    def hub_form(tensors):
        tensors = {name.removeprefix("transformer."): t for name, t in tensors.items()
                   if not name.startswith("lm_head.")}
        assert "h.0.self_attention.query_key_value.weight" in tensors
        return tensors

    path = tiny_model("bloom", **CASES["bloom"])
    hub = copy_with_tensors(path, tmp_path / "hub", hub_form)
    assert greedy_tokens(path) == greedy_tokens(hub) == [
        tokens for tokens, _ in hf_greedy(path, prompts(), MAX_NEW)]


@pytest.mark.parametrize("field,value", [("expansion_ratio", 2), ("no_bias", False),
                                         ("logit_scale", 0.5), ("attn_config.alibi", False),
                                         ("attn_config.qk_ln", True),
                                         ("attn_config.prefix_lm", True)])
def test_mpt_refuses_what_transformers_does_not_build(tiny_model, tmp_path, field, value):
    """transformers builds every MPT model as the defaults say, whatever these fields
    hold: a checkpoint that sets one otherwise is refused by name, not served unlike
    its reference. MPT-7B's own config (dict-valued attn_config, read without
    transformers too) loads."""
    def edit(config):
        if field.startswith("attn_config."):
            config["attn_config"][field.split(".")[1]] = value
        else:
            config[field] = value
        return config

    path = copy_with_config(tiny_model("mpt", **CASES["mpt"]), tmp_path / "mpt", edit)
    with pytest.raises(ValueError, match=field.split(".")[-1]):
        LLM(str(path), device="cpu", dtype="float32", max_model_len=256)


def test_mpt_context_is_its_max_seq_len(tiny_model, tmp_path):
    path = copy_with_config(tiny_model("mpt", **CASES["mpt"]), tmp_path / "mpt",
                            lambda config: {**config, "max_seq_len": 300})
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        assert llm.config.model.max_model_len == 300
    with pytest.raises(ValueError, match="longest context the model takes \\(300\\)"):
        LLM(str(path), device="cpu", dtype="float32", max_model_len=301)


def test_falcon_rw_alibi_is_refused():
    """Falcon-RW's ALiBi bias is each slope * position rounded to bf16 (its code's and
    transformers'): refused by name rather than served with BLOOM's exact bias."""
    from types import SimpleNamespace

    from spindle.models.falcon import FalconForCausalLM

    with pytest.raises(ValueError, match="alibi: Falcon-RW"):
        FalconForCausalLM.check_config(SimpleNamespace(alibi=True, activation="gelu"))


def test_gpt2_reads_the_old_names_and_skips_the_mask_buffers(tiny_model, tmp_path):
    """The original GPT-2 checkpoints name their tensors without ``transformer.`` and
    carry each layer's causal mask: the same model loads from either form."""
    def old_form(tensors):
        tensors = {name.removeprefix("transformer."): t for name, t in tensors.items()}
        for i in range(3):
            tensors[f"h.{i}.attn.bias"] = torch.ones(1, 1, 8, 8)
            tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
        return tensors

    path = tiny_model("gpt2", num_layers=3, tie_word_embeddings=True)
    old = copy_with_tensors(path, tmp_path / "old", old_form)
    assert greedy_tokens(path) == greedy_tokens(old) == [
        tokens for tokens, _ in hf_greedy(path, prompts(), MAX_NEW)]


def test_gpt2_refuses_what_it_would_get_wrong():
    from types import SimpleNamespace

    from spindle.models.gpt2 import GPT2LMHeadModel

    GPT2LMHeadModel.check_config(SimpleNamespace(activation_function="gelu_new"))
    with pytest.raises(ValueError, match="activation_function 'swish' is not supported"):
        GPT2LMHeadModel.check_config(SimpleNamespace(activation_function="swish"))
    with pytest.raises(ValueError, match="cross-attention"):
        GPT2LMHeadModel.check_config(SimpleNamespace(activation_function="gelu",
                                                     add_cross_attention=True))


def test_stablelm_refuses_per_head_q_k_norms(tiny_model, tmp_path):
    copy = copy_with_config(tiny_model("stablelm", num_layers=2), tmp_path / "qk",
                            lambda config: {**config, "qk_layernorm": True})
    with pytest.raises(ValueError, match="per-head q/k LayerNorms"):
        LLM(str(copy), device="cpu", dtype="float32", max_model_len=64)


def test_opt_reads_both_checkpoint_prefixes():
    """OPT's hub checkpoints name their tensors ``model.decoder.*`` or, older ones,
    ``decoder.*``; both load into the same parameters."""
    from spindle.models.opt import OPTForCausalLM

    names = ["model.decoder.embed_positions.weight", "decoder.embed_positions.weight",
             "decoder.layers.1.self_attn.out_proj.bias", "model.decoder.layers.0.fc1.weight",
             "decoder.layers.0.fc2.bias", "model.decoder.project_out.weight", "lm_head.weight",
             "decoder.final_layer_norm.weight", "model.decoder.layers.2.final_layer_norm.bias"]
    ours = [name for name, _ in OPTForCausalLM._our_names((n, None) for n in names)]
    assert ours == ["model.embed_positions.weight", "model.embed_positions.weight",
                    "model.layers.1.self_attn.o_proj.bias", "model.layers.0.mlp.c_fc.weight",
                    "model.layers.0.mlp.c_proj.bias", "model.project_out.weight",
                    "lm_head.weight", "model.final_layer_norm.weight",
                    "model.layers.2.final_layer_norm.bias"]


def test_gpt_neo_refuses_an_unknown_layer_kind():
    from types import SimpleNamespace

    from spindle.models.gpt_neo import GPTNeoForCausalLM

    config = SimpleNamespace(activation_function="gelu_new", num_hidden_layers=2,
                             window_size=4, attention_layers=["global", "sparse"])
    with pytest.raises(ValueError, match="each one of \\('global', 'local'\\)"):
        GPTNeoForCausalLM.check_config(config)


def test_exaone_reads_its_hub_names(tiny_model, tmp_path):
    """EXAONE 3's checkpoints name Llama's tensors GPT-2's way (transformer.h.*.attn.
    attention.*, mlp.c_fc_0 / c_fc_1 / c_proj): renamed, they load as the Llama-named
    ones do, and transformers (its conversion mapping) agrees."""
    from spindle.models.llama import _EXAONE_NAMES

    def hub_name(name: str) -> str:
        for theirs, ours in reversed(_EXAONE_NAMES):
            name = (theirs + name[len(ours):] if ours.startswith("model.")
                    and name.startswith(ours) else name.replace(ours, theirs))
        return name

    def hub_form(tensors):
        tensors = {hub_name(n): t for n, t in tensors.items()}
        assert "transformer.h.0.attn.attention.q_proj.weight" in tensors
        assert "transformer.h.1.mlp.c_fc_1.weight" in tensors
        return tensors

    path = tiny_model("exaone", num_layers=2)
    hub = copy_with_tensors(path, tmp_path / "hub", hub_form)
    expected = hf_greedy(hub, prompts(), MAX_NEW)
    assert greedy_tokens(hub) == [t for t, _ in expected]
    assert expected == hf_greedy(path, prompts(), MAX_NEW)
