"""Weights from a trainer process on the GPU. By CUDA IPC from the same GPU
(WeightSender.send with cuda_ipc=True): the engine sleeps at level 2 with the cumem
backend, wakes its weights alone, takes the trainer's tensors by handle, wakes the
rest, and then equals
transformers on the new checkpoint (float32); the trainer changing its tensors after
send() returns does not reach the engine. Over NCCL from another GPU (two GPUs)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from spindle import LLM
from test_weight_update import GREEDY, hf_tokens, prompts, tokens

pytestmark = pytest.mark.gpu

# The trainer: the new checkpoint's tensors on the GPU; sends handles, then zeroes its
# tensors and waits until the test has generated.
_TRAINER = r"""
import sys
import torch
from safetensors.torch import load_file
from spindle.rl import WeightSender

weights = {k: v.cuda() for k, v in load_file(sys.argv[1]).items()}
sender = WeightSender(1, timeout_s=120)
print(sender.address, flush=True)
sender.connect()
try:
    sender.send({k: v.cpu() for k, v in weights.items()}, cuda_ipc=True)
except ValueError as e:
    print("refused host tensors:", e, flush=True)
sender.send(weights, cuda_ipc=True)
for tensor in weights.values():
    tensor.zero_()
torch.cuda.synchronize()
print("sent", flush=True)
sys.stdin.readline()
sender.close()
"""


def test_weights_by_cuda_ipc_into_a_sleeping_engine(tiny_model):
    old, new = tiny_model("llama"), tiny_model("llama", seed=7)
    expected = hf_tokens(new)
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(new / "model.safetensors")],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = trainer.stdout.readline().strip()
        with LLM(str(old), device="cuda", dtype="float32", max_model_len=256,
                 enable_sleep_mode=True) as llm:
            before = tokens(llm.generate(prompts(), GREEDY, use_tqdm=False))
            assert before != expected
            llm.sleep(level=2)
            llm.wake_up(["weights"])
            llm.init_weight_transfer(address, timeout_s=120)
            llm.receive_weights(version="ipc-1")
            assert trainer.stdout.readline().startswith("refused host tensors: cuda_ipc=True")
            assert trainer.stdout.readline().strip() == "sent"  # and its tensors are zero
            llm.wake_up()
            outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
            assert tokens(outputs) == expected
            assert {o.weight_version for o in outputs} == {"ipc-1"}
        trainer.stdin.write("\n")
        trainer.stdin.flush()
        assert trainer.wait(timeout=60) == 0
    finally:
        trainer.kill()


_NCCL_TRAINER = r"""
import sys
import torch
from safetensors.torch import load_file
from spindle.rl import WeightSender

weights = {k: v.cuda() for k, v in load_file(sys.argv[1]).items()}
sender = WeightSender(1, timeout_s=120, backend="nccl")
print(sender.address, flush=True)
sender.connect()
sender.send(weights, batch_bytes=1 << 16)  # several batches
print("sent", flush=True)
sender.close()
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs the trainer and the "
                    "engine on two different GPUs (run on nvidia-h200-x2)")
def test_weights_over_nccl_from_a_trainer_on_another_gpu(tiny_model):
    import os

    old, new = tiny_model("llama"), tiny_model("llama", seed=7)
    expected = hf_tokens(new)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="1")
    trainer = subprocess.Popen([sys.executable, "-c", _NCCL_TRAINER,
                                str(new / "model.safetensors")], stdout=subprocess.PIPE,
                               text=True, env=env)
    try:
        address = trainer.stdout.readline().strip()
        with LLM(str(old), device="cuda", device_ids=[0], dtype="float32",
                 max_model_len=256) as llm:
            llm.init_weight_transfer(address, timeout_s=120)
            llm.receive_weights(version="nccl-1")
            outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert tokens(outputs) == expected
        assert {o.weight_version for o in outputs} == {"nccl-1"}
        assert trainer.stdout.readline().strip() == "sent"
        assert trainer.wait(timeout=60) == 0
    finally:
        trainer.kill()
