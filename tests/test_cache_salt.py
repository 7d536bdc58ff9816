"""cache_salt (vLLM's field): a prompt's cached prefix is shared only with requests of
the same salt (a tenant's blocks are not another's hits), offline and on the server;
answers stay the same. RequestOutput.num_cached_tokens and the server's
usage.prompt_tokens_details.cached_tokens say how many prompt tokens were hits."""

from __future__ import annotations

import pytest

from spindle import LLM, SamplingParams

PROMPT = list(range(10, 60))  # (three full blocks of 16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_only_the_same_salt_hits(tiny_model):
    path = tiny_model("llama")
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=128,
             enable_prefix_caching=True) as llm:
        stats = llm.engine.core.scheduler.kv_cache_manager.prefix_cache_stats
        hits, answers = [], []
        for salt in (None, "tenant-a", "tenant-b", "tenant-a", None):
            prompt = {"prompt_token_ids": PROMPT}
            if salt is not None:
                prompt["cache_salt"] = salt
            before = stats.hits
            output = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
            answers.append(output.outputs[0].token_ids)
            hits.append(stats.hits - before)
            assert output.num_cached_tokens == hits[-1]
        assert hits == [0, 0, 0, 48, 48]  # (three full blocks of 16)
        assert all(a == answers[0] for a in answers)
        for bad in ("", 7):
            with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
                llm.generate([{"prompt_token_ids": PROMPT, "cache_salt": bad}], GREEDY,
                             use_tqdm=False)


def test_the_server_takes_a_salt(tiny_model, tmp_path_factory):
    import httpx

    from server_utils import served

    for server in served(tmp_path_factory, str(tiny_model("llama")), "--device", "cpu",
                         "--dtype", "float32", "--max-model-len", "128",
                         "--served-model-name", "tiny"):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0}
        with httpx.Client(base_url=server.url, timeout=60) as http:
            answers = [http.post("/v1/completions", json={**body, **extra}).json()
                       for extra in ({}, {"cache_salt": "a"}, {"cache_salt": "a"}, {})]
            assert len({a["choices"][0]["text"] for a in answers}) == 1
            cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
            assert cached == [0, 0, 48, 48]  # (three blocks of 16; a salt's own hits)
            assert http.post("/v1/completions",
                             json={**body, "cache_salt": ""}).status_code == 400
            chat = http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2, "cache_salt": "a"})
            assert chat.status_code == 200, chat.text
