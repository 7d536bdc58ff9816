"""A real trained model against the oracle: greedy chat answers of SmolLM2-135M-Instruct
through spindle equal transformers' generate on the same checkpoint, token for token
(float32, CPU, prompts rendered with the checkpoint's chat template)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from spindle import LLM, SamplingParams

MAX_NEW = 32
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Tell me a fun fact about octopuses."}],
]


def hf_chat_greedy(path, conversations, max_new: int,
                   gguf_file: str | None = None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, new ids) per conversation: transformers' greedy generate, stopping
    at the checkpoint's end-of-sequence token as its generation config says
    (gguf_file: transformers reads that GGUF file in path instead)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spindle.models.gguf import one_reader_per_file

    source = {"gguf_file": gguf_file} if gguf_file else {}
    # (transformers opens a GGUF file three or four times, each decoding its whole
    # vocabulary: one reader serves them, reading the same bytes.)
    with one_reader_per_file() if gguf_file else contextlib.nullcontext():
        tokenizer = AutoTokenizer.from_pretrained(path, **source)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     **source).eval()
    results = []
    for conversation in conversations:
        text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new)
        results.append((ids[0].tolist(), out[0, ids.shape[1]:].tolist()))
    return results


@pytest.fixture(scope="module")
def expected(smollm2):
    return hf_chat_greedy(smollm2, CONVERSATIONS, MAX_NEW)


@pytest.fixture(scope="module")
def llm(smollm2):
    with LLM(str(smollm2), device="cpu", dtype="float32", max_model_len=1024,
             max_num_seqs=8, seed=0) as engine:
        yield engine


def test_chat_answers_match_transformers(llm, expected):
    """All conversations in one batch (continuous batching over ragged prompts): the
    rendered prompts, the answer tokens and their text equal transformers'."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llm.config.model.tokenizer)
    outputs = llm.chat(CONVERSATIONS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
                       use_tqdm=False)
    for i, (out, (prompt_ids, new_ids)) in enumerate(zip(outputs, expected)):
        answer = out.outputs[0]
        assert out.prompt_token_ids == prompt_ids, f"conversation {i}: prompt rendered differently"
        assert list(answer.token_ids) == new_ids, (
            f"conversation {i}: {answer.text!r} differs from transformers' "
            f"{tokenizer.decode(new_ids)!r}")
        assert answer.text == tokenizer.decode(new_ids, skip_special_tokens=True)
    # Real answers, not an immediate end of sequence: the comparison means something.
    assert all(len(new_ids) >= 5 for _, new_ids in expected)
