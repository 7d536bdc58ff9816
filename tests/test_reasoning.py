"""Reasoning parsers (`spindle serve --reasoning-parser`): <think>...</think> split off
into reasoning_content, whole and streamed, the stream cut anywhere; and
chat_template_kwargs reaching the template."""

from __future__ import annotations

import random

import pytest

from server_utils import official_client, served
from spindle import LLM, SamplingParams, StructuredOutputsParams
from spindle.entrypoints.reasoning import ReasoningSplitter, split_reasoning

CHAT = [{"role": "user", "content": "Is water wet?"}]
# The answer opens its reasoning itself, as Qwen3's do; the regex makes the random
# model write one.
THINKING = r"<think>\n[a-z ]{1,24}\n</think>\n\n(Yes|No)[a-z ]{0,12}\."
TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{%- endfor %}<|im_start|>assistant\n{%- if enable_thinking is defined and not "
            "enable_thinking %}<think>\n\n</think>\n\n{%- endif %}")


@pytest.mark.parametrize("parser, text, expected", [
    ("qwen3", "<think>\nplan a b</think>\n\nThe answer.", ("\nplan a b", "The answer.")),
    ("qwen3", "Hello there", (None, "Hello there")),
    ("qwen3", "  <think>cut short", ("cut short", None)),
    ("qwen3", "<thinking is not a tag", (None, "<thinking is not a tag")),
    ("qwen3", "", (None, None)),
    ("deepseek_r1", "plan</think>\n\nAnswer </", ("plan", "Answer </")),
    ("deepseek_r1", "still thinking </thi", ("still thinking </thi", None)),
    ("deepseek_r1", "</think>only reply", (None, "only reply")),
])
def test_a_split_streamed_in_any_pieces_equals_the_whole(parser, text, expected):
    assert split_reasoning(text, parser) == expected
    for seed in range(40):
        rng = random.Random(seed)
        splitter, thought, reply, i = ReasoningSplitter(parser), "", "", 0
        while i < len(text):
            j = i + rng.randint(1, 5)
            a, b = splitter.feed(text[i:j])
            thought, reply, i = thought + a, reply + b, j
        a, b = splitter.feed("", final=True)
        assert ((thought + a) or None, (reply + b) or None) == expected


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="qwen3"):
        ReasoningSplitter("o1")


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    yield from served(tmp_path_factory, str(tiny_model(arch="llama")), "--device", "cpu",
                      "--dtype", "float32", "--max-model-len", "512", "--served-model-name",
                      "tiny", "--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def offline(tiny_model):
    llm = LLM(str(tiny_model(arch="llama")), device="cpu", dtype="float32", max_model_len=512)
    yield llm
    llm.shutdown()


def test_reasoning_content_whole_and_streamed_equal_the_offline_split(server, offline):
    params = SamplingParams(temperature=0.0, max_tokens=80,
                            structured_outputs=StructuredOutputsParams(regex=THINKING))
    text = offline.chat(CHAT, params, use_tqdm=False)[0].outputs[0].text
    thought, reply = split_reasoning(text, "qwen3")
    assert thought and reply and "<think>" not in thought + reply
    client = official_client(server)
    body = dict(model="tiny", messages=CHAT, temperature=0, max_tokens=80,
                extra_body={"structured_outputs": {"regex": THINKING}})
    message = client.chat.completions.create(**body).choices[0].message
    assert (message.reasoning_content, message.content) == (thought, reply)
    chunks = list(client.chat.completions.create(stream=True, **body))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == reply
    plain = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0,
                                           max_tokens=8).choices[0].message
    assert getattr(plain, "reasoning_content", None) is None and plain.content


def test_chat_template_kwargs_reach_the_template(server, offline):
    prompt = offline.render_chat(CHAT, chat_template=TEMPLATE,
                                 chat_template_kwargs={"enable_thinking": False})["prompt"]
    assert prompt.endswith("assistant<think>\n\n</think>")
    assert "<think>" not in offline.render_chat(CHAT, chat_template=TEMPLATE)["prompt"]
    client = official_client(server)
    usage = [client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=2,
        extra_body={"chat_template": TEMPLATE, "chat_template_kwargs": kwargs}).usage
        for kwargs in ({"enable_thinking": False}, {})]
    assert usage[0].prompt_tokens > usage[1].prompt_tokens
    with pytest.raises(ValueError, match="tokenize"):
        offline.render_chat(CHAT, chat_template_kwargs={"tokenize": True})
