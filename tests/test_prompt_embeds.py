"""Prompts given as embeddings (PromptEmbedsState): the same greedy output as the
token ids they embed, for Llama and Qwen3, alone, mixed with id prompts and
chunked; and the refusals, at config time and per request."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from spindle import LLM, SamplingParams
from spindle.runner.model_states.prompt_embeds import PromptEmbedsState

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TEXTS = ["def fibonacci(n):\n    return", "import json\n\nclass Decoder:",
         "The quick brown fox jumps over the lazy dog, " * 3]


def embedding_rows(path, token_ids: list[int]) -> torch.Tensor:
    """The checkpoint's embedding-table rows of token_ids (read from the safetensors)."""
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    return table[torch.tensor(token_ids)].float()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prompt_embeds_generate_like_their_token_ids(tiny_model, arch):
    path = tiny_model(arch=arch)
    # A step budget of 16 tokens splits the long prompt into chunks, so embeddings
    # are placed for partial prompts too (and for the last prompt token alone).
    llm = LLM(str(path), device="cpu", max_model_len=128, enable_prompt_embeds=True,
              enable_prefix_caching=False, max_num_batched_tokens=16)
    try:
        ids = [llm.get_tokenizer().encode(t) for t in TEXTS]
        assert max(len(i) for i in ids) > 16
        embeds = [{"prompt_embeds": embedding_rows(path, i)} for i in ids]
        from_ids = llm.generate(ids, GREEDY, use_tqdm=False)
        from_embeds = llm.generate(embeds, GREEDY, use_tqdm=False)
        mixed = llm.generate([embeds[0], ids[1], embeds[2]], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    for a, b, c in zip(from_ids, from_embeds, mixed):
        assert len(a.outputs[0].token_ids) == 12
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert c.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].text == a.outputs[0].text
    assert from_embeds[0].prompt_token_ids == []  # placeholders are not shown


def test_embeddings_go_to_the_device_once_per_request(tiny_model, monkeypatch):
    calls = []
    original = PromptEmbedsState.preprocess_state

    def spy(self, state, new):
        calls.append((new.req_id, new.prompt_embeds is not None))
        return original(self, state, new)

    monkeypatch.setattr(PromptEmbedsState, "preprocess_state", spy)
    path = tiny_model(arch="llama")
    llm = LLM(str(path), device="cpu", max_model_len=128, enable_prompt_embeds=True,
              enable_prefix_caching=False, max_num_batched_tokens=8)
    try:
        ids = llm.get_tokenizer().encode(TEXTS[2])
        out = llm.generate({"prompt_embeds": embedding_rows(path, ids)[None]},  # [1, T, H] too
                           GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(out[0].outputs[0].token_ids) == 12  # several prefill chunks, then decodes
    assert [c for c in calls if not c[0].startswith("__warmup")] == [("0", True)]


def test_prefix_caching_is_refused_at_config_time(tiny_model):
    path = tiny_model(arch="llama")
    with pytest.raises(ValueError, match="enable_prefix_caching=False"):
        LLM(str(path), device="cpu", enable_prompt_embeds=True)


def test_encoders_refuse_prompt_embeds_at_config_time(tmp_path):
    config = {"architectures": ["BertModel"], "model_type": "bert", "vocab_size": 100,
              "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
              "intermediate_size": 32, "max_position_embeddings": 32}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="enable_prompt_embeds is not supported for encoder"):
        LLM(str(tmp_path), device="cpu", enable_prompt_embeds=True, enable_prefix_caching=False)


def test_bad_prompt_embeds_fail_alone(tiny_model):
    path = tiny_model(arch="llama")
    plain = LLM(str(path), device="cpu", max_model_len=64)
    try:
        with pytest.raises(ValueError, match="enable_prompt_embeds=True"):
            plain.generate({"prompt_embeds": torch.zeros(3, 64)}, GREEDY, use_tqdm=False)
    finally:
        plain.shutdown()
    llm = LLM(str(path), device="cpu", max_model_len=64, enable_prompt_embeds=True,
              enable_prefix_caching=False)
    try:
        for bad, match in [(torch.zeros(3, 65), "shape"), (torch.zeros(0, 64), "shape"),
                           (torch.zeros(3, 64, dtype=torch.int64), "floating-point"),
                           (torch.full((3, 64), float("nan")), "NaN"),
                           (torch.zeros(64, 64), "max_model_len")]:
            with pytest.raises(ValueError, match=match):
                llm.generate({"prompt_embeds": bad}, GREEDY, use_tqdm=False)
        ok = llm.generate({"prompt_embeds": embedding_rows(path, [5, 6, 7])},
                          SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        assert len(ok[0].outputs[0].token_ids) == 2  # the engine keeps serving
    finally:
        llm.shutdown()
