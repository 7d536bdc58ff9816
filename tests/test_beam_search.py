"""LLM.beam_search against transformers' generate(num_beams=k) on a tiny Llama (CPU,
float32): each prompt's k sequences, best first, and their scores, for several widths,
length penalties and early_stopping settings, with EOS ids the beams do produce (so
hypotheses finish early, and the search stops on transformers' heuristics)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from spindle import LLM
from spindle.entrypoints.beam_search import BeamSearchParams

PROMPTS = [[5, 6, 7, 8], list(range(10, 40)), list(range(100, 117))]


@pytest.fixture(scope="module")
def with_eos(tiny_model, tmp_path_factory):
    """(a copy of the tiny Llama whose EOS ids are tokens its beams produce at steps 2
    to 4, transformers' model of it, those ids)."""
    from transformers import AutoModelForCausalLM

    source = tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        beams = model.generate(torch.tensor([PROMPTS[0]]), num_beams=4,
                               num_return_sequences=4, max_new_tokens=5, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
    eos = sorted(set(beams[:, 5:8].flatten().tolist()))[:3]
    path = tmp_path_factory.mktemp("beam") / "llama"
    shutil.copytree(source, path)
    for name in ("config.json", "generation_config.json"):
        if (path / name).exists():
            config = json.loads((path / name).read_text())
            config["eos_token_id"] = eos
            (path / name).write_text(json.dumps(config))
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_beams(model, prompt, params: BeamSearchParams, eos: list[int]):
    ids = torch.tensor([prompt])
    k = params.beam_width
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=k,
                             num_return_sequences=k, max_new_tokens=params.max_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=0,
                             length_penalty=params.length_penalty,
                             early_stopping=params.early_stopping,
                             return_dict_in_generate=True, output_scores=True)
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    return [(out.sequences[i, len(prompt):len(prompt) + lengths[i]].tolist(),
             float(out.sequences_scores[i])) for i in range(k)]


@pytest.mark.parametrize("params", [
    BeamSearchParams(beam_width=2, max_tokens=8),
    BeamSearchParams(beam_width=3, max_tokens=10),
    BeamSearchParams(beam_width=4, max_tokens=6, length_penalty=0.0, early_stopping=True),
    BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=2.0, early_stopping="never"),
    BeamSearchParams(beam_width=4, max_tokens=12, early_stopping=True),
    BeamSearchParams(beam_width=3, max_tokens=16, length_penalty=2.0),
    BeamSearchParams(beam_width=2, max_tokens=16, length_penalty=-1.0),
    BeamSearchParams(beam_width=3, max_tokens=30, length_penalty=0.5),
    BeamSearchParams(beam_width=3, max_tokens=30, early_stopping=True)],
    ids=["k2", "k3", "k4-no-penalty-early", "k3-penalty2-never", "k4-early",
         "k3-penalty2", "k2-negative-penalty", "k3-stops-by-heuristic",
         "k3-stops-when-full"])
def test_beams_equal_transformers(with_eos, params):
    """(The last two stop before max_tokens: transformers' heuristic finds that no
    running beam can beat the finished ones, or early_stopping=True has k of them.)"""
    path, model = with_eos
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=128) as llm:
        eos = sorted(llm.engine.eos_token_ids)
        outputs = llm.beam_search(PROMPTS, params)
        if params.max_tokens == 30:  # (the first prompt alone: its steps)
            steps, generate = [], llm.generate
            llm.generate = lambda *args, **kw: steps.append(1) or generate(*args, **kw)
            (alone,) = llm.beam_search(PROMPTS[:1], params)
            assert [s.token_ids for s in alone.sequences] == \
                [s.token_ids for s in outputs[0].sequences]
            assert len(steps) < 30
    stops = 0
    for prompt, output in zip(PROMPTS, outputs):
        expected = hf_beams(model, prompt, params, eos)
        assert [s.token_ids for s in output.sequences] == [t for t, _ in expected]
        # (compared as summed log-probs: a length penalty scales their float32 noise)
        assert [s.cum_logprob for s in output.sequences] == pytest.approx(
            [score * len(t) ** params.length_penalty for t, score in expected], abs=1e-4)
        for s in output.sequences:
            ended = s.token_ids[-1] in eos
            assert s.finish_reason == ("stop" if ended else "length")
            assert s.score == pytest.approx(
                s.cum_logprob / len(s.token_ids) ** params.length_penalty)
            stops += ended
    if params.length_penalty == 1.0:
        assert stops > 0  # (EOS ended some of the hypotheses returned)


def test_ignore_eos_and_bad_params(with_eos):
    path, model = with_eos
    params = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=64) as llm:
        (output,) = llm.beam_search(PROMPTS[:1], params)
        assert [s.token_ids for s in output.sequences] == \
            [t for t, _ in hf_beams(model, PROMPTS[0], params, None)]
        assert all(len(s.token_ids) == 6 for s in output.sequences)
        for bad, words in ((BeamSearchParams(0, 4), "beam_width"),
                           (BeamSearchParams(2, 4, early_stopping="soon"), "early_stopping"),
                           (BeamSearchParams(2, 4, length_penalty=float("nan")),
                            "length_penalty"),
                           (BeamSearchParams(2, 64), "more than max_model_len")):
            with pytest.raises(ValueError, match=words):
                llm.beam_search(PROMPTS[:1], bad)


@pytest.fixture(scope="module")
def beam_server(with_eos, tmp_path_factory):
    from server_utils import served

    path, _ = with_eos
    yield from served(tmp_path_factory, str(path), "--device", "cpu", "--dtype", "float32",
                      "--max-model-len", "64", "--served-model-name", "beams")


@pytest.mark.parametrize("params", [
    BeamSearchParams(beam_width=3, max_tokens=8),
    BeamSearchParams(beam_width=2, max_tokens=10, length_penalty=2.0, early_stopping=True)],
    ids=["k3", "k2-penalty2-early"])
def test_the_server_use_beam_search_equals_transformers(with_eos, beam_server, params):
    """POST /v1/completions with use_beam_search (vLLM's extension), through the official
    client: n choices per prompt, each prompt's beams best first, equal to transformers'
    sequences (decoded), with finish reasons; several prompts in one request."""
    from server_utils import official_client
    from transformers import AutoTokenizer

    path, model = with_eos
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = json.loads((path / "config.json").read_text())["eos_token_id"]
    response = official_client(beam_server).completions.create(
        model="beams", prompt=PROMPTS, max_tokens=params.max_tokens, n=params.beam_width,
        extra_body={"use_beam_search": True, "length_penalty": params.length_penalty,
                    "early_stopping": params.early_stopping})
    k = params.beam_width
    assert [c.index for c in response.choices] == list(range(len(PROMPTS) * k))
    for i, prompt in enumerate(PROMPTS):
        expected = hf_beams(model, prompt, params, eos)
        choices = response.choices[i * k:(i + 1) * k]
        assert [c.text for c in choices] == \
            [tokenizer.decode(t, skip_special_tokens=True) for t, _ in expected]
        assert [c.finish_reason for c in choices] == \
            ["stop" if t[-1] in eos else "length" for t, _ in expected]
    assert response.usage.prompt_tokens == sum(len(p) for p in PROMPTS)


def test_the_server_chat_use_beam_search_equals_transformers(with_eos, beam_server):
    """POST /v1/chat/completions with use_beam_search: n assistant messages, best first,
    transformers' beams over the chat template's rendering of the conversation."""
    from server_utils import official_client
    from transformers import AutoTokenizer

    path, model = with_eos
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = json.loads((path / "config.json").read_text())["eos_token_id"]
    messages = [{"role": "user", "content": "Count with me: one two"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    response = official_client(beam_server).chat.completions.create(
        model="beams", messages=messages, max_completion_tokens=6, n=3,
        extra_body={"use_beam_search": True})
    expected = hf_beams(model, list(prompt), params, eos)
    assert [c.message.content for c in response.choices] == \
        [tokenizer.decode(t, skip_special_tokens=True) for t, _ in expected]
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert response.usage.prompt_tokens == len(prompt)


def test_the_server_refuses_what_beam_search_cannot_honour(beam_server):
    import openai
    from server_utils import official_client

    client = official_client(beam_server)
    for extra, field in (({"stream": True}, "stream"), ({"temperature": 0.7}, "temperature"),
                         ({"logprobs": 2}, "logprobs"), ({"seed": 3}, "seed"),
                         ({"max_tokens": 100}, "max_model_len")):
        with pytest.raises(openai.BadRequestError, match=field):
            client.completions.create(model="beams", prompt=PROMPTS[0], n=2,
                                      extra_body={"use_beam_search": True, **extra})
    with pytest.raises(openai.BadRequestError, match="tools is not supported"):
        client.chat.completions.create(
            model="beams", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            extra_body={"use_beam_search": True})
    with pytest.raises(openai.BadRequestError, match="length_penalty applies only with"):
        client.completions.create(model="beams", prompt=PROMPTS[0], max_tokens=4,
                                  extra_body={"length_penalty": 2.0})
    assert client.completions.create(model="beams", prompt=PROMPTS[0], max_tokens=2).choices
