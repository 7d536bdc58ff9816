"""MambaForCausalLM and FalconMambaForCausalLM: pure state-space models of Mamba
(version 1) mixers, each block ``x + mixer(norm(x))`` (no attention, no MLP, no
positions).

Mamba2ForCausalLM's backbone (models/mamba2.py: the float32 residual stream of
``residual_in_fp32``, ``norm_f``, a tied head by default, transformers' checkpoint
names) with the selective-scan mixer of layers/mamba/mamba1_mixer.py: each state
element decays at its own rate, the SSM state kept in float32 as transformers keeps it.
FalconMamba normalises dt, B and C by their RMS (no weights, ``mixer_rms_eps``) before
they are used; Mamba does not.
"""

from __future__ import annotations

from typing import Any

from spindle.layers.mamba.mamba1_mixer import falcon_mamba_mixer, mamba_mixer
from spindle.models.mamba2 import Mamba2ForCausalLM


def check_supported_config(hf_config: Any) -> None:
    """Reject config features this implementation would silently get wrong."""
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
    if not isinstance(hf_config.time_step_rank, int):
        raise ValueError(f"time_step_rank must be an integer (or 'auto' in config.json), "
                         f"got {hf_config.time_step_rank!r}")


class MambaForCausalLM(Mamba2ForCausalLM):
    check_config = staticmethod(check_supported_config)
    block_mixer = staticmethod(mamba_mixer)


class FalconMambaForCausalLM(MambaForCausalLM):
    block_mixer = staticmethod(falcon_mamba_mixer)
