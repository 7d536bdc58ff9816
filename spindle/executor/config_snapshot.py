"""The engine config as sent to worker processes: the HF config becomes plain data.

Unpickling a transformers config object imports transformers (1 to 4 s of CPU time
on a 2-core CPU, depending on its version: docs/benchmarks.md). Workers read the HF
config only through attributes (getattr), so they get a ConfigSnapshot instead
(hf_config.py); with the start cache on, the engine holds one already.
"""

from __future__ import annotations

import dataclasses

from spindle.config import EngineConfig
from spindle.hf_config import ConfigSnapshot, snapshot_hf_config

__all__ = ["config_for_workers"]


def config_for_workers(config: EngineConfig) -> EngineConfig:
    """config with its HF config replaced by a ConfigSnapshot (already one: unchanged)."""
    hf_config = config.model.hf_config
    if isinstance(hf_config, ConfigSnapshot) or hf_config is None:
        return config
    model = dataclasses.replace(config.model, hf_config=snapshot_hf_config(hf_config))
    return config.replace(model=model)
