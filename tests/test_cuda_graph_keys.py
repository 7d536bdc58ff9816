"""CUDA graphs' bookkeeping without a GPU: every graph is captured from the forward of
its own shape (its graphs themselves run in the GPU tests; this caught a capture that
handed _forward its key (tokens per request, size, adapters) as (size, tokens per
request), which only a GPU run had shown), each graph's logits, where the graphs compute
them, come from its own hidden states, a step samples from those logits, and the KV
budget counts their buffer."""

from __future__ import annotations

import contextlib
import types

import numpy as np
import torch

from spindle.runner.cuda_graph import CudaGraphRunner


class _FakeGraph:
    def pool(self):
        return "pool"


def _fake_capture(monkeypatch, shapes, with_greedy: bool, feeds_inputs: bool = False,
                  advances: bool = False):
    """CudaGraphRunner.capture over shapes with no GPU: each forward returns its shape,
    the LM head ("logits", hidden), the argmax ("argmax", logits, the length of the
    input ids it also writes, or None, whether it advances the inputs); the forwards'
    shapes."""
    from spindle.runner import cuda_graph

    calls = []
    fake = types.SimpleNamespace(
        pool=None, graphs={}, outputs={}, device=torch.device("cpu"),
        with_logits=True, with_greedy=with_greedy, feeds_inputs=feeds_inputs,
        advances=advances, tokens_to_host=False, _ring=None,
        input_ids=torch.zeros(256, dtype=torch.int64),
        positions=torch.zeros(256, dtype=torch.int64), seq_lens=torch.zeros(8, dtype=torch.int32),
        _staged=torch.zeros(8, 256, dtype=torch.int64), num_paged=1, block_size=16,
        _tables=torch.zeros(1, 8, 4, dtype=torch.int32),
        state=types.SimpleNamespace(compute_logits=lambda h: ("logits", h)),
        _each_shape=lambda: iter(shapes),
        _forward=lambda size, query_len=1, adapters=False: calls.append(
            (size, query_len, adapters)) or (size, query_len, adapters))
    fake._step = lambda *key: CudaGraphRunner._step(fake, *key)
    fake._advancing = lambda *shape: CudaGraphRunner._advancing(fake, *shape)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(cuda_graph, "raw_argmax", lambda logits, into, next_inputs: (
        "argmax", logits, None if into is None else into_rows(into, fake.input_ids),
        next_inputs is not None and next_inputs.positions is fake.positions))
    CudaGraphRunner.capture(fake)
    return fake, calls


def into_rows(into: torch.Tensor, input_ids: torch.Tensor) -> int:
    """The number of input ids `into` is, checked to be their first rows."""
    if into.data_ptr() != input_ids.data_ptr() or into.stride() != (1,):
        raise AssertionError("the argmax is written somewhere other than the input ids")
    return into.numel()


def test_each_graph_is_captured_from_the_forward_of_its_own_shape(monkeypatch):
    """Each graph's hidden states, logits and (decode graphs of at most GREEDY_MAX_BATCH
    requests) greedy tokens come from its own shape's forward; with feeds_inputs the
    argmax is written into the first `size` input ids too, and with advances its kernel
    advances the graph's other inputs."""
    from spindle.runner.cuda_graph import GREEDY_MAX_BATCH

    shapes = [(4, 8, False), (4, 8, True), (1, 64, False), (1, GREEDY_MAX_BATCH + 1, False),
              (1, GREEDY_MAX_BATCH, True), (1, 2, True), (1, 1, False)]
    for feeds, advances in ((False, False), (True, False), (True, True)):
        fake, calls = _fake_capture(monkeypatch, shapes, with_greedy=True, feeds_inputs=feeds,
                                    advances=advances)
        assert calls == [(size, query_len, adapters) for query_len, size, adapters in shapes]
        assert set(fake.graphs) == set(shapes)
        for (query_len, size, adapters), output in fake.outputs.items():
            assert output.hidden == (size, query_len, adapters)
            assert output.logits == ("logits", output.hidden)
            takes_argmax = query_len == 1 and size <= GREEDY_MAX_BATCH
            expected = ("argmax", output.logits, size if feeds else None, advances)
            assert output.greedy == (expected if takes_argmax else None)
    fake, _ = _fake_capture(monkeypatch, shapes, with_greedy=False)
    assert all(output.greedy is None for output in fake.outputs.values())


def _greedy_metadata(rows: int):
    from spindle.runner.sample.metadata import SamplingMetadata

    return SamplingMetadata(temperature=torch.zeros(rows), all_greedy=True, all_random=False,
                            top_k=None, top_p=None, min_p=None)


def _sampling_runner():
    """A ModelRunner's attributes that _sample reads; the LM head must not run."""
    from spindle.runner.sample import Sampler

    def no_head(hidden):
        raise AssertionError("the LM head ran although the graph computed the logits")

    return types.SimpleNamespace(
        h2d=types.SimpleNamespace(put=lambda a, dtype: torch.as_tensor(a, dtype=dtype)),
        _require_state=lambda: types.SimpleNamespace(compute_logits=no_head),
        tp_group=types.SimpleNamespace(rank=0, broadcast=lambda t: t),
        input_batch=types.SimpleNamespace(
            needs_outputs=lambda req_ids: False,
            sampling_metadata=lambda req_ids, h2d: _greedy_metadata(len(req_ids))),
        sampler=Sampler(), _last_launched=None)


def test_a_step_samples_from_the_graphs_logits_of_its_sampling_rows():
    """Where the graph computed every token's logits, a step samples the rows of its
    sampling tokens from them: all of them in a decode step, a subset (a token of a
    prompt chunk that does not end its prompt samples nothing) otherwise."""
    from spindle.runner.model_runner import ModelRunner

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    hidden = torch.zeros(6, 8)
    for indices in ([0, 1, 2, 3, 4, 5], [1, 4, 5]):
        batch = types.SimpleNamespace(logits_indices=np.asarray(indices), num_tokens=6,
                                      draft_token_ids={}, sampling_req_ids=list(indices))
        sampled = ModelRunner._sample(_sampling_runner(), batch, hidden, logits)
        assert sampled.sampled_token_ids.tolist() == logits[indices].argmax(-1).tolist()


def test_a_step_takes_the_graphs_argmax_only_where_it_is_the_token():
    """The graph's argmax (here a marker unlike the logits' argmax) is the step's tokens
    where every token samples and the sampler wants nothing but the argmax; a subset of
    rows, or rows with logprobs or min_tokens, sample from the logits."""
    from spindle.runner.model_runner import ModelRunner

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    marker = torch.tensor([7, 7, 7, 7])
    every = types.SimpleNamespace(logits_indices=np.arange(4), num_tokens=4,
                                  draft_token_ids={}, sampling_req_ids=[0, 1, 2, 3])
    sampled = ModelRunner._sample(_sampling_runner(), every, torch.zeros(4, 8), logits, marker)
    assert sampled.sampled_token_ids is marker
    some = types.SimpleNamespace(logits_indices=np.asarray([1, 3]), num_tokens=4,
                                 draft_token_ids={}, sampling_req_ids=[1, 3])
    sampled = ModelRunner._sample(_sampling_runner(), some, torch.zeros(4, 8), logits, marker)
    assert sampled.sampled_token_ids.tolist() == logits[[1, 3]].argmax(-1).tolist()
    for extra in ({"max_num_logprobs": 2}, {"min_tokens_blocked": {0: {49}}}):
        runner = _sampling_runner()
        metadata = _greedy_metadata(4)
        for name, value in extra.items():
            setattr(metadata, name, value)
        runner.input_batch.sampling_metadata = lambda req_ids, h2d: metadata
        sampled = ModelRunner._sample(runner, every, torch.zeros(4, 8), logits, marker)
        assert sampled.sampled_token_ids.tolist() == logits.argmax(-1).tolist()


def test_the_kv_budget_counts_the_graphs_logits_only_where_they_are_computed(monkeypatch):
    """graph_logits_bytes: every captured graph's tokens (decode sizes, verifying steps,
    twice where adapters are served: each graph keeps its own logits) x the vocabulary x
    the model dtype's bytes; nothing without graphs (enforce_eager, pipeline stages, a
    state without graphs), with a pooler, with several tensor-parallel ranks (the head
    gathers across them outside the graphs) or with SPINDLE_GRAPH_LOGITS=0."""
    from spindle.runner.model_runner import ModelRunner

    def runner(enforce_eager=False, pooler=None, tp=1, spec=None, stages=1, graphs=True,
               lora=None):
        fake = types.SimpleNamespace(
            config=types.SimpleNamespace(
                device=types.SimpleNamespace(enforce_eager=enforce_eager,
                                             max_cudagraph_batch_size=64),
                model=types.SimpleNamespace(vocab_size=1000, dtype=torch.bfloat16),
                speculative=spec),
            pooler=pooler, tp_group=types.SimpleNamespace(size=tp), needs_kv_cache=True,
            stage=types.SimpleNamespace(size=stages), lora=lora,
            _require_state=lambda: types.SimpleNamespace(supports_cuda_graphs=graphs))
        for name in ("_graphs_compute_logits", "_captures_graphs", "_verify_shape"):
            setattr(fake, name, getattr(ModelRunner, name).__get__(fake))
        return ModelRunner.graph_logits_bytes(fake)

    decode = 1 + 2 + 4 + 8 + 16 + 24 + 32 + 48 + 64  # (the sizes captured up to 64)
    assert runner() == decode * 1000 * 2
    assert runner(lora=object()) == 2 * decode * 1000 * 2
    spec = types.SimpleNamespace(num_speculative_tokens=3, disable_by_batch_size=33)
    verify = 4 * (1 + 2 + 4 + 8 + 16 + 24 + 32)  # steps of 4 tokens, up to 32 requests
    assert runner(spec=spec) == (decode + verify) * 1000 * 2
    assert runner(enforce_eager=True) == runner(pooler=object()) == runner(tp=2) == 0
    assert runner(stages=2) == runner(graphs=False) == 0  # (no graphs at all there)
    monkeypatch.setenv("SPINDLE_GRAPH_LOGITS", "0")
    assert runner() == 0
