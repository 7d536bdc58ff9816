"""Which model class serves which HF architecture name (config.json "architectures").

Entries are "module:Class" strings imported on first use, so listing a model costs
nothing until it is loaded.
"""

from __future__ import annotations

import importlib
from typing import Any

MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "spindle.models.llama:LlamaForCausalLM",
    "ExaoneForCausalLM": "spindle.models.llama:ExaoneForCausalLM",
    "MistralForCausalLM": "spindle.models.llama:MistralForCausalLM",
    "MinistralForCausalLM": "spindle.models.llama:MinistralForCausalLM",
    "Ministral3ForCausalLM": "spindle.models.llama:Ministral3ForCausalLM",
    "SmolLM3ForCausalLM": "spindle.models.llama:SmolLM3ForCausalLM",
    "SeedOssForCausalLM": "spindle.models.llama:SeedOssForCausalLM",
    "InternLM3ForCausalLM": "spindle.models.llama:InternLM3ForCausalLM",
    "ArceeForCausalLM": "spindle.models.llama:ArceeForCausalLM",
    "ApertusForCausalLM": "spindle.models.llama:ApertusForCausalLM",
    "Ernie4_5ForCausalLM": "spindle.models.llama:Ernie4_5ForCausalLM",
    "HeliumForCausalLM": "spindle.models.llama:HeliumForCausalLM",
    "Llama4ForCausalLM": "spindle.models.llama4:Llama4ForCausalLM",
    "Qwen2ForCausalLM": "spindle.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "spindle.models.llama:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "spindle.models.moe:Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM": "spindle.models.moe:Qwen2MoeForCausalLM",
    "Dots1ForCausalLM": "spindle.models.moe:Dots1ForCausalLM",
    "Ernie4_5_MoeForCausalLM": "spindle.models.moe:Ernie4_5_MoeForCausalLM",
    "OlmoeForCausalLM": "spindle.models.olmoe:OlmoeForCausalLM",
    "MixtralForCausalLM": "spindle.models.moe:MixtralForCausalLM",
    "MiniMaxM2ForCausalLM": "spindle.models.minimax_m2:MiniMaxM2ForCausalLM",
    "Glm4MoeForCausalLM": "spindle.models.glm4_moe:Glm4MoeForCausalLM",
    "Glm4ForCausalLM": "spindle.models.glm4:Glm4ForCausalLM",
    "GlmForCausalLM": "spindle.models.glm4:GlmForCausalLM",
    "Exaone4ForCausalLM": "spindle.models.exaone4:Exaone4ForCausalLM",
    "HunYuanDenseV1ForCausalLM": "spindle.models.hunyuan:HunYuanDenseV1ForCausalLM",
    "HunYuanMoEV1ForCausalLM": "spindle.models.hunyuan:HunYuanMoEV1ForCausalLM",
    "DeepseekV3ForCausalLM": "spindle.models.deepseek_v3:DeepseekV3ForCausalLM",
    "DeepseekV2ForCausalLM": "spindle.models.deepseek_v3:DeepseekV2ForCausalLM",
    "MiniCPM3ForCausalLM": "spindle.models.deepseek_v3:MiniCPM3ForCausalLM",
    "GptOssForCausalLM": "spindle.models.gpt_oss:GptOssForCausalLM",
    "Phi3ForCausalLM": "spindle.models.llama:Phi3ForCausalLM",
    "PhimoeForCausalLM": "spindle.models.phimoe:PhimoeForCausalLM",
    "GemmaForCausalLM": "spindle.models.gemma:GemmaForCausalLM",
    "CohereForCausalLM": "spindle.models.cohere:CohereForCausalLM",
    "Starcoder2ForCausalLM": "spindle.models.starcoder2:Starcoder2ForCausalLM",
    "GPTNeoXForCausalLM": "spindle.models.gpt_neox:GPTNeoXForCausalLM",
    "PhiForCausalLM": "spindle.models.phi:PhiForCausalLM",
    "GPT2LMHeadModel": "spindle.models.gpt2:GPT2LMHeadModel",
    "BloomForCausalLM": "spindle.models.bloom:BloomForCausalLM",
    "MptForCausalLM": "spindle.models.mpt:MptForCausalLM",
    "GPTBigCodeForCausalLM": "spindle.models.gpt2:GPTBigCodeForCausalLM",
    "StableLmForCausalLM": "spindle.models.stablelm:StableLmForCausalLM",
    "OPTForCausalLM": "spindle.models.opt:OPTForCausalLM",
    "GPTJForCausalLM": "spindle.models.gptj:GPTJForCausalLM",
    "CodeGenForCausalLM": "spindle.models.gptj:CodeGenForCausalLM",
    "FalconForCausalLM": "spindle.models.falcon:FalconForCausalLM",
    "GPTNeoForCausalLM": "spindle.models.gpt_neo:GPTNeoForCausalLM",
    "OlmoForCausalLM": "spindle.models.olmo:OlmoForCausalLM",
    "NemotronForCausalLM": "spindle.models.nemotron:NemotronForCausalLM",
    "Jais2ForCausalLM": "spindle.models.starcoder2:Jais2ForCausalLM",
    "Cohere2ForCausalLM": "spindle.models.cohere:Cohere2ForCausalLM",
    "Gemma2ForCausalLM": "spindle.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "spindle.models.gemma:Gemma3ForCausalLM",
    "BambaForCausalLM": "spindle.models.bamba:BambaForCausalLM",
    "FalconH1ForCausalLM": "spindle.models.falcon_h1:FalconH1ForCausalLM",
    "JambaForCausalLM": "spindle.models.jamba:JambaForCausalLM",
    "GraniteMoeHybridForCausalLM": "spindle.models.granite_hybrid:GraniteMoeHybridForCausalLM",
    "GraniteForCausalLM": "spindle.models.granite:GraniteForCausalLM",
    "GraniteMoeForCausalLM": "spindle.models.granite:GraniteMoeForCausalLM",
    "GraniteMoeSharedForCausalLM": "spindle.models.granite:GraniteMoeSharedForCausalLM",
    "GraniteSWAForCausalLM": "spindle.models.granite:GraniteSWAForCausalLM",
    "GraniteMoeSWAForCausalLM": "spindle.models.granite:GraniteMoeSWAForCausalLM",
    "Lfm2ForCausalLM": "spindle.models.lfm2:Lfm2ForCausalLM",
    "Lfm2MoeForCausalLM": "spindle.models.lfm2:Lfm2MoeForCausalLM",
    "Mamba2ForCausalLM": "spindle.models.mamba2:Mamba2ForCausalLM",
    "MambaForCausalLM": "spindle.models.mamba:MambaForCausalLM",
    "FalconMambaForCausalLM": "spindle.models.mamba:FalconMambaForCausalLM",
    "NemotronHForCausalLM": "spindle.models.nemotron_h:NemotronHForCausalLM",
    "Zamba2ForCausalLM": "spindle.models.zamba2:Zamba2ForCausalLM",
    "Olmo2ForCausalLM": "spindle.models.olmo_hybrid:Olmo2ForCausalLM",
    "Olmo3ForCausalLM": "spindle.models.olmo_hybrid:Olmo3ForCausalLM",
    "OlmoHybridForCausalLM": "spindle.models.olmo_hybrid:OlmoHybridForCausalLM",
    "KimiLinearForCausalLM": "spindle.models.kimi_linear:KimiLinearForCausalLM",
    "Qwen3NextForCausalLM": "spindle.models.qwen3_next:Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM": "spindle.models.qwen3_next:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM": "spindle.models.qwen3_next:Qwen3_5MoeForCausalLM",
    "BertModel": "spindle.models.bert:BertModel",
    "RobertaModel": "spindle.models.bert:RobertaModel",
    "XLMRobertaModel": "spindle.models.bert:XLMRobertaModel",
    "WhisperForConditionalGeneration": "spindle.models.whisper:WhisperForConditionalGeneration",
}


# Image-text architectures served as their text model: the text model's architecture.
# Their config's text_config is the model's config; images are refused (no vision tower
# is loaded).
TEXT_MODEL_OF = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Mistral3ForConditionalGeneration": "MistralForCausalLM",
    "Qwen2VLForConditionalGeneration": "Qwen2ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
    "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
    "Glm4vForConditionalGeneration": "Glm4ForCausalLM",
    "Glm4vMoeForConditionalGeneration": "Glm4MoeForCausalLM",
    # (LLaVA's text model is whichever its text config's model_type names, below)
    "LlavaForConditionalGeneration": "LlamaForCausalLM",
    "LlavaNextForConditionalGeneration": "LlamaForCausalLM",
}
# The text model by the text config's own model_type, where it differs from the outer
# architecture's usual one (Mistral 3 checkpoints of Ministral 3 text models; LLaVA's
# Llama, Mistral, Qwen2 or Granite inside).
TEXT_MODEL_BY_TYPE = {"ministral3": "Ministral3ForCausalLM", "ministral": "MinistralForCausalLM",
                      "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                      "qwen2": "Qwen2ForCausalLM", "granite": "GraniteForCausalLM"}


def supported_architectures() -> list[str]:
    return sorted([*MODEL_REGISTRY, *TEXT_MODEL_OF])


def text_model_config(hf_config: Any) -> Any:
    """The config spindle serves for hf_config: itself, or for an image-text
    architecture (TEXT_MODEL_OF) its text_config under the text model's architecture
    name, with the outer config's tie_word_embeddings, dtype and quantization_config
    (an FP8 checkpoint declares it there), and ``text_model_of`` naming the outer
    architecture."""
    outer = (getattr(hf_config, "architectures", None) or [None])[0]
    if outer not in TEXT_MODEL_OF:
        return hf_config
    text = hf_config.text_config
    text.architectures = [TEXT_MODEL_BY_TYPE.get(getattr(text, "model_type", None),
                                                 TEXT_MODEL_OF[outer])]
    text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
    for name in ("dtype", "quantization_config"):
        if getattr(text, name, None) is None and getattr(hf_config, name, None) is not None:
            setattr(text, name, getattr(hf_config, name))
    text.text_model_of = outer
    return text


def model_kind(model_class: type) -> str:
    """What a model class declares it is: "decoder" (the default), "encoder",
    "hybrid" (state-space layers beside attention) or "encoder_decoder" (Whisper)."""
    return getattr(model_class, "model_kind", "decoder")


def resolve_model_class(architectures: list[str] | None) -> type:
    """The class of the first supported name in architectures."""
    for arch in architectures or []:
        target = MODEL_REGISTRY.get(arch)
        if target is not None:
            module_name, _, class_name = target.partition(":")
            return getattr(importlib.import_module(module_name), class_name)
    names = ", ".join(architectures) if architectures else "(none given)"
    raise ValueError(f"unsupported model architecture {names}; supported architectures: "
                     f"{', '.join(supported_architectures())}")
