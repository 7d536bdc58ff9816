"""spindle/hf_config.py: the HF config is transformers' own (AutoConfig, imported on
first use) for whatever transformers is installed, or with the start cache on a
plain-data snapshot with every attribute of it (what workers get too); a bad
config.json is a ValueError naming the file."""

from __future__ import annotations

import copy
import json

import pytest

from spindle.hf_config import ConfigSnapshot, load_hf_config, read_config_json, snapshot_hf_config

transformers = pytest.importorskip("transformers")

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

CONFIGS = {
    "qwen3-0.6b": QWEN3_06B,
    "llama-3.2-1b": LLAMA32_1B,
    "qwen2.5-0.5b": QWEN2_05B,
    "minilm": MINILM,
    "xlm-r": XLMR,
    "roberta": ROBERTA,
    **{f"minimal-{k}": v for k, v in MINIMAL.items()},
    "qwen3-sliding": variant(QWEN3_06B, use_sliding_window=True, sliding_window=4096,
                             max_window_layers=20),
    "qwen3-rope-parameters": variant(QWEN3_06B, rope_scaling=DELETE, rope_theta=DELETE,
                                     rope_parameters={"rope_type": "default",
                                                      "rope_theta": 5e5}),
    "qwen3-yarn": variant(QWEN3_06B, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 32768}),
    "llama-legacy-type": variant(LLAMA32_1B, rope_scaling={
        "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192, "type": "llama3"}),
    "llama-no-rope": variant(LLAMA32_1B, rope_scaling=DELETE, rope_theta=DELETE,
                             head_dim=DELETE, num_key_value_heads=DELETE),
    "llama-labels": variant(LLAMA32_1B, id2label={"0": "neg", "1": "pos", "2": "mid"},
                            label2id={"neg": 0, "pos": 1, "mid": 2}),
    "llama-generation-params": variant(LLAMA32_1B, max_length=20, do_sample=True,
                                       temperature=0.7, top_p=0.9),
    "llama-extras": variant(LLAMA32_1B, foo={"bar": [1, 2]}, my_token_id=5, quant=None),
    "mistral": variant(MINIMAL["llama"], model_type="mistral",
                       architectures=["MistralForCausalLM"], sliding_window=4096),
}


def write(tmp_path, config, name="ckpt"):
    path = tmp_path / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_is_transformers_own(tmp_path, name, monkeypatch):
    """No copy of transformers' defaults, derived fields or rope handling: the config is
    the object AutoConfig builds, for the installed version (the start cache off), or a
    snapshot of every attribute of it, on a first start and read back on a later one."""
    path = write(tmp_path, CONFIGS[name])
    theirs = transformers.AutoConfig.from_pretrained(str(path))
    monkeypatch.setenv("SPINDLE_START_CACHE_DIR", str(tmp_path / "start-cache"))
    first = load_hf_config(path)
    for ours in (first, load_hf_config(path, read_config_json(path))):
        assert isinstance(ours, ConfigSnapshot)
        assert vars(ours) == vars(snapshot_hf_config(theirs))
    monkeypatch.setenv("SPINDLE_START_CACHE", "0")
    for ours in (load_hf_config(path), load_hf_config(path, read_config_json(path))):
        assert type(ours) is type(theirs)
        assert ours.to_dict() == theirs.to_dict()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_worker_snapshot_holds_every_attribute(tmp_path, name):
    """What workers get instead (executor/config_snapshot.py): every instance attribute
    and attribute_map alias of transformers' object, nested configs included."""
    hf = transformers.AutoConfig.from_pretrained(str(write(tmp_path, CONFIGS[name])))
    snapshot = snapshot_hf_config(hf)
    for key, value in vars(hf).items():
        assert getattr(snapshot, key) == value, key
    for alias in hf.attribute_map:
        assert getattr(snapshot, alias) == getattr(hf, alias), alias
    assert snapshot.model_type == hf.model_type


def test_hub_cache_commit_hash_is_transformers_own(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    path = write(tmp_path, QWEN3_06B, name=f"models--x--y/snapshots/{commit}")
    load_hf_config(write(tmp_path, QWEN3_06B, name="elsewhere"))  # the same bytes
    ours = load_hf_config(path)
    theirs = transformers.AutoConfig.from_pretrained(str(path))
    assert getattr(ours, "_commit_hash", None) == getattr(theirs, "_commit_hash", None)
    assert vars(snapshot_hf_config(ours)) == vars(snapshot_hf_config(theirs))


@pytest.mark.parametrize("text, message", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "is not a JSON object"),
    (json.dumps({"architectures": ["XForCausalLM"], "model_type": "no-such-type"}),
     "transformers cannot read"),
    (json.dumps(variant(QWEN3_06B, hidden_size="1024")), "transformers cannot read"),
])
def test_bad_config_json_is_a_value_error_naming_the_file(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message) as raised:
        load_hf_config(tmp_path)
    assert str(tmp_path / "config.json") in str(raised.value)
