"""Every on/off environment switch reads "0" or "1" and refuses anything else by name: a
user who writes SPINDLE_PDL=off or SPINDLE_SERVER_DEV_MODE=true must not get the
opposite of what they asked for in silence."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from spindle import switches
from spindle.attention import metadata
from spindle.attention.backends import triton_attn
from spindle.layers import cpu_kernels, int8_head, norm, pdl, skinny_gemm
from spindle import start_cache
from spindle.runner import compile_ahead, cuda_graph, graph_advance
from spindle.runner.sample import sampler


def test_on_off_reads_zero_and_one_and_falls_back_to_the_default():
    assert switches.on_off("X", True, {}) is True
    assert switches.on_off("X", False, {}) is False
    assert switches.on_off("X", False, {"X": "1"}) is True
    assert switches.on_off("X", True, {"X": "0"}) is False


@pytest.mark.parametrize("value", ["", "true", "off", "yes", " 1", "2"])
def test_on_off_refuses_other_values_naming_the_variable(value):
    with pytest.raises(ValueError, match="SPINDLE_X must be 0 or 1"):
        switches.on_off("SPINDLE_X", True, {"SPINDLE_X": value})


def _bf16_cpu_hidden():
    return torch.zeros(2, 16, dtype=torch.bfloat16)


def _tokens_to_host():
    """The ring switch's reader, with the advance it needs on."""
    from unittest import mock

    with mock.patch.dict(os.environ, {"SPINDLE_GRAPH_ADVANCE": "1"}):
        return graph_advance.tokens_to_host_enabled()


def _skinny_applies():
    x = torch.zeros(2, 16, dtype=torch.bfloat16)
    return skinny_gemm.skinny_gemm_applies(x, torch.zeros(8, 16, dtype=torch.bfloat16))


READERS = {
    "SPINDLE_COMPILE_AHEAD": compile_ahead.switched_on,
    "SPINDLE_CPU_KERNELS": cpu_kernels.switched_on,
    "SPINDLE_CPU_INT8_HEAD": int8_head.enabled,
    "SPINDLE_CPU_FP32_RESIDUAL": lambda: norm.fp32_residual_stream(_bf16_cpu_hidden()),
    "SPINDLE_START_CACHE": start_cache.enabled,
    "SPINDLE_SKINNY_GEMM": _skinny_applies,
    "SPINDLE_PDL": lambda: pdl.enabled(torch.device("cpu")),
    "SPINDLE_DECODE_LONGEST_FIRST": metadata.longest_first_enabled,
    "SPINDLE_MIXED_DECODE_KERNEL": metadata.mixed_split_enabled,
    "SPINDLE_DECODE_PER_HEAD": lambda: triton_attn.per_head_applies(1, 128),
    "SPINDLE_GRAPH_ARGMAX": cuda_graph.graph_argmax_enabled,
    "SPINDLE_GRAPH_FEED": cuda_graph.graph_feed_enabled,
    "SPINDLE_GRAPH_ADVANCE": graph_advance.graph_advance_enabled,
    "SPINDLE_GRAPH_TOKENS_TO_HOST": _tokens_to_host,
    "SPINDLE_GREEDY_KERNEL": lambda: sampler.raw_argmax(torch.zeros(1, 4)),
}


@pytest.mark.parametrize("name", sorted(READERS))
def test_each_switch_refuses_a_word(name, monkeypatch):
    monkeypatch.setenv(name, "off")
    with pytest.raises(ValueError, match=f"{name} must be 0 or 1, got 'off'"):
        READERS[name]()


@pytest.mark.parametrize("name", sorted(READERS))
def test_each_switch_takes_zero_and_one(name, monkeypatch):
    for value in ("0", "1"):
        monkeypatch.setenv(name, value)
        READERS[name]()  # no error; what each switch changes is tested where it acts


@pytest.mark.parametrize("name, call", [
    ("SPINDLE_CPU_BF16_GEMM", "cpu_kernels.bf16_linear(torch.zeros(2, 32, dtype=torch.bfloat16), "
                              "torch.zeros(64, 32, dtype=torch.bfloat16), None)"),
])
def test_the_fused_cpu_kernels_switches_refuse_a_word(name, call):
    """The C++ kernels read their switches once per process: a fresh one each time."""
    if not cpu_kernels.available():
        pytest.skip("the fused CPU kernels are not built here")
    script = f"import torch\nfrom spindle.layers import cpu_kernels\n{call}\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, name: "no"}, timeout=120)
    assert done.returncode != 0
    assert f"{name} must be 0 or 1, got 'no'" in done.stderr, done.stderr[-2000:]


def test_kernel_switch_settings_name_the_switches_but_not_secrets_or_paths():
    """What a kernel plan's fingerprint takes from the environment: every SPINDLE_*
    setting that may choose kernels (an unknown one too), sorted, without the API key,
    paths and logging."""
    environ = {"SPINDLE_PDL": "0", "SPINDLE_GRAPH_ADVANCE": "1", "SPINDLE_NEW_KNOB": "3",
               "SPINDLE_API_KEY": "secret", "SPINDLE_START_CACHE_DIR": "/tmp/x",
               "SPINDLE_LOG_LEVEL": "DEBUG", "PATH": "/bin"}
    assert switches.kernel_switch_settings(environ) == \
        "SPINDLE_GRAPH_ADVANCE=1;SPINDLE_NEW_KNOB=3;SPINDLE_PDL=0"
    assert switches.kernel_switch_settings({"SPINDLE_LOG_LEVEL": "INFO"}) == ""
