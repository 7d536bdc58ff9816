"""config.json -> the HF config, as plain data, without importing transformers.

Importing any transformers config class imports most of transformers (about 2.5 s on
the CI machines, several seconds on a slow host). For the model types spindle serves,
load_hf_config builds what transformers' config class would hold, as a ConfigSnapshot:
every field with its default, the derived fields (head_dim, num_key_value_heads,
sliding_window, layer_types), rope_parameters standardised the way transformers does,
dtype as a torch.dtype, the label maps, and every other key of config.json as is.

It only builds configs that transformers loads silently. Anything it does not model
exactly (another model type, remote code, keys with a special meaning, a value that
transformers would reject or warn about) is loaded by transformers' AutoConfig instead,
so errors and warnings stay transformers' own. Class-level attributes of transformers'
classes (tensor- and pipeline-parallel plans and the like) are left out: spindle reads
none. The tables model the transformers versions in TESTED_TRANSFORMERS; with any other
version installed, every config goes to transformers. tests/test_hf_config.py checks the
tables and the results against the installed transformers.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import os
import re
import types
from pathlib import Path
from typing import Any

# (major, minor) versions of transformers whose config loading the tables below
# reproduce, checked by tests/test_hf_config.py. Add a version only after those tests
# pass against it.
TESTED_TRANSFORMERS = ((5, 17),)


class ConfigSnapshot(types.SimpleNamespace):
    """The plain-data attributes of a transformers config (read-only by convention)."""

    def to_dict(self) -> dict[str, Any]:
        return {k: v.to_dict() if isinstance(v, ConfigSnapshot) else v
                for k, v in vars(self).items()}


def load_hf_config(path: str | os.PathLike, raw: dict[str, Any] | None = None) -> Any:
    """The HF config of the checkpoint directory `path` (raw: its config.json, when
    already read): a ConfigSnapshot when the plain reading is exact, else transformers'
    config object. Raises ValueError for a config.json that transformers cannot read."""
    raw = read_config_json(Path(path)) if raw is None else raw
    snapshot = plain_hf_config(raw, str(path))
    if snapshot is not None:
        return snapshot
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types for an unknown model_type
        raise ValueError(f"transformers cannot read {Path(path) / 'config.json'}: {e}") from e


def read_config_json(path: Path) -> dict[str, Any]:
    file = path / "config.json"
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{file} is not a JSON object")
    return raw


def plain_hf_config(raw: dict[str, Any], name_or_path: str) -> ConfigSnapshot | None:
    """What AutoConfig.from_pretrained(name_or_path) would hold for this config.json,
    or None when the plain reading might differ from transformers' in any way."""
    if not tested_transformers():
        return None
    fields = _FIELDS.get(raw.get("model_type"))
    if fields is None or _has_special_values(raw):
        return None
    values = {name: raw.get(name, default) for name, (_, default) in fields.items()}
    if not all(_type_ok(spec, values[name]) for name, (spec, _) in fields.items()):
        return None
    extras = {k: v for k, v in raw.items() if k not in fields}
    if any(_is_reserved(k) for k in extras):
        return None
    post_init = _POST_INIT[raw["model_type"]]
    if not post_init(values, extras) or not _base_post_init(values, extras):
        return None
    values.update(extras)  # transformers sets every remaining key as an attribute
    values.update(_name_or_path=name_or_path,
                  _commit_hash=hub_commit_hash(os.path.join(name_or_path, "config.json")),
                  _output_attentions=False, _attn_implementation_internal=None,
                  _experts_implementation_internal=None, attribute_map={})
    if not _validates(values):
        return None
    return ConfigSnapshot(**values)


# ---------------------------------------------------------------------- field tables
# name -> (type, default), as transformers 5 declares them. Types follow its strict
# dataclass validation: bool is not an int, an int is not a float; "?" allows None,
# "num" is float | int, "ids" is int | list[int] | None.
_BASE_FIELDS = {
    "transformers_version": ("str?", None), "architectures": ("strs?", None),
    "output_hidden_states": ("bool?", False), "return_dict": ("bool?", True),
    "dtype": ("str?", None), "chunk_size_feed_forward": ("int", 0),
    "is_encoder_decoder": ("bool", False), "id2label": ("id2label?", None),
    "label2id": ("label2id?", None), "problem_type": ("none", None),
}
_LLAMA_FIELDS = {
    "vocab_size": ("int", 32000), "hidden_size": ("int", 4096),
    "intermediate_size": ("int", 11008), "num_hidden_layers": ("int", 32),
    "num_attention_heads": ("int", 32), "num_key_value_heads": ("int?", None),
    "hidden_act": ("str", "silu"), "max_position_embeddings": ("int", 2048),
    "initializer_range": ("float", 0.02), "rms_norm_eps": ("float", 1e-6),
    "use_cache": ("bool", True), "pad_token_id": ("int?", None), "bos_token_id": ("int?", 1),
    "eos_token_id": ("ids", 2), "pretraining_tp": ("int?", 1),
    "tie_word_embeddings": ("bool", False), "rope_parameters": ("dict?", None),
    "attention_bias": ("bool", False), "attention_dropout": ("num?", 0.0),
    "mlp_bias": ("bool", False), "head_dim": ("int?", None),
}
_QWEN2_FIELDS = {
    "vocab_size": ("int", 151936), "hidden_size": ("int", 4096),
    "intermediate_size": ("int", 22016), "num_hidden_layers": ("int", 32),
    "num_attention_heads": ("int", 32), "num_key_value_heads": ("int?", 32),
    "hidden_act": ("str", "silu"), "max_position_embeddings": ("int", 32768),
    "initializer_range": ("float", 0.02), "rms_norm_eps": ("float", 1e-6),
    "use_cache": ("bool", True), "tie_word_embeddings": ("bool", False),
    "rope_parameters": ("dict?", None), "use_sliding_window": ("bool", False),
    "sliding_window": ("int?", 4096), "max_window_layers": ("int", 28),
    "layer_types": ("strs?", None), "attention_dropout": ("num", 0.0),
    "pad_token_id": ("int?", None), "bos_token_id": ("int?", None), "eos_token_id": ("ids", None),
}
_QWEN3_FIELDS = {**_QWEN2_FIELDS, "head_dim": ("int", 128), "attention_bias": ("bool", False)}
_BERT_FIELDS = {
    "vocab_size": ("int", 30522), "hidden_size": ("int", 768), "num_hidden_layers": ("int", 12),
    "num_attention_heads": ("int", 12), "intermediate_size": ("int", 3072),
    "hidden_act": ("str", "gelu"), "hidden_dropout_prob": ("num", 0.1),
    "attention_probs_dropout_prob": ("num", 0.1), "max_position_embeddings": ("int", 512),
    "type_vocab_size": ("int", 2), "initializer_range": ("float", 0.02),
    "layer_norm_eps": ("float", 1e-12), "pad_token_id": ("int?", 0), "use_cache": ("bool", True),
    "classifier_dropout": ("num?", None), "is_decoder": ("bool", False),
    "add_cross_attention": ("bool", False), "bos_token_id": ("int?", None),
    "eos_token_id": ("ids", None), "tie_word_embeddings": ("bool", True),
}
_ROBERTA_FIELDS = {**_BERT_FIELDS, "vocab_size": ("int", 50265), "pad_token_id": ("int?", 1),
                   "bos_token_id": ("int?", 0), "eos_token_id": ("ids", 2)}
_XLM_ROBERTA_FIELDS = {**_BERT_FIELDS, "pad_token_id": ("int?", 1), "bos_token_id": ("int?", 0),
                       "eos_token_id": ("ids", 2)}
MODEL_FIELDS = {"llama": _LLAMA_FIELDS, "qwen2": _QWEN2_FIELDS, "qwen3": _QWEN3_FIELDS,
                "bert": _BERT_FIELDS, "roberta": _ROBERTA_FIELDS,
                "xlm-roberta": _XLM_ROBERTA_FIELDS}
_FIELDS = {model_type: {**_BASE_FIELDS, **fields} for model_type, fields in MODEL_FIELDS.items()}

# Keys transformers drops from a config (they belong to the generation config), unless
# they are fields of the class.
GENERATION_PARAMS = frozenset((
    "assistant_confidence_threshold assistant_lookbehind bad_words_ids begin_suppress_tokens "
    "diversity_penalty do_sample early_stopping encoder_no_repeat_ngram_size "
    "encoder_repetition_penalty epsilon_cutoff eta_cutoff exponential_decay_length_penalty "
    "forced_bos_token_id forced_eos_token_id length_penalty max_length min_length "
    "no_repeat_ngram_size num_assistant_tokens num_assistant_tokens_schedule num_beam_groups "
    "num_beams num_return_sequences output_scores remove_invalid_values repetition_penalty "
    "return_dict_in_generate suppress_tokens target_lookbehind temperature top_k top_p "
    "typical_p use_cache").split())

# Keys that mean something to transformers beyond "set this attribute": its properties and
# methods, class-level settings, nested or per-layer configs, rope keys it moves around.
# A config.json holding one is left to transformers.
RESERVED_KEYS = frozenset((
    "allow_global_per_layer_attribute_access attribute_map auto_map base_config_key "
    "base_model_ep_plan base_model_fsdp_plan base_model_pp_plan base_model_tp_plan "
    "configuration_files convert_rope_params_to_dict decoder default_rope_type default_theta "
    "dict_dtype_to_str embed_dim encoder experts_implementation attn_implementation from_dict "
    "from_json_file from_pretrained generator get_config_dict get_mtp_config get_text_config "
    "gguf_file has_no_defaults_at_init ignore_keys_at_rope_validation is_custom_code "
    "is_heterogeneous is_remote_code keys_to_ignore_at_inference mlp_layer_types name_or_path "
    "num_heads num_labels original_max_position_embeddings output_attentions "
    "partial_rotary_factor per_layer_attributes per_layer_config push_to_hub "
    "register_for_auto_class save_pretrained serialize_explicit_per_layer_config "
    "standardize_rope_params sub_configs text_config text_encoder to_dict to_diff_dict "
    "to_json_file to_json_string update update_from_string use_return_dict").split())


def _is_reserved(key: str) -> bool:
    if key in ("model_type", "torch_dtype", "rope_scaling", "rope_theta", "_name_or_path"):
        return False  # handled below
    return key in RESERVED_KEYS or key.startswith(("_", "validate"))


# ---------------------------------------------------------------------- post-init
def _llama_post_init(values: dict, extras: dict) -> bool:
    heads = values["num_attention_heads"]
    if heads == 0 or values["hidden_size"] % heads != 0:  # transformers raises
        return False
    if not 0.0 <= values["initializer_range"] <= 1.0:  # its interval validator raises
        return False
    if values["head_dim"] is None:
        values["head_dim"] = values["hidden_size"] // heads
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = heads
    return _standardize_rope(values, extras, layer_types=None)


def _qwen_post_init(values: dict, extras: dict) -> bool:
    if not values["use_sliding_window"]:
        values["sliding_window"] = None
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if values["layer_types"] is None:
        values["layer_types"] = [
            "sliding_attention"
            if values["sliding_window"] is not None and i >= values["max_window_layers"]
            else "full_attention"
            for i in range(values["num_hidden_layers"])]
    return _standardize_rope(values, extras, layer_types=values["layer_types"])


def _encoder_post_init(values: dict, extras: dict) -> bool:
    # No rope_parameters field: transformers would warn about or reinterpret rope keys.
    return not any(k in extras for k in ("rope_scaling", "rope_theta", "rope_parameters"))


_POST_INIT = {"llama": _llama_post_init, "qwen2": _qwen_post_init, "qwen3": _qwen_post_init,
              "bert": _encoder_post_init, "roberta": _encoder_post_init,
              "xlm-roberta": _encoder_post_init}

_DEFAULT_THETA = 10000.0
# rope_type -> (required keys, optional keys) of transformers' rope validation; a rope
# type spindle does not run is left to transformers.
_ROPE_KEYS = {
    "default": ({"rope_type"}, {"rope_theta", "partial_rotary_factor"}),
    "llama3": ({"rope_type", "factor", "original_max_position_embeddings", "low_freq_factor",
                "high_freq_factor", "rope_theta"}, {"partial_rotary_factor"}),
}


def _standardize_rope(values: dict, extras: dict, layer_types: list | None) -> bool:
    """transformers' convert_rope_params_to_dict + standardize_rope_params + validate_rope,
    for one global rope dict."""
    rope_scaling = extras.pop("rope_scaling", None)
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        return False
    params = rope_scaling or values["rope_parameters"]
    params = dict(params) if params is not None else {}
    params.setdefault("rope_theta", extras.pop("rope_theta", _DEFAULT_THETA))
    if layer_types is not None and not set(params).isdisjoint(layer_types):
        return False  # per-layer-type rope parameters
    params.setdefault("rope_type", params.get("type", "default"))
    rope_type = params["rope_type"]
    if not isinstance(rope_type, str) or rope_type not in _ROPE_KEYS:
        return False
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", values["max_position_embeddings"])
    required, optional = _ROPE_KEYS[rope_type]
    received = set(params)
    if "type" in received:
        received.discard("type")
    if not received >= required or received - required - optional:
        return False  # transformers raises or warns
    if rope_type == "llama3" and not _llama3_rope_ok(params, values["max_position_embeddings"]):
        return False
    values["rope_parameters"] = params
    return True


def _llama3_rope_ok(params: dict, max_position_embeddings: int) -> bool:
    num = (int, float)
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    return (isinstance(factor, num) and factor >= 1.0 and isinstance(low, num)
            and isinstance(high, num) and high > low and type(original) is int
            and original < max_position_embeddings)


def _base_post_init(values: dict, extras: dict) -> bool:
    """PreTrainedConfig.__post_init__ for the keys it treats specially."""
    torch_dtype = extras.pop("torch_dtype", None)
    if torch_dtype is not None and values["dtype"] is None:
        values["dtype"] = torch_dtype
    if values["dtype"] is not None:
        if not isinstance(values["dtype"], str):
            return False
        import torch

        dtype = getattr(torch, values["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            return False
        values["dtype"] = dtype
    if values["id2label"] is None:
        values["id2label"] = {0: "LABEL_0", 1: "LABEL_1"}
        values["label2id"] = {"LABEL_0": 0, "LABEL_1": 1}
    else:
        try:
            values["id2label"] = {int(k): v for k, v in values["id2label"].items()}
        except ValueError:
            return False
    if values["is_encoder_decoder"]:
        return False
    for key in GENERATION_PARAMS:
        extras.pop(key, None)
    return True


def _validates(values: dict) -> bool:
    """The checks of transformers' validate() that raise or warn, for these configs."""
    layer_types = values.get("layer_types")  # (a field of qwen, an extra key of llama)
    if layer_types is not None and not (
            _type_ok("strs", layer_types)
            and set(layer_types) <= {"full_attention", "sliding_attention"}
            and len(layer_types) == values["num_hidden_layers"]):
        return False
    vocab = values["vocab_size"]
    return not any(name.endswith("_token_id") and isinstance(value, int)
                   and not 0 <= value < vocab for name, value in values.items())


# ---------------------------------------------------------------------- helpers
@functools.lru_cache(maxsize=1)
def tested_transformers() -> bool:
    """Whether the installed transformers is one the tables model (read from its
    package metadata: importing it is what this module avoids)."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return False
    match = re.match(r"(\d+)\.(\d+)", version)
    return match is not None and (int(match[1]), int(match[2])) in TESTED_TRANSFORMERS


def _type_ok(spec: str, value: Any) -> bool:
    if spec.endswith("?"):
        if value is None:
            return True
        spec = spec[:-1]
    if spec == "int":
        return type(value) is int
    if spec == "float":
        return type(value) is float
    if spec == "num":
        return type(value) in (int, float)
    if spec == "bool":
        return type(value) is bool
    if spec == "str":
        return type(value) is str
    if spec == "strs":
        return type(value) is list and all(type(v) is str for v in value)
    if spec == "ids":
        return value is None or type(value) is int or (
            type(value) is list and all(type(v) is int for v in value))
    if spec == "dict":
        return type(value) is dict
    if spec == "id2label":  # dict[str, str] in JSON (keys become ints)
        return type(value) is dict and all(type(k) is str and type(v) is str
                                           for k, v in value.items())
    if spec == "label2id":  # dict[str, int] | dict[str, str]
        return type(value) is dict and all(type(k) is str for k in value) and (
            all(type(v) is int for v in value.values())
            or all(type(v) is str for v in value.values()))
    if spec == "none":
        return value is None
    raise ValueError(f"unknown type spec {spec!r}")


def _has_special_values(obj: Any) -> bool:
    """Infinity / NaN (tagged {"__float__": ...} in JSON, or bare), which transformers decodes."""
    if isinstance(obj, dict):
        return "__float__" in obj or any(_has_special_values(v) for v in obj.values())
    if isinstance(obj, list):
        return any(_has_special_values(v) for v in obj)
    return isinstance(obj, float) and not math.isfinite(obj)


_COMMIT_HASH = re.compile(r"[0-9a-f]{40}")


def hub_commit_hash(resolved_file: str) -> str | None:
    """The commit of a file inside the Hugging Face hub cache (.../snapshots/<hash>/...)."""
    found = re.search(r"snapshots/([^/]+)/", Path(resolved_file).as_posix())
    if found is None:
        return None
    return found.group(1) if _COMMIT_HASH.match(found.group(1)) else None
