"""How an embedding model turns token states into one vector: PoolerConfig.

Read once, at config time, from the checkpoint's sentence-transformers files when
they exist (modules.json, its Pooling module's config.json,
sentence_bert_config.json), so spindle pools exactly as sentence-transformers
does; otherwise from defaults by model kind (CLS for encoders, the last token for
decoders, normalised). Engine arguments override both. A sentence-transformers
pipeline spindle cannot reproduce (Dense layers, max pooling, ...) is refused
with an error naming the module, never approximated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POOLING_TYPES = ("mean", "cls", "last")
_ST_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
_ST_LEGACY_KEYS = {  # the order sentence-transformers concatenates them in
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_ST_SUPPORTED_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str  # one of POOLING_TYPES
    normalize: bool  # L2-normalise the pooled vector (a request may override)
    max_seq_len: int  # prompts are truncated to this many tokens, special tokens included
    do_lower_case: bool  # lower-case text before tokenizing (sentence-transformers' option)
    source: str  # "sentence-transformers" or "defaults", for logs and errors

    @staticmethod
    def create(model_dir: str | Path, model_kind: str, max_model_len: int,
               pooling_type: str | None = None, normalize: bool | None = None) -> "PoolerConfig":
        """The pooler of the checkpoint in model_dir; pooling_type / normalize, when not
        None, override what the checkpoint says."""
        st = read_sentence_transformers_config(Path(model_dir))
        default_type = "cls" if model_kind == "encoder" else "last"
        chosen_type = pooling_type or st.get("pooling_type") or default_type
        if chosen_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {chosen_type!r}")
        chosen_norm = normalize if normalize is not None else st.get("normalize", True)
        max_seq_len = min(st.get("max_seq_length") or max_model_len, max_model_len)
        return PoolerConfig(pooling_type=chosen_type, normalize=bool(chosen_norm),
                            max_seq_len=max_seq_len,
                            do_lower_case=bool(st.get("do_lower_case", False)),
                            source="sentence-transformers" if st else "defaults")


def read_sentence_transformers_config(model_dir: Path) -> dict[str, Any]:
    """{pooling_type, normalize, max_seq_length, do_lower_case} as far as the
    checkpoint's sentence-transformers files give them; {} without modules.json."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return {}
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file} must hold a list of modules")
    found: dict[str, Any] = {"normalize": False}
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _ST_SUPPORTED_MODULES:
            raise ValueError(f"{modules_file}: sentence-transformers module {kind!r} is not "
                             f"supported (supported: {', '.join(_ST_SUPPORTED_MODULES)})")
        if kind == "Pooling":
            found["pooling_type"] = _pooling_type(model_dir / module.get("path", ""))
        elif kind == "Normalize":
            found["normalize"] = True
    bert_config = model_dir / "sentence_bert_config.json"
    if bert_config.is_file():
        settings = _read_json(bert_config)
        found["max_seq_length"] = settings.get("max_seq_length")
        found["do_lower_case"] = settings.get("do_lower_case", False)
    return found


def _pooling_type(pooling_dir: Path) -> str:
    config_file = pooling_dir / "config.json"
    if not config_file.is_file():
        return "mean"  # sentence-transformers' Pooling default
    config = _read_json(config_file)
    if config.get("include_prompt", True) is False:
        raise ValueError(f"{config_file}: include_prompt=false is not supported")
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in _ST_LEGACY_KEYS.items() if config.get(key)] or ["mean"]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(f"{config_file}: pooling mode {modes} is not supported "
                         f"(one of {sorted(_ST_MODES)})")
    return _ST_MODES[modes[0]]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
