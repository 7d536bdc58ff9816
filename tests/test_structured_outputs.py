"""Structured outputs end to end: every token spindle samples is the best one the
checkpoint's transformers logits offer among those an outside matcher allows.

The oracle: the third-party `regex` package's partial matching (can these bytes still
become a match?) and Python's strict UTF-8 decoder, asked token by token over the whole
vocabulary; transformers' logits on the same checkpoint. spindle's own automata and
token tables (spindle/structured/) are what is tested.
"""

from __future__ import annotations

import codecs
import json

import numpy as np
import pytest
import torch

from spindle import LLM, SamplingParams
from spindle.sampling_params import StructuredOutputsParams
from spindle.structured.json_schema import schema_to_regex
from spindle.structured.vocab import TokenVocab, token_byte_strings

regex = pytest.importorskip("regex")
transformers = pytest.importorskip("transformers")

PROMPTS = ["def main():", "The answer is", "import"]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ada", "bob", "cy"]},
        "age": {"type": "integer"},
        "admin": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
    "required": ["name", "admin"],
}


@pytest.fixture(scope="module")
def llm(tiny_model):
    path = tiny_model("llama")
    engine = LLM(str(path), dtype="float32", device="cpu", max_model_len=256, max_num_seqs=4)
    yield engine, path
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_model(llm):
    _, path = llm
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def _utf8_prefix_ok(data: bytes) -> bool:
    """Whether data is valid UTF-8 up to a character it may still be completing."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
        return True
    except UnicodeDecodeError:
        return False


def _oracle_allowed(pattern: bytes, so_far: bytes, token_bytes: list[bytes | None],
                    eos_ids: set[int]) -> set[int]:
    """Token ids an outside matcher allows after so_far: those whose bytes keep the
    output a possible match (partial) and valid UTF-8; the end tokens where so_far is
    complete."""
    allowed = {i for i, b in enumerate(token_bytes) if b and _utf8_prefix_ok(so_far + b)
               and regex.fullmatch(pattern, so_far + b, partial=True) is not None}
    if regex.fullmatch(pattern, so_far) is not None:
        so_far.decode("utf-8")  # (a complete match is whole characters)
        allowed |= eos_ids
    return allowed


def _check_against_transformers(engine, hf_model, prompt: str, out_ids: list[int],
                                pattern: str) -> None:
    tokenizer = engine.get_tokenizer()
    eos_ids = engine.engine.eos_token_ids
    token_bytes = token_byte_strings(tokenizer.backend_tokenizer)
    prompt_ids = tokenizer(prompt)["input_ids"]
    so_far = b""
    for step, token in enumerate(out_ids):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt_ids + out_ids[:step]])).logits[0, -1]
        allowed = sorted(_oracle_allowed(pattern.encode(), so_far, token_bytes, eos_ids))
        assert token in allowed, (step, token, so_far)
        best = allowed[int(torch.argmax(logits[allowed]))]
        assert token == best, (step, token, best, so_far)
        if token not in eos_ids:
            so_far += token_bytes[token]


@pytest.mark.parametrize("pattern", [
    r"(yes|no|maybe)",
    r"[a-z]{2,8}@(example|test)\.(com|org)",
    r"-?\d{1,4}(\.\d{1,2})?",
    r"(def|class) [a-z_]{1,10}\((self)?\):",
])
def test_greedy_regex_equals_transformers_under_an_outside_matcher(llm, hf_model, pattern):
    for sample in _greedy_checked(llm, hf_model, StructuredOutputsParams(regex=pattern),
                                  pattern, max_tokens=40):
        assert sample.finish_reason == "stop", (pattern, sample.text)
        assert regex.fullmatch(pattern, sample.text), (pattern, sample.text)


def _greedy_checked(llm, hf_model, structured: StructuredOutputsParams, pattern: str,
                    max_tokens: int) -> list:
    """The greedy samples of PROMPTS under structured, each token checked against
    transformers' logits and the outside matcher of pattern."""
    engine, _ = llm
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                            structured_outputs=structured)
    samples = [out.outputs[0] for out in engine.generate(PROMPTS, params)]
    for prompt, sample in zip(PROMPTS, samples):
        _check_against_transformers(engine, hf_model, prompt, list(sample.token_ids), pattern)
    return samples


def _valid_person(doc: dict) -> bool:
    keys = list(doc)
    return (keys == [k for k in PERSON["properties"] if k in doc]
            and doc["name"] in ("ada", "bob", "cy") and isinstance(doc["admin"], bool)
            and ("age" not in doc or type(doc["age"]) is int)
            and ("tags" not in doc or (len(doc["tags"]) <= 2
                                       and set(doc["tags"]) <= {"x", "y"})))


def test_json_schema_outputs_parse_and_follow_transformers(llm, hf_model):
    samples = _greedy_checked(llm, hf_model, StructuredOutputsParams(json=PERSON),
                              schema_to_regex(PERSON), max_tokens=120)
    for sample in samples:
        if sample.finish_reason == "stop":
            assert _valid_person(json.loads(sample.text)), sample.text


def test_sampled_choices_and_json_objects_are_valid(llm):
    """Random sampling (seeded) under a choice and under json_object: every finished
    sample is one of the choices / parses as a JSON object."""
    engine, _ = llm
    choices = ["red", "green", "blue", "infrared"]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=20, n=4,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    for out in engine.generate(PROMPTS, params):
        for sample in out.outputs:
            assert sample.finish_reason == "stop" and sample.text in choices, sample.text
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=200, n=4,
                            structured_outputs=StructuredOutputsParams(json_object=True))
    finished = 0
    for out in engine.generate(PROMPTS, params):
        for sample in out.outputs:
            if sample.finish_reason == "stop":
                assert isinstance(json.loads(sample.text), dict), sample.text
                finished += 1
    assert finished > 0


def test_free_and_structured_requests_share_a_batch(llm):
    """A structured request beside free ones: the free ones sample as they would alone."""
    engine, _ = llm
    free = SamplingParams(temperature=0.0, max_tokens=12)
    alone = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, free)]
    structured = SamplingParams(temperature=0.0, max_tokens=12,
                                structured_outputs=StructuredOutputsParams(regex=r"[0-9]+"))
    mixed = engine.generate(PROMPTS + PROMPTS[:1], [free] * len(PROMPTS) + [structured])
    assert [o.outputs[0].token_ids for o in mixed[:len(PROMPTS)]] == alone
    assert regex.fullmatch(r"[0-9]+", mixed[-1].outputs[0].text)


@pytest.mark.parametrize("structured, message", [
    (dict(regex=r"(a"), "structured_outputs"),
    (dict(regex=r"(?=a)b"), "structured_outputs"),
    (dict(json={"type": "integer", "minimum": 3}), "minimum"),
    (dict(json={"type": "frobnicate"}), "frobnicate"),
    (dict(json=False), "false"),
])
def test_a_bad_grammar_fails_its_request_alone(llm, structured, message):
    engine, _ = llm
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**structured))
    with pytest.raises(ValueError, match=message):
        engine.generate(["hi"], params)
    assert engine.generate(["hi"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "exactly one"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(choice=[]), "choice"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(json={"enum": {1, 2}}), "no JSON data"),
    (dict(json_object=False), "exactly one"),
])
def test_structured_outputs_params_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("field, value", [("ignore_eos", True), ("min_tokens", 2),
                                          ("allowed_token_ids", [5])])
def test_what_structured_outputs_cannot_be_combined_with(field, value):
    with pytest.raises(ValueError, match=f"{field} cannot be combined"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"), **{field: value})


def test_token_bytes_of_a_byte_level_tokenizer(llm):
    """Every token whose bytes are whole UTF-8 decodes, alone, to exactly those bytes."""
    engine, _ = llm
    tokenizer = engine.get_tokenizer()
    token_bytes = token_byte_strings(tokenizer.backend_tokenizer)
    added = tokenizer.backend_tokenizer.get_added_tokens_decoder()
    checked = 0
    for token_id, data in enumerate(token_bytes):
        if data is None:
            assert added[token_id].special, token_id
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert tokenizer.decode([token_id]) == text, token_id
        checked += 1
    assert checked > 200


def test_token_bytes_of_a_sentencepiece_style_tokenizer():
    """Metaspace and byte-fallback tokens (Llama 2, Mistral): "▁" is a space, <0xHH> a
    byte; the bytes of a whole encoding are the decoded text's (the leading space the
    decoder strips aside)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for word in ["\u2581hello", "\u2581world", "\u2581", "h", "e", "l", "o", "w", "r", "d",
                 "\u2581h", "\u2581w"]:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>",
                                   byte_fallback=True))
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    token_bytes = token_byte_strings(backend)
    assert token_bytes[0] is None and token_bytes[2] is None
    assert token_bytes[3 + 0x0A] == b"\n" and token_bytes[vocab["\u2581hello"]] == b" hello"
    ids = backend.encode("hello\nwörld").ids
    assert b"".join(token_bytes[i] for i in ids) == b" " + backend.decode(ids).encode()


def test_the_vocabulary_walk_equals_a_token_by_token_walk(llm):
    from spindle.structured.regex_dfa import compile_regex

    engine, _ = llm
    token_bytes = token_byte_strings(engine.get_tokenizer().backend_tokenizer)
    vocab = TokenVocab(token_bytes, 600)
    dfa = compile_regex(schema_to_regex(PERSON))
    rng = np.random.default_rng(0)
    for state in rng.choice(dfa.num_states, size=min(20, dfa.num_states), replace=False):
        ends = dict(zip(vocab.token_ids.tolist(),
                        vocab.walk(dfa.transitions, dfa.byte_classes, int(state)).tolist()))
        for token_id, data in enumerate(token_bytes):
            if data:
                assert ends[token_id] == dfa.walk(int(state), data), (state, token_id)


def test_preemption_and_speculation_keep_structured_outputs(llm):
    """A request preempted mid-output resumes where its automaton was, and drafts are
    verified under the automaton's masks: both give the default engine's tokens."""
    engine, path = llm
    pattern = r"(ab |cd |[a-z]{1,5} ){6,14}[a-z]{1,5}\."
    prompts = [f"ab cd ab cd x{i} ab cd" for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=90,
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    expected = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    config = json.loads((path / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    block_bytes = (2 * 16 * config["num_key_value_heads"] * head_dim * 4
                   * config["num_hidden_layers"])
    small = LLM(str(path), dtype="float32", device="cpu", max_model_len=256, block_size=16,
                kv_cache_memory_bytes=24 * block_bytes)
    try:
        assert [o.outputs[0].token_ids for o in small.generate(prompts, params)] == expected
        assert small.engine.core.scheduler.num_preemptions > 0
    finally:
        small.shutdown()
    spec = LLM(str(path), dtype="float32", device="cpu", max_model_len=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "disable_by_batch_size": 16})
    try:
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == expected
        assert spec.engine.core.scheduler.spec_decode_stats.num_draft_tokens > 0
    finally:
        spec.shutdown()
    for tokens in expected:
        assert regex.fullmatch(pattern, engine.get_tokenizer().decode(tokens,
                                                                      skip_special_tokens=True))


def test_two_tensor_parallel_ranks_follow_one_automaton(llm):
    """TP=2 (worker processes; the automaton pickled to them, rank 0 samples) gives
    the single process's structured tokens."""
    engine, path = llm
    params = SamplingParams(temperature=0.0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    expected = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, params)]
    with LLM(str(path), dtype="float32", device="cpu", max_model_len=256,
             tensor_parallel_size=2) as tp:
        assert [o.outputs[0].token_ids for o in tp.generate(PROMPTS, params)] == expected


@pytest.mark.gpu
def test_cuda_structured_outputs_equal_the_cpu_engine(llm):
    """On CUDA (decode in CUDA graphs, async scheduling on), float32: the same
    structured tokens as the CPU engine, for a schema, a regex and choices at once."""
    engine, path = llm
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=s)
              for s in (StructuredOutputsParams(json=PERSON),
                        StructuredOutputsParams(regex=r"[a-z]{2,8}@(example|test)\.com"),
                        StructuredOutputsParams(choice=["red", "green", "blue"]))]
    prompts = [p for p in PROMPTS for _ in params]
    params = params * len(PROMPTS)
    expected = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    with LLM(str(path), dtype="float32", device="cuda", max_model_len=256) as gpu:
        assert [o.outputs[0].token_ids for o in gpu.generate(prompts, params)] == expected
