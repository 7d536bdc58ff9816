"""spindle/hf_config.py against the installed transformers: the field tables, and the
plain config of many config.json variants equal to what AutoConfig builds."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from spindle.executor.config_snapshot import snapshot_hf_config
from spindle import hf_config
from spindle.hf_config import (GENERATION_PARAMS, MODEL_FIELDS, RESERVED_KEYS, ConfigSnapshot,
                               _BASE_FIELDS, _is_reserved, load_hf_config, plain_hf_config)

transformers = pytest.importorskip("transformers")

CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
           "bert": "BertConfig", "roberta": "RobertaConfig", "xlm-roberta": "XLMRobertaConfig"}
# How transformers annotates each type spec of the tables.
ANNOTATIONS = {
    "int": {"<class 'int'>"}, "int?": {"int | None"}, "float": {"<class 'float'>"},
    "num": {"float | int", "int | float"}, "num?": {"float | int | None", "int | float | None"},
    "bool": {"<class 'bool'>"}, "bool?": {"bool | None"}, "str": {"<class 'str'>"},
    "str?": {"str | None"}, "strs?": {"list[str] | None"}, "ids": {"int | list[int] | None"},
    "dict?": {"transformers.modeling_rope_utils.RopeParameters | dict | None"},
    "id2label?": {"dict[int, str] | dict[str, str] | None"},
    "label2id?": {"dict[str, int] | dict[str, str] | None"},
    "none": {"typing.Optional[typing.Literal['regression', 'single_label_classification', "
             "'multi_label_classification']]"},
}
# Class-level attributes of transformers' config classes, left out of the plain config.
CLASS_LEVEL = {"_auto_class", "base_config_key", "base_model_ep_plan", "base_model_fsdp_plan",
               "base_model_pp_plan", "base_model_tp_plan", "default_rope_type", "default_theta",
               "has_no_defaults_at_init", "ignore_keys_at_rope_validation",
               "keys_to_ignore_at_inference", "sub_configs"}


def config_class(model_type):
    return getattr(transformers, CLASSES[model_type])


def test_installed_transformers_is_modelled():
    """The plain reading is on only for the versions the tables were checked against.
    A new transformers: run this file against it, then add it to TESTED_TRANSFORMERS."""
    assert hf_config.tested_transformers(), (transformers.__version__,
                                             hf_config.TESTED_TRANSFORMERS)


@pytest.mark.parametrize("model_type", sorted(CLASSES))
def test_field_tables_match_transformers(model_type):
    cls = config_class(model_type)
    assert cls.model_type == model_type and cls.attribute_map == {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    table = {**_BASE_FIELDS, **MODEL_FIELDS[model_type]}
    assert set(table) == set(fields)
    for name, (spec, default) in table.items():
        field = fields[name]
        assert field.default == default and type(field.default) is type(default), name
        annotation = str(field.type).replace(  # dtype: str | torch.dtype | None
            "typing.Union[str, ForwardRef('torch.dtype'), NoneType]", "str | None")
        assert annotation in ANNOTATIONS[spec], (name, annotation)
        validators = field.metadata.get("validator")
        # Only llama's initializer_range has a value validator ([0, 1], checked by hand).
        assert not validators or (model_type, name) == ("llama", "initializer_range")


def test_reserved_keys_cover_every_class_attribute():
    """A config.json key naming a property, method or class setting of transformers'
    config classes is left to transformers."""
    handled = {"model_type", "rope_scaling", "torch_dtype"}
    for model_type in CLASSES:
        cls = config_class(model_type)
        fields = {f.name for f in dataclasses.fields(cls)}
        for name in dir(cls):
            if name.startswith("__") or name in fields or name in handled:
                continue
            assert _is_reserved(name), name
    assert all(_is_reserved(k) for k in RESERVED_KEYS)


def test_generation_params_match_transformers():
    from transformers.generation.configuration_utils import GenerationConfig

    assert GENERATION_PARAMS == set(GenerationConfig._get_default_generation_params())


# ---------------------------------------------------------------------- whole configs
QWEN3_06B = {  # the real Qwen3-0.6B config.json
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
LLAMA32_1B = {  # the real Llama-3.2-1B config.json
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256}
QWEN2_05B = {  # the real Qwen2.5-0.5B-Instruct config.json
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}
MINILM = {  # the real all-MiniLM-L6-v2 config.json
    "_name_or_path": "nreimers/MiniLM-L6-H384-uncased", "architectures": ["BertModel"],
    "attention_probs_dropout_prob": 0.1, "gradient_checkpointing": False, "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1, "hidden_size": 384, "initializer_range": 0.02,
    "intermediate_size": 1536, "layer_norm_eps": 1e-12, "max_position_embeddings": 512,
    "model_type": "bert", "num_attention_heads": 12, "num_hidden_layers": 6,
    "pad_token_id": 0, "position_embedding_type": "absolute", "transformers_version": "4.8.2",
    "type_vocab_size": 1, "use_cache": True, "vocab_size": 30522}
XLMR = {"architectures": ["XLMRobertaModel"], "model_type": "xlm-roberta", "hidden_size": 64,
        "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128,
        "vocab_size": 250002, "max_position_embeddings": 514, "type_vocab_size": 1,
        "layer_norm_eps": 1e-05, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1,
        "output_past": True, "torch_dtype": "float32"}
ROBERTA = {"architectures": ["RobertaModel"], "model_type": "roberta", "vocab_size": 300,
           "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}
MINIMAL = {"qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
           "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
           "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
           "bert": {"architectures": ["BertModel"], "model_type": "bert"}}


def variant(base, **changes):
    config = copy.deepcopy(base)
    for key, value in changes.items():
        if value is DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    return config


DELETE = object()

# Configs the plain reading must take (and get exactly right).
PLAIN = {
    "qwen3-0.6b": QWEN3_06B,
    "llama-3.2-1b": LLAMA32_1B,
    "qwen2.5-0.5b": QWEN2_05B,
    "minilm": MINILM,
    "xlm-r": XLMR,
    "roberta": ROBERTA,
    **{f"minimal-{k}": v for k, v in MINIMAL.items()},
    "qwen3-sliding": variant(QWEN3_06B, use_sliding_window=True, sliding_window=4096,
                             max_window_layers=20),
    "qwen2-layer-types": variant(QWEN2_05B, num_hidden_layers=2,
                                 layer_types=["full_attention", "sliding_attention"]),
    "qwen3-rope-parameters": variant(QWEN3_06B, rope_scaling=DELETE, rope_theta=DELETE,
                                     rope_parameters={"rope_type": "default",
                                                      "rope_theta": 5e5}),
    "qwen3-rope-scaling-default": variant(QWEN3_06B, rope_scaling={"rope_type": "default"}),
    "qwen3-rope-theta-null": variant(QWEN3_06B, rope_theta=None),
    "llama-legacy-type": variant(LLAMA32_1B, rope_scaling={
        "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192, "type": "llama3"}),
    "llama-no-rope": variant(LLAMA32_1B, rope_scaling=DELETE, rope_theta=DELETE,
                             head_dim=DELETE, num_key_value_heads=DELETE),
    "llama-dtype-and-torch-dtype": variant(LLAMA32_1B, dtype="float16"),
    "llama-labels": variant(LLAMA32_1B, id2label={"0": "neg", "1": "pos", "2": "mid"},
                            label2id={"neg": 0, "pos": 1, "mid": 2}),
    "llama-id2label-only": variant(LLAMA32_1B, id2label={"0": "a"}),
    "llama-generation-params": variant(LLAMA32_1B, max_length=20, do_sample=True,
                                       temperature=0.7, top_p=0.9),
    "llama-extras": variant(LLAMA32_1B, foo={"bar": [1, 2]}, my_token_id=5, quant=None),
    "llama-layer-types": variant(LLAMA32_1B, layer_types=["full_attention"] * 16),
    "qwen3-no-dtype": variant(QWEN3_06B, torch_dtype=DELETE, transformers_version=DELETE),
    "bert-dtype": variant(MINILM, torch_dtype="bfloat16", classifier_dropout=0.2,
                          is_decoder=False),
}
# Configs the plain reading must leave to transformers (it would raise, warn, or do
# something the plain reading does not model).
FALLBACK = {
    "unknown-model-type": variant(MINIMAL["llama"], model_type="mistral",
                                  architectures=["MistralForCausalLM"]),
    "remote-code": variant(MINIMAL["llama"], auto_map={"AutoConfig": "x.Y"}),
    "int-for-float": variant(QWEN3_06B, rms_norm_eps=1),
    "bool-for-int": variant(QWEN3_06B, num_hidden_layers=True),
    "string-size": variant(QWEN3_06B, hidden_size="1024"),
    "llama-bad-heads": variant(LLAMA32_1B, num_attention_heads=3),
    "llama-init-range": variant(LLAMA32_1B, initializer_range=1.5),
    "yarn": variant(QWEN3_06B, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 32768}),
    "rope-extra-key": variant(QWEN3_06B, rope_scaling={"rope_type": "default", "factor": 2.0}),
    "llama3-bad-factors": variant(LLAMA32_1B, rope_scaling={
        "factor": 8.0, "high_freq_factor": 1.0, "low_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    "per-layer-rope": variant(QWEN3_06B, rope_scaling=None, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
    "token-out-of-vocab": variant(QWEN3_06B, pad_token_id=-1),
    "layer-types-length": variant(QWEN3_06B, layer_types=["full_attention"]),
    "num-labels": variant(LLAMA32_1B, num_labels=3),
    "attn-implementation": variant(LLAMA32_1B, attn_implementation="eager"),
    "per-layer-config": variant(LLAMA32_1B, per_layer_config={"0": {"hidden_act": "gelu"}}),
    "bert-rope": variant(MINILM, rope_theta=10000.0),
    "private-key": variant(LLAMA32_1B, _commit_hash="0" * 40),
    "property-key": variant(LLAMA32_1B, use_return_dict=True),
    "dtype-not-torch": variant(LLAMA32_1B, torch_dtype="auto"),
    "problem-type": variant(LLAMA32_1B, problem_type="regression"),
    "nan": variant(LLAMA32_1B, rms_norm_eps={"__float__": "NaN"}),
    "encoder-decoder": variant(MINILM, is_encoder_decoder=True),
    "rope-type-not-a-string": variant(QWEN3_06B, rope_scaling={"rope_type": ["default"]}),
    "llama-layer-types-extra": variant(LLAMA32_1B, layer_types=[["full_attention"]]),
}


def write(tmp_path, config, name="ckpt"):
    path = tmp_path / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def expected_snapshot(path) -> dict:
    """transformers' config, as the plain reading promises it: its instance attributes,
    aliases and model_type, without the class-level settings."""
    hf = transformers.AutoConfig.from_pretrained(str(path))
    return {k: v for k, v in vars(snapshot_hf_config(hf)).items() if k not in CLASS_LEVEL}


@pytest.mark.parametrize("name", sorted(PLAIN))
def test_plain_config_equals_transformers(tmp_path, name):
    path = write(tmp_path, PLAIN[name])
    plain = load_hf_config(path)
    assert isinstance(plain, ConfigSnapshot), "expected the plain reading"
    assert vars(plain) == expected_snapshot(path)


@pytest.mark.parametrize("name", sorted(FALLBACK))
def test_unmodelled_configs_go_to_transformers(tmp_path, name):
    path = write(tmp_path, FALLBACK[name])
    raw = json.loads((path / "config.json").read_text())
    assert plain_hf_config(raw, str(path)) is None


def test_hub_cache_commit_hash(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    path = write(tmp_path, QWEN3_06B, name=f"models--x--y/snapshots/{commit}")
    plain = load_hf_config(path)
    assert plain._commit_hash == commit
    assert vars(plain) == expected_snapshot(path)


def test_fallback_errors_are_transformers_own(tmp_path):
    path = write(tmp_path, FALLBACK["string-size"])
    with pytest.raises(ValueError, match="transformers cannot read"):
        load_hf_config(path)


def test_tiny_checkpoints_read_plain(tiny_model):
    for arch in ("llama", "qwen2", "qwen3"):
        path = tiny_model(arch=arch)
        plain = load_hf_config(path)
        assert isinstance(plain, ConfigSnapshot)
        assert vars(plain) == expected_snapshot(path)
