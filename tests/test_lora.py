"""LoRA adapters (spindle/lora/) against PEFT on a tiny Llama (CPU, float32): PEFT
writes two random adapters (all seven projections at rank 4; q, v and down at rank 8
with rsLoRA), and each request's greedy tokens and logprobs equal PEFT's model with
its adapter, whatever shares its batch (the base model and both adapters at once),
under chunked prefill, one slot taken in turns, two tensor-parallel ranks, two
pipeline stages and prefix caching; adapters' blocks are never another's prefix hits.
Phi-3's adapters of its fused projections too. What cannot be served is refused by
name; the server answers an adapter's name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from spindle import LLM, LoRARequest, SamplingParams

MAX_NEW = 10
PROMPTS = [[5, 6, 7, 8], list(range(10, 40)), list(range(100, 117))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base, path, seed: int, rank: int, targets: list[str], **options) -> str:
    """A PEFT LoRA adapter of base with random A and B (B large enough to matter)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank,
                                                  target_modules=targets,
                                                  init_lora_weights=False, **options))
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.3)
    peft_model.save_pretrained(path)
    return str(path)


def peft_greedy(base, adapter: str | None, prompts=PROMPTS, max_new: int = MAX_NEW):
    """PEFT's greedy tokens and their logprobs (the base model where adapter is None)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        results.append((tokens, [torch.log_softmax(step[0].float(), -1)[t].item()
                                 for step, t in zip(out.logits, tokens)]))
    return results


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    """(base path, {name: LoRARequest}, {name or None: PEFT's answers to PROMPTS})."""
    base = tiny_model("llama")
    root = tmp_path_factory.mktemp("adapters")
    requests = {
        "all": LoRARequest("all", 1, make_adapter(base, root / "all", 1, 4, ALL_PROJECTIONS)),
        "qvd": LoRARequest("qvd", 2, make_adapter(base, root / "qvd", 2, 8,
                                                  ["q_proj", "v_proj", "down_proj"],
                                                  use_rslora=True)),
    }
    expected = {name: peft_greedy(base, None if name is None else requests[name].lora_path)
                for name in (None, "all", "qvd")}
    assert expected["all"] != expected[None] != expected["qvd"]  # (the adapters matter)
    return base, requests, expected


def check(outputs, expected) -> None:
    for output, (tokens, logprobs) in zip(outputs, expected):
        answer = output.outputs[0]
        assert list(answer.token_ids) == tokens
        got = [d[t].logprob for d, t in zip(answer.logprobs, tokens)]
        assert got == pytest.approx(logprobs, abs=1e-4)


@pytest.mark.parametrize("engine_kwargs", [
    {}, {"max_num_batched_tokens": 8}, {"max_loras": 1}, {"tensor_parallel_size": 2},
    {"pipeline_parallel_size": 2}, {"async_scheduling": False}],
    ids=["default", "chunked", "one-slot", "tp2", "pp2", "sync"])
def test_a_mixed_batch_equals_peft(adapters, engine_kwargs):
    """The base model and both adapters in one generate call: each request its own
    model's answers. With one slot the adapters take turns (the scheduler holds back a
    request whose adapter would be a second one running)."""
    base, requests, expected = adapters
    kwargs = {"max_loras": 2, "max_lora_rank": 8, **engine_kwargs}
    names = [None, "all", "qvd"]
    with LLM(str(base), device="cpu", dtype="float32", max_model_len=256, enable_lora=True,
             **kwargs) as llm:
        outputs = llm.generate(PROMPTS * 3, GREEDY, use_tqdm=False,
                               lora_request=[None if n is None else requests[n]
                                             for n in names for _ in PROMPTS])
        if kwargs["max_loras"] == 1:
            runner = llm.engine.core.executor.worker.runner if kwargs.get(
                "tensor_parallel_size", 1) == 1 and kwargs.get(
                "pipeline_parallel_size", 1) == 1 else None
            assert runner is None or len(runner.lora.slot_of) == 1
    for i, name in enumerate(names):
        check(outputs[3 * i:3 * i + 3], expected[name])


def test_prefix_cache_keeps_adapters_apart(adapters):
    """The same prompt under the base model, an adapter and the other: none hits
    another's blocks (each answer is its model's); the same adapter again hits its
    own."""
    base, requests, expected = adapters
    prompt = [list(range(10, 40))]  # (PROMPTS[1]: one block of 16 and more)
    with LLM(str(base), device="cpu", dtype="float32", max_model_len=256, enable_lora=True,
             max_loras=2, max_lora_rank=8, enable_prefix_caching=True) as llm:
        stats = llm.engine.core.scheduler.kv_cache_manager.prefix_cache_stats
        hits = []
        for name in (None, "all", "qvd", "all"):
            before = stats.hits
            outputs = llm.generate(prompt, GREEDY, use_tqdm=False,
                                   lora_request=None if name is None else requests[name])
            check(outputs, expected[name][1:2])
            hits.append(stats.hits - before)
    assert hits[:3] == [0, 0, 0] and hits[3] > 0


def test_what_cannot_be_served_is_refused(adapters, tmp_path):
    base, requests, expected = adapters
    with LLM(str(base), device="cpu", dtype="float32", max_model_len=256) as llm:
        with pytest.raises(ValueError, match="serves none: start it with enable_lora=True"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=requests["all"])
    with pytest.raises(ValueError, match="max_loras is set but enable_lora is off"):
        LLM(str(base), device="cpu", max_loras=2)
    dora = make_adapter(base, tmp_path / "dora", 3, 4, ["q_proj"], use_dora=True)
    embedding = make_adapter(base, tmp_path / "embed", 3, 4, ["q_proj", "embed_tokens"])
    head = make_adapter(base, tmp_path / "head", 3, 4, ["q_proj", "lm_head"])
    norm = _with_extra_module(requests["all"].lora_path, tmp_path / "norm", "model.norm")
    with LLM(str(base), device="cpu", dtype="float32", max_model_len=256, enable_lora=True,
             max_lora_rank=4) as llm:
        def run(adapter):
            return llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=adapter)

        with pytest.raises(ValueError, match="rank 8, more than max_lora_rank \\(4\\)"):
            run(requests["qvd"])
        with pytest.raises(ValueError, match="uses DoRA"):
            run(LoRARequest("dora", 3, dora))
        with pytest.raises(ValueError, match="not a LoRA A or B weight of a linear layer"):
            run(LoRARequest("embed", 4, embedding))
        with pytest.raises(ValueError, match="lm_head.base_layer.weight.*not a LoRA A or B"):
            run(LoRARequest("head", 5, head))
        with pytest.raises(Exception, match="adapts model.norm, which is not a linear layer"):
            run(LoRARequest("norm", 7, norm))
        with pytest.raises(ValueError, match="no adapter_config.json"):
            run(LoRARequest("nowhere", 6, str(tmp_path / "nowhere")))
        run(requests["all"])
        with pytest.raises(ValueError, match="lora_int_id 1 names adapter 'all'"):
            run(LoRARequest("other", 1, dora))
        check(run(requests["all"]), expected["all"][:1])  # (the engine serves on)


@pytest.mark.parametrize("engine_kwargs", [{}, {"tensor_parallel_size": 2}],
                         ids=["default", "tp2"])
def test_phi3_fused_projections_adapted_whole(tiny_model, tmp_path_factory, engine_kwargs):
    """Phi-3 holds q/k/v and gate/up fused (qkv_proj, gate_up_proj), and so do its PEFT
    adapters: one A and a B over the whole fused output, split as spindle's parts."""
    base = tiny_model("phi3")
    path = tmp_path_factory.mktemp("phi3_adapter") / "fused"
    adapter = LoRARequest("fused", 1, make_adapter(
        base, path, 4, 4, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]))
    expected = peft_greedy(base, adapter.lora_path)
    assert expected != peft_greedy(base, None)
    with LLM(str(base), device="cpu", dtype="float32", max_model_len=256, enable_lora=True,
             max_lora_rank=4, **engine_kwargs) as llm:
        check(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=adapter), expected)


@pytest.mark.parametrize("arch,targets", [
    ("qwen3", ALL_PROJECTIONS),  # (per-head q/k norms after the adapted qkv)
    ("mixtral", ["q_proj", "k_proj", "v_proj", "o_proj"]),  # (attention beside experts)
    ("gemma2", ["q_proj", "v_proj", "o_proj", "down_proj"]),  # (soft caps, sandwich norms)
    ("bamba", ["q_proj", "k_proj", "v_proj", "o_proj"]),  # (attention beside Mamba2)
    ("granite", ALL_PROJECTIONS),  # (its MLP renamed feed_forward by its loader)
    # (q, k and v fused per head in one checkpoint weight, split by its loader)
    ("gpt_neox", ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"])])
def test_other_families_equal_peft(tiny_model, tmp_path_factory, arch, targets):
    base = tiny_model(arch)
    adapter = LoRARequest("a", 1, make_adapter(base, tmp_path_factory.mktemp(arch) / "a", 5,
                                               4, targets))
    expected = peft_greedy(base, adapter.lora_path)
    assert expected != peft_greedy(base, None)
    with LLM(str(base), device="cpu", dtype="float32", max_model_len=256, enable_lora=True,
             max_lora_rank=4) as llm:
        check(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=adapter), expected)


def _with_extra_module(adapter: str, dest, module: str) -> str:
    """A copy of adapter that also adapts module (a layer PEFT would not)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter, dest)
    tensors = load_file(dest / "adapter_model.safetensors")
    rank = json.loads((dest / "adapter_config.json").read_text())["r"]
    tensors[f"base_model.model.{module}.lora_A.weight"] = torch.zeros(rank, 64)
    tensors[f"base_model.model.{module}.lora_B.weight"] = torch.zeros(64, rank)
    save_file(tensors, dest / "adapter_model.safetensors")
    return str(dest)


def test_the_server_serves_adapters_by_name(adapters, tmp_path_factory):
    from server_utils import official_client, served

    base, requests, expected = adapters
    flags = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
             "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
             "--served-model-name", "tiny",
             "--lora-modules", f"all={requests['all'].lora_path}",
             "--lora-modules", f"qvd={requests['qvd'].lora_path}",
             "--allow-runtime-lora-updating", "--scheduling-policy", "priority"]
    with LLM(str(base), device="cpu", dtype="float32", max_model_len=256, enable_lora=True,
             max_loras=2, max_lora_rank=8) as llm:  # (its tokens are PEFT's: see above)
        offline = {name: llm.generate(PROMPTS[1:2], GREEDY, use_tqdm=False,
                                      lora_request=requests.get(name))[0].outputs[0]
                   for name in (None, "all", "qvd")}
        chat_text = llm.chat([{"role": "user", "content": "hi"}],
                             SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False,
                             lora_request=requests["all"])[0].outputs[0].text
    for name in offline:
        assert list(offline[name].token_ids) == expected[name][1][0]
    for server in served(tmp_path_factory, str(base), *flags):
        client = official_client(server)
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"tiny", "all", "qvd"}
        assert cards["all"].parent == "tiny" and cards["all"].root == requests["all"].lora_path
        for name, model in ((None, "tiny"), ("all", "all"), ("qvd", "qvd")):
            answer = client.completions.create(model=model, prompt=PROMPTS[1],
                                               max_tokens=MAX_NEW, temperature=0.0,
                                               extra_body={"ignore_eos": True,
                                                           "priority": 2})  # (accepted)
            assert answer.model == model
            assert answer.choices[0].text == offline[name].text
        chat = client.chat.completions.create(
            model="all", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            temperature=0.0)
        assert chat.model == "all" and chat.choices[0].message.content == chat_text
        import openai

        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.completions.create(model="nope", prompt="hi", max_tokens=2)
        import httpx

        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        assert 'spindle:lora_requests_info{max_lora="2",model_name="tiny",' in metrics
        _check_runtime_updates(server, client, requests, offline)


def test_lora_requests_info_names_the_running_and_waiting_adapters():
    """vLLM's lora_requests_info: one series whose labels name the adapters of the
    running and of the waiting requests, and max_loras; a change replaces the series."""
    from types import SimpleNamespace

    from spindle.engine.stats import EngineStats, IterationStats, LoRAStats
    from spindle.entrypoints.openai.metrics import PrometheusStatLogger

    def request(name):
        return SimpleNamespace(lora_request=None if name is None else LoRARequest(name, 1, "/x"))

    scheduler = SimpleNamespace(running=[request("sql"), request(None), request("chat"),
                                         request("sql")],
                                waiting=[request("math")], scheduler_config=SimpleNamespace(
                                    max_loras=2))
    lora = LoRAStats.of(scheduler)
    assert lora == LoRAStats(("chat", "sql"), ("math",), 2)
    logger = PrometheusStatLogger("tiny")
    for stats in (lora, LoRAStats(("math",), (), 2)):
        logger.record(EngineStats(num_running=1, num_waiting=0, num_held=0,
                                  kv_cache_usage=0.0, lora=stats), IterationStats())
    text = logger.render().decode()
    series = [line for line in text.splitlines()
              if line.startswith("spindle:lora_requests_info{")]
    assert len(series) == 1, series
    assert 'running_lora_adapters="math"' in series[0]
    assert 'waiting_lora_adapters=""' in series[0] and 'max_lora="2"' in series[0]


def _check_runtime_updates(server, client, requests, offline) -> None:
    """Adapters loaded and unloaded while the server runs; bad loads refused."""
    import httpx
    import openai

    def complete(model: str):
        return client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=MAX_NEW,
                                         temperature=0.0, extra_body={"ignore_eos": True})

    with httpx.Client(base_url=server.url, timeout=60) as http:
        def post(route: str, body: dict) -> httpx.Response:
            return http.post(f"/v1/{route}_lora_adapter", json=body)

        answer = post("load", {"lora_name": "late", "lora_path": requests["qvd"].lora_path})
        assert answer.status_code == 200, answer.text
        assert complete("late").choices[0].text == offline["qvd"].text
        assert "late" in {m.id for m in client.models.list().data}
        for body, status, words in (
                ({"lora_name": "late", "lora_path": requests["all"].lora_path}, 400,
                 "served already"),
                ({"lora_name": "tiny", "lora_path": requests["all"].lora_path}, 400,
                 "served already"),
                ({"lora_name": "gone", "lora_path": "/no/such/adapter"}, 400,
                 "no adapter_config.json"),
                ({"lora_name": "x"}, 400, "lora_path")):
            answer = post("load", body)
            assert answer.status_code == status and words in answer.text, answer.text
        assert post("unload", {"lora_name": "all"}).status_code == 200
        assert post("unload", {"lora_name": "all"}).status_code == 404
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            complete("all")
        assert complete("qvd").choices[0].text == offline["qvd"].text  # (the others serve on)


def test_lora_modules_are_checked_before_the_server_starts(adapters, tmp_path):
    from spindle.config import ServerArgs

    with pytest.raises(ValueError, match="lora_modules"):
        ServerArgs(lora_modules=["no-equals-sign"])
    with pytest.raises(ValueError, match="one entry per name"):
        ServerArgs(lora_modules=["a=/x", "a=/y"])
    args = ServerArgs(lora_modules=["a=/x", "b=/y"])
    assert [(r.lora_name, r.lora_int_id, r.lora_path)
            for r in args.lora_requests().values()] == [("a", 1, "/x"), ("b", 2, "/y")]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["1", "0"], ids=["one-launch-kernel", "masked-gemms"])
def test_adapters_in_cuda_graphs_equal_peft(adapters, kernel, monkeypatch):
    """On CUDA (float32): decode replayed from CUDA graphs, whose adapters' slots are
    staged each step, gives each request its model's answers, through the one-launch
    kernel (lora/kernels.py) or the masked GEMMs; a batch without adapters replays the
    graphs captured without them."""
    monkeypatch.setenv("SPINDLE_LORA_KERNEL", kernel)
    base, requests, expected = adapters
    names = [None, "all", "qvd"]
    with LLM(str(base), device="cuda", dtype="float32", max_model_len=256, enable_lora=True,
             max_loras=2, max_lora_rank=8) as llm:
        outputs = llm.generate(PROMPTS * 3, GREEDY, use_tqdm=False,
                               lora_request=[None if n is None else requests[n]
                                             for n in names for _ in PROMPTS])
        graphs = llm.engine.core.executor.worker.runner.graph_runner
        replays = dict(graphs.num_replays)
        assert sum(n for (_, _, adapters), n in replays.items() if adapters) > 0
        base_outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        base_replays = {key: n - replays.get(key, 0) for key, n in graphs.num_replays.items()}
        assert sum(n for (_, _, adapters), n in base_replays.items() if not adapters) > 0
        assert sum(n for (_, _, adapters), n in base_replays.items() if adapters) == 0
    for i, name in enumerate(names):
        check(outputs[3 * i:3 * i + 3], expected[name])
    check(base_outputs, expected[None])


def test_bf16_cpu_decode_layer_keeps_adapters(adapters, monkeypatch):
    """bf16 on the CPU, where a decode step of the base model runs each layer as one C++
    call (cpu_kernels.decode_layer), which reads no adapter: steps with adapters must not
    take it (their answers equal those with the C++ layers switched off), steps without
    still may (the base model's answers equal an engine serving no adapters)."""
    from spindle.layers import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("the C++ CPU kernels are not built here")
    base, requests, _ = adapters
    mixed = [None, requests["all"], requests["qvd"]]

    def run(kernels: str, **kwargs):
        monkeypatch.setenv(cpu_kernels.SWITCH_ENV, kernels)
        with LLM(str(base), device="cpu", dtype="bfloat16", max_model_len=256,
                 **kwargs) as llm:
            if not kwargs:
                return [llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
            return [llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)
                    for lora in mixed]

    def answers(outputs):
        return [[(list(o.outputs[0].token_ids), [d[t].logprob for d, t in zip(
            o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in one] for one in outputs]

    lora = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
    with_kernels, without = answers(run("1", **lora)), answers(run("0", **lora))
    assert with_kernels[1:] == without[1:]
    assert with_kernels[1] != with_kernels[0] != with_kernels[2]
    assert with_kernels[0] == answers(run("1"))[0]
