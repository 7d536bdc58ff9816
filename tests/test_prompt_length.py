"""One big prompt must not stall everyone: prompts are tokenized off the engine's
thread, a prompt far over max_model_len is refused from its length in characters
before it is tokenized (a sound lower bound on its token count), and one that
passes that bound is refused on its token count before its ids are built."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from spindle import LLM, SamplingParams
from spindle.config import EngineArgs
from spindle.engine.async_llm import AsyncLLM
from spindle.engine.prompt_length import PromptLengthBound, count_then_encode

MAX_MODEL_LEN = 256
ENGINE = dict(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
ALPHABET = "abc xyz\n\t  é ü 中文 🙂 <|im_start|> e\u0301 ----####    "


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(str(tiny_model(arch="llama")))


def random_texts(count: int, seed: int = 0) -> list[str]:
    rnd = random.Random(seed)
    return ["".join(rnd.choice(ALPHABET) for _ in range(rnd.randint(1, 2000)))
            for _ in range(count)]


# ---- the bound and the count ---------------------------------------------------------------
def test_the_bound_never_exceeds_the_token_count(tokenizer):
    bound = PromptLengthBound(tokenizer)
    texts = random_texts(200) + ["#" * 20000, " " * 20000, "ab" * 9000, "\u1100\u1161" * 3000]
    for text in texts:
        assert bound.min_tokens(text) <= len(tokenizer.encode(text)), text[:40]
    # It is tight where the text is made of the longest token.
    longest = max(tokenizer.get_vocab(), key=len)
    text = tokenizer.convert_tokens_to_string([longest]) * 1000
    assert bound.min_tokens(text) >= 0.9 * len(tokenizer.encode(text)) > 0


def _fast(model, pre_tokenizer=None, normalizer=None) -> PreTrainedTokenizerFast:
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizer
    backend.normalizer = normalizer
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.parametrize("tok", [
    # Whitespace is dropped: "a      b" is 2 tokens for 8 characters.
    _fast(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"),
          pre_tokenizers.Whitespace()),
    # A whole unknown word is one token.
    _fast(models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]"), pre_tokenizers.Whitespace()),
    # A run of unknown characters fuses into one token.
    _fast(models.BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>", fuse_unk=True)),
    # Characters without a token vanish.
    _fast(models.BPE({"a": 0}, [])),
    # The normalizer removes characters.
    _fast(models.BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>"),
          normalizer=normalizers.StripAccents()),
], ids=["whitespace-dropped", "unknown-word", "fused-unknown", "no-unknown", "strip-accents"])
def test_no_bound_where_characters_may_vanish(tok):
    assert PromptLengthBound(tok).min_tokens("a" * 100000) == 0


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_count_then_encode_equals_encode(tokenizer, add_special_tokens):
    counts = []
    for text in random_texts(50, seed=1):
        ids = count_then_encode(tokenizer, text, add_special_tokens, counts.append)
        assert ids == tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert counts[-1] == len(ids)


def test_the_count_is_checked_before_the_ids_are_built(tokenizer):
    def refuse(count):
        raise ValueError(f"{count} tokens")

    with pytest.raises(ValueError, match=str(len(tokenizer.encode("hello world" * 50)))):
        count_then_encode(tokenizer, "hello world" * 50, True, refuse)


# ---- through LLM ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = LLM(str(tiny_model(arch="llama")), **ENGINE)
    yield engine
    engine.shutdown()


def test_a_huge_prompt_is_refused_before_it_is_tokenized(llm, monkeypatch):
    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the prompt was tokenized")

    monkeypatch.setattr(llm.engine.tokenizer, "encode", no_tokenizing)
    with pytest.raises(ValueError, match=r"at least \d+ tokens \(1000000 characters\).*"
                                         f"max_model_len is {MAX_MODEL_LEN}"):
        llm.generate("word " * 200000, SamplingParams(max_tokens=2), use_tqdm=False)


def test_a_prompt_the_bound_lets_through_is_refused_on_its_count(llm):
    text = "é ü " * 200  # 800 characters, not ASCII: the bound says little
    count = len(llm.get_tokenizer().encode(text))
    assert count >= MAX_MODEL_LEN
    with pytest.raises(ValueError, match=f"prompt is {count} tokens long, but max_model_len"):
        llm.generate(text, SamplingParams(max_tokens=2), use_tqdm=False)
    out = llm.generate("é ü " * 10, SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


# ---- through AsyncLLM: tokenizing never stalls the running requests ----------------------------
def test_a_slow_tokenization_does_not_stall_a_running_stream(tiny_model, monkeypatch):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_model(arch="llama")), **ENGINE))
    entered, release = threading.Event(), threading.Event()
    inside = []  # non-empty while the slow tokenization runs
    real = {}  # the tokenizer's own encode

    def slow_encode(text, *args, **kwargs):
        if "SLOW" in text:  # a tokenization that takes as long as the test needs
            inside.append(1)
            entered.set()
            release.wait(60)
            inside.clear()
        return real["encode"](text, *args, **kwargs)

    long = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN - 10, ignore_eos=True)

    async def main():
        tokenizer = await engine.call(lambda e: e.tokenizer)
        real["encode"] = tokenizer.encode
        monkeypatch.setattr(tokenizer, "encode", slow_encode)
        stream = await engine.add_request("Hello there", long)
        tokens_before = 0
        async for output in stream:
            tokens_before = len(output.outputs[0].token_ids)
            if tokens_before:
                break
        slow = asyncio.create_task(engine.add_request("SLOW prompt", SamplingParams(max_tokens=2)))
        assert await asyncio.to_thread(entered.wait, 30)
        try:  # while that prompt is being tokenized, the stream goes on
            async for output in stream:
                if len(output.outputs[0].token_ids) >= tokens_before + 5:
                    break
            assert inside, "the stream waited for the other prompt's tokenization"
        finally:
            release.set()
        slow_output = [o async for o in await slow][-1]
        assert len(slow_output.outputs[0].token_ids) == 2
        stream.close()

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        release.set()
        engine.shutdown()
