"""CudaGraphRunner's bookkeeping without a GPU: every graph is captured from the
forward of its own shape. (Its graphs themselves run in the GPU tests; this caught a
capture that handed _forward its key (tokens per request, size, adapters) as
(size, tokens per request), which only a GPU run had shown.) Each graph's logits, where
the graphs compute them, come from its own hidden states."""

from __future__ import annotations

import contextlib
import types

import torch

from spindle.runner.cuda_graph import CudaGraphRunner


class _FakeGraph:
    def pool(self):
        return "pool"


def test_each_graph_is_captured_from_the_forward_of_its_own_shape(monkeypatch):
    shapes = [(4, 8, False), (4, 8, True), (1, 64, False), (1, 2, True)]
    calls = []
    fake = types.SimpleNamespace(
        pool=None, graphs={}, outputs={}, logits={}, device=torch.device("cpu"),
        with_logits=True, state=types.SimpleNamespace(compute_logits=lambda h: ("logits", h)),
        _each_shape=lambda: iter(shapes),
        _forward=lambda size, query_len=1, adapters=False: calls.append(
            (size, query_len, adapters)) or (size, query_len, adapters))
    fake._step = lambda *key: CudaGraphRunner._step(fake, *key)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    CudaGraphRunner.capture(fake)
    assert calls == [(size, query_len, adapters) for query_len, size, adapters in shapes]
    assert set(fake.graphs) == set(shapes)
    for (query_len, size, adapters), output in fake.outputs.items():
        assert output == (size, query_len, adapters)
        assert fake.logits[query_len, size, adapters] == ("logits", output)
