"""The engine's host work per decode step, with the model taken out.

A tiny checkpoint runs on the CPU with its forward and LM head replaced by constant
tensors, so what is timed is what the engine does around the model every step:
scheduling, the runner's bookkeeping and input preparation, the sampler's launch,
recording the sampled tokens, stop checks and output processing. On a GPU this is the
work async scheduling must hide behind each step's kernels; per sequence, it bounds
how many sequences one step can serve before the host becomes the limit.

    python benchmarks/host_overhead.py [--batch 64 256] [--arch llama|bamba|mistral]
        [--json out.json]

--arch bamba: a hybrid (Mamba2 + attention) model, whose steps also carry state slots.
--arch mistral: attention in a sliding window of 32 tokens, which the sequences pass.

Run it on the machine whose host you want to know (the GPU host is slower than a
desktop core); it uses one thread.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

VOCAB = 4096
HIDDEN = 32


def build_engine(path: Path, batch: int, caching: bool):
    from spindle import LLM

    llm = LLM(str(path), max_model_len=4096, max_num_seqs=batch, device="cpu",
              enable_prefix_caching=caching)
    state = llm.engine.core.executor.worker.runner.state
    hidden = torch.zeros(8192, HIDDEN)
    logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(0))
    state.forward = lambda inputs: hidden[: inputs["input_ids"].shape[0]]
    state.compute_logits = lambda h: logits[: h.shape[0]]
    return llm


def host_ms_per_step(llm, batch: int, steps: int = 30, repeats: int = 10) -> float:
    """Best of repeats: mean wall time of a step with batch sequences decoding."""
    from spindle import SamplingParams

    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
    for _ in range(batch):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(10, 40))]
        engine.add_request(prompt, params, final_only=True)
    for _ in range(5):  # every prompt prefilled: from here on, decode steps only
        engine.step()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        best = min(best, (time.perf_counter() - start) / steps)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--arch", default="llama", choices=["llama", "bamba", "mistral"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from spindle.tools.tiny_model import make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shape = dict(hidden_size=HIDDEN, num_layers=1, num_heads=2, num_kv_heads=1,
                     intermediate_size=64)
        if args.arch == "bamba":  # one Mamba2 layer and one attention layer
            shape.update(num_layers=2)
        if args.arch == "mistral":
            shape.update(sliding_window=32)
        path = make_tiny_model(Path(tmp) / "tiny", arch=args.arch, vocab_size=VOCAB,
                               max_position_embeddings=4096, **shape)
        for batch in args.batch:
            for caching in (False, True):
                llm = build_engine(path, batch, caching)
                ms = host_ms_per_step(llm, batch)
                llm.shutdown()
                rows.append({"batch": batch, "prefix_caching": caching, "ms_per_step": ms,
                             "us_per_sequence": ms * 1e3 / batch})
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"),
                                         "python": sys.version.split()[0],
                                         "torch": torch.__version__, "rows": rows}, indent=2))
    print(f"{'batch':>6} {'prefix cache':>13} {'ms / step':>10} {'us / sequence':>14}")
    for r in rows:
        print(f"{r['batch']:>6} {str(r['prefix_caching']):>13} {r['ms_per_step']:>10.3f} "
              f"{r['us_per_sequence']:>14.2f}")


if __name__ == "__main__":
    main()
