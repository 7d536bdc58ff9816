"""SamplingParams.prompt_logprobs against transformers: every prompt token's logprob
and rank given the tokens before it, and the top k, from one forward of transformers
over the prompt (float32, CPU); under chunked prefill, prefix caching, n > 1,
preemption and tensor parallelism's ranks; and the bad inputs."""

from __future__ import annotations

import random

import pytest
import torch

from spindle import LLM, SamplingParams

TOL = 1e-4
PROMPT_LENGTHS = [1, 2, 9, 40, 77]


def prompts_for(seed: int, vocab: int = 512, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def hf_logprobs(model):
    """prompt -> transformers' log-softmax [len, vocab] at every prompt position."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    cache = {}

    def get(prompt: list[int]) -> torch.Tensor:
        key = tuple(prompt)
        if key not in cache:
            with torch.no_grad():
                logits = hf(torch.tensor([prompt])).logits[0].float()
            cache[key] = torch.log_softmax(logits, -1)
        return cache[key]

    return get


def check(prompt: list[int], got, k: int, hf: torch.Tensor) -> None:
    """got (RequestOutput.prompt_logprobs) against transformers' log-softmax rows."""
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for j in range(1, len(prompt)):
        row, token, entry = hf[j - 1], prompt[j], got[j]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=TOL)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(k).indices.tolist() if k else []
        assert set(entry) == {token, *top}
        for rank, t in enumerate(top, start=1):
            if t != token:
                assert entry[t].rank == rank
                assert entry[t].logprob == pytest.approx(row[t].item(), abs=TOL)
        assert all(lp.decoded_token is not None for lp in entry.values())


def generate(model, prompts, k=2, n=1, **engine_kwargs):
    kwargs = dict(device="cpu", dtype="float32", max_model_len=256, seed=0)
    kwargs.update(engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=k, n=n)
    with LLM(str(model), **kwargs) as llm:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_equal_transformers(model, hf_logprobs, k):
    prompts = prompts_for(1)
    for prompt, out in zip(prompts, generate(model, prompts, k)):
        check(prompt, out.prompt_logprobs, k, hf_logprobs(prompt))


@pytest.mark.parametrize("budget", [5, 16])
def test_chunked_prefill_reports_every_chunk(model, hf_logprobs, budget):
    prompts = prompts_for(2)
    outs = generate(model, prompts, max_num_batched_tokens=budget, max_num_seqs=2)
    for prompt, out in zip(prompts, outs):
        check(prompt, out.prompt_logprobs, 2, hf_logprobs(prompt))


def test_prefix_cache_hits_are_not_taken_for_them(model, hf_logprobs):
    """A second run of prompts with a shared prefix would hit the cache: requests that
    want prompt logprobs compute every token anyway, and get all of them."""
    prompts = prompts_for(3, shared_prefix=48)
    with LLM(str(model), device="cpu", dtype="float32", max_model_len=256,
             enable_prefix_caching=True, block_size=16) as llm:
        plain = SamplingParams(temperature=0.0, max_tokens=2)
        llm.generate([{"prompt_token_ids": p} for p in prompts], plain, use_tqdm=False)
        wanted = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], wanted, use_tqdm=False)
        assert llm.engine.core.scheduler.prefix_cache_stats.hits > 0  # (the plain run's)
    for prompt, out in zip(prompts, outs):
        check(prompt, out.prompt_logprobs, 1, hf_logprobs(prompt))


def test_samples_share_one_computation(model, hf_logprobs):
    prompts = prompts_for(4)[2:4]
    outs = generate(model, prompts, n=3, k=1)
    for prompt, out in zip(prompts, outs):
        assert len(out.outputs) == 3
        check(prompt, out.prompt_logprobs, 1, hf_logprobs(prompt))


def test_preemption_recomputes_them_unchanged(model, hf_logprobs, monkeypatch):
    """And a request preempted after its first token (its prompt logprobs delivered) does
    not score its prompt again when it is recomputed: every prompt position is scored
    at most once per time its prefill runs before the first token."""
    from spindle.runner import model_runner

    scored = []
    score_rows = model_runner.score_rows

    def counting(hidden, targets, k, compute_logits):
        scored.append(hidden.shape[0])
        return score_rows(hidden, targets, k, compute_logits)

    monkeypatch.setattr(model_runner, "score_rows", counting)
    prompts = prompts_for(5)
    # Room for about 136 tokens: the 40- and 77-token prompts growing by 30 tokens each
    # preempt each other.
    with LLM(str(model), device="cpu", dtype="float32", max_model_len=128, block_size=4,
             kv_cache_memory_bytes=70_000, max_num_seqs=4) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                prompt_logprobs=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.core.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        check(prompt, out.prompt_logprobs, 2, hf_logprobs(prompt))
    # (the preemptions here come after the first tokens: no prompt is scored twice)
    assert sum(scored) == sum(len(p) - 1 for p in prompts)


def test_requests_without_them_get_none(model):
    with LLM(str(model), device="cpu", dtype="float32", max_model_len=256) as llm:
        outs = llm.generate(["hello there", {"prompt_token_ids": [5, 6, 7]}],
                            [SamplingParams(max_tokens=2),
                             SamplingParams(max_tokens=2, prompt_logprobs=0)], use_tqdm=False)
    assert outs[0].prompt_logprobs is None
    assert [e is None for e in outs[1].prompt_logprobs] == [True, False, False]


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_bad_values_name_the_field(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_a_prompt_of_embeddings_is_refused(model):
    with LLM(str(model), device="cpu", dtype="float32", max_model_len=256,
             enable_prompt_embeds=True, enable_prefix_caching=False) as llm:
        embeds = torch.zeros(4, 64)
        with pytest.raises(ValueError, match="prompt_logprobs needs a prompt of token ids"):
            llm.generate({"prompt_embeds": embeds}, SamplingParams(prompt_logprobs=1),
                         use_tqdm=False)
        assert llm.generate("hi", SamplingParams(max_tokens=1), use_tqdm=False)[0].outputs


def test_without_async_scheduling(model, hf_logprobs):
    prompts = prompts_for(6)
    outs = generate(model, prompts, async_scheduling=False, max_num_batched_tokens=16)
    for prompt, out in zip(prompts, outs):
        check(prompt, out.prompt_logprobs, 2, hf_logprobs(prompt))


def test_tensor_parallel_ranks_all_run_the_lm_head(model, hf_logprobs):
    """Every rank takes part in the vocabulary-parallel LM head; rank 0 reports."""
    prompts = prompts_for(7)[1:4]
    outs = generate(model, prompts, tensor_parallel_size=2, kv_cache_memory_bytes=2**22,
                    max_num_batched_tokens=16)
    for prompt, out in zip(prompts, outs):
        check(prompt, out.prompt_logprobs, 2, hf_logprobs(prompt))


@pytest.mark.gpu
def test_on_cuda_in_float32(model, hf_logprobs):
    """The GPU path (Triton prefill attention, the LM head on the device) against CPU
    transformers, within float32's other reduction orders."""
    prompts = prompts_for(8)
    outs = generate(model, prompts, device="cuda", max_num_batched_tokens=32)
    for prompt, out in zip(prompts, outs):
        got = out.prompt_logprobs
        hf = hf_logprobs(prompt)
        for j in range(1, len(prompt)):
            assert got[j][prompt[j]].logprob == pytest.approx(hf[j - 1, prompt[j]].item(),
                                                              abs=1e-3)


def test_pipeline_parallel_last_stage_scores(model, hf_logprobs):
    """Two pipeline stages (processes): the last one, which holds the LM head, scores."""
    prompts = prompts_for(9)[1:4]
    outs = generate(model, prompts, pipeline_parallel_size=2,
                    distributed_executor_backend="mp", max_num_batched_tokens=16)
    for prompt, out in zip(prompts, outs):
        check(prompt, out.prompt_logprobs, 2, hf_logprobs(prompt))
