"""update_weights: new weights loaded into a running engine, in place, from tensors,
a state_dict, a trainer's named_parameters() or a checkpoint directory. The oracle is
transformers on the new checkpoint; every output carries the weights' version."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file

from spindle import LLM, SamplingParams
from test_generate_vs_hf import hf_greedy

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def prompts(vocab: int = 512) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (3, 17, 40)]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def hf_tokens(path) -> list[list[int]]:
    return [t for t, _ in hf_greedy(path, prompts(), MAX_NEW)]


@pytest.fixture(scope="module")
def checkpoints(tiny_model):
    """Two checkpoints of one shape and tokenizer, different weights; transformers'
    greedy tokens on each."""
    old, new = tiny_model("llama"), tiny_model("llama", seed=7)
    return old, new, hf_tokens(old), hf_tokens(new)


def engine(path, **kwargs) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=256, **kwargs)


def test_tensors_then_a_directory_equal_transformers_and_tag_outputs(checkpoints):
    old, new, old_expected, new_expected = checkpoints
    with engine(old) as llm:
        first = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert tokens(first) == old_expected and {o.weight_version for o in first} == {0}
        assert new_expected != old_expected  # (the update must show)

        llm.update_weights(load_file(str(new / "model.safetensors")))  # a state_dict
        second = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert tokens(second) == new_expected
        assert llm.weight_version == 1 and {o.weight_version for o in second} == {1}

        llm.update_weights(old, version="step-7")  # a checkpoint directory
        third = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert tokens(third) == old_expected and {o.weight_version for o in third} == {"step-7"}


def test_a_trainers_named_parameters_and_addresses_kept(checkpoints):
    """What a trainer holds: an HF model's named_parameters(), as a generator."""
    from transformers import AutoModelForCausalLM

    old, new, _, new_expected = checkpoints
    trainer_model = AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32)
    with engine(old) as llm:
        runner = llm.engine.core.executor.worker.runner
        addresses = [p.data_ptr() for p in runner.model.parameters()]
        llm.update_weights(trainer_model.named_parameters())
        assert [p.data_ptr() for p in runner.model.parameters()] == addresses
        assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == new_expected


def test_a_bad_source_is_named_and_changes_nothing(checkpoints, tmp_path):
    old, new, old_expected, _ = checkpoints
    good = load_file(str(new / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    with engine(old) as llm:
        cases = [
            ({**good, "model.layers.9.mlp.up_proj.weight": good[name]},
             "'model.layers.9.mlp.up_proj.weight' is not a tensor of this model's checkpoint"),
            ({**good, name: good[name][:, :-1]}, f"'{name}' has shape"),
            ({**good, name: good[name].to(torch.int32)}, f"'{name}' is not floating point"),
            ({}, "holds no tensors"),
            (str(tmp_path / "nowhere"), "is not a checkpoint directory"),
            ([("x", 1)], "takes a checkpoint directory or \\(name, tensor\\) pairs"),
        ]
        for source, message in cases:
            with pytest.raises(ValueError, match=message):
                llm.update_weights(source)
        with pytest.raises(ValueError, match="int or a str"):
            llm.update_weights(good, version=True)
        with pytest.raises(ValueError, match="iterable of \\(name, tensor\\) pairs"):
            llm.update_weights(3)
        # The first bad tensor came after good ones: still, nothing was loaded.
        assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == old_expected
        assert llm.weight_version == 0


def test_the_prefix_cache_is_dropped(checkpoints):
    """A prefix hit after an update would read KV the old weights computed."""
    old, new, _, new_expected = checkpoints
    with engine(old, enable_prefix_caching=True) as llm:
        llm.generate(prompts(), GREEDY, use_tqdm=False)  # fills the prefix cache
        llm.update_weights(new)
        assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == new_expected
        assert llm.engine.core.scheduler.kv_cache_manager.prefix_cache_stats.hits == 0


def test_weights_only_wake_from_sleep_level_2(checkpoints):
    """The RL loop: sleep while the trainer trains, wake the weights alone, load the
    new ones, then wake the KV cache."""
    old, new, _, new_expected = checkpoints
    with engine(old, enable_sleep_mode=True) as llm:
        llm.generate(prompts(), GREEDY, use_tqdm=False)
        llm.sleep(2)
        with pytest.raises(ValueError, match="the weights are asleep"):
            llm.update_weights(new)
        llm.wake_up(["weights"])
        llm.update_weights(new, version="v2")
        llm.wake_up()
        outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert tokens(outputs) == new_expected and {o.weight_version for o in outputs} == {"v2"}


@pytest.mark.parametrize("source", ["tensors", "directory"])
def test_tensor_parallel_ranks_each_take_their_shard(checkpoints, source):
    old, new, _, new_expected = checkpoints
    with engine(old, tensor_parallel_size=2) as llm:
        llm.update_weights(load_file(str(new / "model.safetensors")) if source == "tensors"
                           else new)
        assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == new_expected
        with pytest.raises(ValueError, match="'lm_head.weight' has shape"):  # (before any rank)
            llm.update_weights([("lm_head.weight", torch.zeros(2, 2))])


def test_requests_in_flight_finish_on_the_old_weights_by_default(checkpoints):
    """mode "wait": a request running when the update comes finishes first, tagged with
    the old version; "keep": it recomputes and goes on with the new weights."""
    old, new, old_expected, new_expected = checkpoints
    with engine(old) as llm:
        eng = llm.engine
        eng.add_request(prompts()[1], GREEDY, request_id="a", final_only=True)
        eng.step()
        eng.step()  # prefilled, a token or two sampled
        settled = eng.update_weights(new)
        assert [(o.request_id, o.outputs[0].token_ids, o.weight_version) for o in settled] == \
            [("a", old_expected[1], 0)]

        eng.add_request(prompts()[1], GREEDY, request_id="b", final_only=True)
        for _ in range(3):
            eng.step()
        assert eng.update_weights(old, mode="keep") == []
        kept = eng.core.scheduler.requests["b"].num_output_tokens  # sampled before the update
        assert 0 < kept < MAX_NEW
        outputs = []
        while eng.has_unfinished_requests():
            outputs += eng.step()
        (b,) = outputs
        got = b.outputs[0].token_ids
        assert b.weight_version == 2 and len(got) == MAX_NEW
        # The tokens before the update are the new weights'; the rest are what the old
        # (restored) weights continue them with.
        assert got[:kept] == new_expected[1][:kept]
        (rest, _), = hf_greedy(old, [prompts()[1] + got[:kept]], MAX_NEW - kept)
        assert got[kept:] == rest


def test_async_engine_updates_between_streams(checkpoints):
    """AsyncLLM: a stream in flight finishes on the old weights (mode "wait"), one
    started after the update runs on the new ones; each says which weights."""
    import asyncio

    from spindle.config import EngineArgs
    from spindle.engine.async_llm import AsyncLLM

    old, new, old_expected, new_expected = checkpoints
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(old), device="cpu", dtype="float32",
                                                  max_model_len=256))

    async def main():
        stream = await engine.add_request(prompts()[2], GREEDY)
        async for output in stream:  # until its first token
            if output.outputs[0].token_ids:
                break
        update = asyncio.create_task(engine.update_weights(load_file(str(new / "model.safetensors")),
                                                           version="next"))
        before = [o async for o in stream][-1]
        await update
        after = [o async for o in engine.generate(prompts()[2], GREEDY)][-1]
        return before, after

    try:
        before, after = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown()
    assert (before.outputs[0].token_ids, before.weight_version) == (old_expected[2], 0)
    assert (after.outputs[0].token_ids, after.weight_version) == (new_expected[2], "next")


def test_server_update_route_and_versions_on_responses(checkpoints, tmp_path):
    """Dev mode: POST /update_weights loads a directory; completions and chat, whole and
    streamed, carry weight_version on every choice (the official client sees it)."""
    import httpx
    import openai

    from server_utils import ThreadedServer
    from spindle.config import EngineArgs
    from spindle.engine.async_llm import AsyncLLM
    from spindle.entrypoints.openai.api_server import build_app

    old, new, _, new_expected = checkpoints
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(old), device="cpu", dtype="float32",
                                                  max_model_len=256))
    server = ThreadedServer(build_app(engine, ["tiny"], dev_mode=True))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.get("/weight_version").json() == {"weight_version": 0}
            bad = http.post("/update_weights", json={"path": str(tmp_path / "nowhere")})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "path"
            assert "not a checkpoint directory" in bad.json()["error"]["message"]
            done = http.post("/update_weights", json={"path": str(new), "version": "rl-3"})
            assert done.status_code == 200 and done.json() == {"weight_version": "rl-3"}
            assert http.get("/weight_version").json() == {"weight_version": "rl-3"}
        whole = client.completions.create(model="tiny", prompt=prompts()[1], max_tokens=MAX_NEW,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert whole.choices[0].weight_version == "rl-3"
        streamed = list(client.completions.create(model="tiny", prompt=prompts()[1],
                                                  max_tokens=MAX_NEW, temperature=0, stream=True,
                                                  extra_body={"ignore_eos": True}))
        assert {c.choices[0].weight_version for c in streamed} == {"rl-3"}
        chat = client.chat.completions.create(model="tiny", max_tokens=4,
                                              messages=[{"role": "user", "content": "hi"}])
        assert chat.choices[0].weight_version == "rl-3"
        chunks = list(client.chat.completions.create(
            model="tiny", max_tokens=4, stream=True, messages=[{"role": "user", "content": "hi"}]))
        assert {c.choices[0].weight_version for c in chunks if c.choices} == {"rl-3"}
        # And the tokens are the new checkpoint's: the completion decodes to them.
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(new))
        assert whole.choices[0].text == tokenizer.decode(new_expected[1], skip_special_tokens=True)
    finally:
        server.stop()
        engine.shutdown()


# The trainer, in a process of its own: it sends the new checkpoint's tensors (as
# bf16, the way a trainer may hold them), then a list the engine must refuse.
_TRAINER = r"""
import sys
import torch
from safetensors.torch import load_file
from spindle.rl import WeightSender

checkpoint, num_ranks = sys.argv[1], int(sys.argv[2])
weights = load_file(checkpoint)
sender = WeightSender(num_ranks, timeout_s=60)
print(sender.address, flush=True)
sender.connect()
sender.send({k: v for k, v in weights.items()}, batch_bytes=1 << 16)  # several batches
bad = dict(weights)
bad["model.layers.0.mlp.down_proj.weight"] = torch.zeros(3, 3)
try:
    sender.send(bad)
except RuntimeError as e:
    print("refused:", e, flush=True)
sender.close()
"""


@pytest.mark.parametrize("tp", [1, 2])
def test_weights_from_a_trainer_process_over_gloo(checkpoints, tp):
    import subprocess
    import sys

    old, new, old_expected, new_expected = checkpoints
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(new / "model.safetensors"),
                                str(tp)], stdout=subprocess.PIPE, text=True)
    try:
        address = trainer.stdout.readline().strip()
        with engine(old, tensor_parallel_size=tp) as llm:
            llm.init_weight_transfer(address, timeout_s=60)
            llm.receive_weights(version="sent-1")
            outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
            # The same as loading the same (bf16-rounded) tensors from memory.
            with engine(old) as reference:
                reference.update_weights({k: v.to(torch.bfloat16) for k, v in
                                          load_file(str(new / "model.safetensors")).items()})
                expected = tokens(reference.generate(prompts(), GREEDY, use_tqdm=False))
            assert tokens(outputs) == expected and {o.weight_version for o in outputs} == {"sent-1"}
            with pytest.raises(ValueError, match="down_proj.weight' has shape \\[3, 3\\]"):
                llm.receive_weights()
            assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == expected
            assert llm.weight_version == "sent-1"
        assert "refused: the engine refused these weights" in trainer.stdout.read()
        assert trainer.wait(timeout=30) == 0
    finally:
        trainer.kill()


def test_server_receives_weights_from_a_trainer(checkpoints):
    """Dev mode: /init_weight_transfer joins the trainer, /receive_weights loads its
    send (400 for the one that does not fit), and responses carry the version."""
    import subprocess
    import sys

    import httpx

    from server_utils import ThreadedServer
    from spindle.config import EngineArgs
    from spindle.engine.async_llm import AsyncLLM
    from spindle.entrypoints.openai.api_server import build_app

    old, new, _, _ = checkpoints
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(new / "model.safetensors"),
                                "1"], stdout=subprocess.PIPE, text=True)
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(old), device="cpu", dtype="float32",
                                                  max_model_len=256))
    server = ThreadedServer(build_app(engine, ["tiny"], dev_mode=True))
    try:
        address = trainer.stdout.readline().strip()
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.post("/init_weight_transfer", json={"address": address}).json() == \
                {"connected": True}
            got = http.post("/receive_weights", json={"version": "sent"})
            assert got.status_code == 200 and got.json() == {"weight_version": "sent"}
            refused = http.post("/receive_weights", json={})
            assert refused.status_code == 400
            assert "down_proj.weight' has shape [3, 3]" in refused.json()["error"]["message"]
            answer = http.post("/v1/completions", json={"model": "tiny", "prompt": prompts()[1],
                                                        "max_tokens": 4, "temperature": 0})
            assert answer.json()["choices"][0]["weight_version"] == "sent"
        assert trainer.wait(timeout=30) == 0
    finally:
        trainer.kill()
        server.stop()
        engine.shutdown()


def test_a_weight_sender_refuses_what_it_cannot_do():
    from spindle.rl import WeightSender

    with pytest.raises(ValueError, match="backend must be one of"):
        WeightSender(1, backend="mpi")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="backend='nccl' needs a CUDA device"):
            WeightSender(1, backend="nccl")
    sender = WeightSender(1)
    sender._channel = object()  # (as if connected: the check comes before any traffic)
    with pytest.raises(ValueError, match="cuda_ipc=True needs CUDA tensors"):
        sender.send({"w": torch.zeros(2)}, cuda_ipc=True)
