"""Image-text checkpoints served as their text model (registry.TEXT_MODEL_OF): Gemma 3,
Mistral 3 (Mistral Small 3.1+), Llama 4, LLaVA 1.5 and 1.6 (a Llama or a windowed
Mistral inside), whose hub checkpoints keep the language model under
``language_model.model.`` beside a vision tower and a projector; Qwen2.5-VL
(``model.`` beside ``visual.``), Qwen3-VL, Qwen3.5 (dense and MoE), GLM-4.1V and GLM-4.5V
(``model.language_model.``). On tiny checkpoints with a one-block vision tower,
written by transformers in each family's hub layout, spindle's greedy tokens equal
transformers' (its text model, or the whole image-text model run on text), the tokenizer
loads, and the vision weights are left out."""

from __future__ import annotations

import pytest

from checkpoint_utils import same_tokens, spindle_greedy
from test_generate_vs_hf import hf_greedy

from spindle import LLM, SamplingParams
from spindle.models.loader import text_model_tensors


@pytest.mark.parametrize("arch,fields,language_model,auto_class", [
    ("gemma3_vl", dict(num_layers=2), "language_model.model.", "AutoModelForCausalLM"),
    ("mistral3_vl", dict(num_layers=2, tie_word_embeddings=False), "language_model.model.",
     "AutoModelForImageTextToText"),  # (transformers has no causal LM class for it)
    # (a Ministral 3 text model inside: served as Ministral3ForCausalLM, by its model_type)
    ("ministral3_vl", dict(num_layers=2, tie_word_embeddings=False), "language_model.model.",
     "AutoModelForImageTextToText"),
    ("qwen2_5_vl", dict(num_layers=2), "model.layers.", "AutoModelForImageTextToText"),
    ("qwen3_vl", dict(num_layers=2), "model.language_model.", "AutoModelForImageTextToText"),
    ("qwen3_5_vl", dict(num_layers=3), "model.language_model.", "AutoModelForCausalLM"),
    ("qwen3_5_moe_vl", dict(num_layers=3, tie_word_embeddings=True), "model.language_model.",
     "AutoModelForCausalLM"),
    ("llama4_vl", dict(num_layers=4), "language_model.model.", "AutoModelForImageTextToText"),
    ("glm4v", dict(num_layers=2), "model.language_model.", "AutoModelForImageTextToText"),
    ("glm4v_moe", dict(num_layers=2), "model.language_model.", "AutoModelForImageTextToText"),
    ("llava", dict(num_layers=2), "language_model.model.", "AutoModelForImageTextToText"),
    # (a Mistral text model inside: served as MistralForCausalLM, by its model_type)
    ("llava_next", dict(num_layers=2, sliding_window=8), "language_model.model.",
     "AutoModelForImageTextToText"),
])
def test_the_text_model_equals_transformers(tiny_model, arch, fields, language_model,
                                            auto_class):
    """language_model: where the family's hub checkpoints keep it (transformers writes
    them so)."""
    from safetensors import safe_open

    path = tiny_model(arch, **fields)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith(language_model) for n in names)
    assert any(n.startswith(("vision_tower.", "model.vision_tower.", "model.visual.", "visual.",
                             "vision_model."))
               for n in names)
    prompts = [[5, 6, 7], list(range(10, 40))]
    expected, got = hf_greedy(path, prompts, 8, auto_class=auto_class), spindle_greedy(path,
                                                                                       prompts)
    assert same_tokens(expected, got)
    for (_, theirs), (_, ours) in zip(expected, got):
        assert ours == pytest.approx(theirs, abs=1e-4)
    with LLM(str(path), dtype="float32", device="cpu", max_model_len=128) as llm:
        assert llm.engine.config.model.hf_config.text_model_of.endswith(
            "ForConditionalGeneration")
        out = llm.generate(["def f(x):"], SamplingParams(max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_the_language_model_is_renamed_and_the_rest_left_out():
    tensors = [("language_model.model.layers.0.mlp.up_proj.weight", 1),
               ("model.language_model.norm.weight", 2), ("language_model.lm_head.weight", 3),
               ("lm_head.weight", 4), ("mtp.fc.weight", 5), ("vision_tower.blocks.0.w", 6),
               ("model.visual.merger.w", 7), ("multi_modal_projector.linear_1.weight", 8),
               ("visual.patch_embed.proj.weight", 10),
               ("model.multi_modal_projector.norm.weight", 9), ("image_newline", 11),
               ("model.image_newline", 12), ("vision_model.model.layers.0.w", 13)]
    assert list(text_model_tensors(tensors)) == [
        ("model.layers.0.mlp.up_proj.weight", 1), ("model.norm.weight", 2),
        ("lm_head.weight", 3), ("lm_head.weight", 4), ("mtp.fc.weight", 5)]
