"""Reading a checkpoint's HF config and tokenizer in a fresh process, the ways spindle could.

Each run is a fresh interpreter that imports torch first (spindle's start has it by then)
and times its steps. Runs are interleaved, --repeats times each; the tables give medians
of wall-clock and CPU seconds (CPU time moves less than wall time on a shared host).

- loads: the HF config from config.json, then the tokenizer, per variant: spindle's
  loaders on a later start (the start cache holds the checkpoint: no transformers), on a
  first start (an empty start cache: transformers, then the entries written) and with
  the start cache off (SPINDLE_START_CACHE=0: transformers' objects); transformers'
  AutoConfig + AutoTokenizer; and importing only the Qwen3 config class and the
  Qwen2Tokenizer class (named by hand);
- ready: `from spindle import LLM` + `LLM(...)` on a tiny Qwen3 with the same tokenizer,
  on a later start and with the start cache off;
- imports: single transformers imports, to show where the seconds go.

The checkpoint is the Qwen3-0.6B shape's config.json with a Qwen3-style tokenizer
(151,643-token byte-level BPE, Qwen2Tokenizer). The spindle measured is the one a fresh
`python -c "import spindle"` finds (set PYTHONPATH to compare two checkouts).

    python benchmarks/hf_loading.py [--repeats 7] [--variants later,first,off,auto,classes]
                                    [--no-imports] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from throughput import (ARCHITECTURES, QWEN3_06B, write_qwen3_style_tokenizer,  # noqa: E402
                        write_random_checkpoint)

# Qwen3-0.6B's vocabulary (the tokenizer's ids fit), two small layers.
TINY_QWEN3 = dict(QWEN3_06B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=128)

_SPINDLE = ("from spindle.hf_config import load_hf_config\nconfig = load_hf_config(path)",
            "from spindle.engine.tokenizer_loader import load_tokenizer\n"
            "tokenizer = load_tokenizer(path, config)")
# name -> ((code that sets `config`, code that sets `tokenizer`), start cache): `path` is
# the checkpoint; the start cache is "filled" (a folder an earlier process filled),
# "empty" (a new folder each run) or "off".
VARIANTS = {
    "later": (_SPINDLE, "filled"),
    "first": (_SPINDLE, "empty"),
    "off": (_SPINDLE, "off"),
    "auto": ((
        "from transformers import AutoConfig\nconfig = AutoConfig.from_pretrained(path)",
        "from transformers import AutoTokenizer\ntokenizer = AutoTokenizer.from_pretrained(path)"),
        "off"),
    "classes": ((
        "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
        "config = CONFIG_MAPPING['qwen3'].from_pretrained(path)",
        "from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer\n"
        "tokenizer = Qwen2Tokenizer.from_pretrained(path)"), "off"),
}
READY = ("from spindle import LLM\n"
         "llm = LLM(ready_path, device='cpu', dtype='float32', max_model_len=2048, "
         "kv_cache_memory_bytes=1 << 24, max_num_seqs=4)\n"
         "llm.shutdown()")
READY_CACHES = ("filled", "off")
IMPORTS = ("import transformers",
           "from transformers import AutoConfig",
           "import transformers.models.qwen3.configuration_qwen3",
           "from transformers import AutoTokenizer",
           "import transformers.tokenization_utils_tokenizers",
           "import transformers.models.qwen2.tokenization_qwen2",
           "import transformers.generation.utils")

_RUN = r"""
import json, sys, time
import torch
path, ready_path = sys.argv[1], sys.argv[2]
steps = json.loads(sys.argv[3])
times = []
for code in steps:
    wall, cpu = time.perf_counter(), time.process_time()
    exec(code)
    times.append([time.perf_counter() - wall, time.process_time() - cpu])
print("TIMES " + json.dumps(times))
"""


def run_once(paths: tuple[Path, Path], steps: list[str], cache: str = "off") -> list[list[float]]:
    # (cwd: the checkpoints' folder, so that `import spindle` is not this checkout's by
    # accident of the working directory.)
    env = dict(os.environ)
    env.pop("SPINDLE_START_CACHE", None)
    root = paths[0].parent
    if cache == "off":
        env["SPINDLE_START_CACHE"] = "0"
    elif cache == "filled":
        env["SPINDLE_START_CACHE_DIR"] = str(root / "start-cache")
    else:
        env["SPINDLE_START_CACHE_DIR"] = tempfile.mkdtemp(dir=root, prefix="empty-cache-")
    proc = subprocess.run([sys.executable, "-c", _RUN, *map(str, paths), json.dumps(steps)],
                          capture_output=True, text=True, cwd=root, timeout=600, env=env)
    found = [line for line in proc.stdout.splitlines() if line.startswith("TIMES ")]
    if proc.returncode or not found:
        raise RuntimeError(f"run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(found[0].split(" ", 1)[1])


def medians(runs: list[list[list[float]]]) -> list[tuple[float, float]]:
    return [(statistics.median(r[i][0] for r in runs), statistics.median(r[i][1] for r in runs))
            for i in range(len(runs[0]))]


def write_checkpoints(root: Path) -> tuple[Path, Path]:
    """config.json of the Qwen3-0.6B shape (no weights: the loads read none) with a
    Qwen3-style tokenizer; and a tiny Qwen3 with the same tokenizer, to start an LLM."""
    shape = root / "qwen3-0.6b-shape"
    shape.mkdir(parents=True)
    config = dict(ARCHITECTURES["qwen3"], hidden_act="silu", attention_bias=False,
                  torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1, **QWEN3_06B)
    (shape / "config.json").write_text(json.dumps(config))
    write_qwen3_style_tokenizer(shape)
    tiny = write_random_checkpoint(root / "tiny-qwen3", TINY_QWEN3, dtype=torch.float32)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        (tiny / name).write_bytes((shape / name).read_bytes())
    return shape, tiny


def measure(paths: tuple[Path, Path], variants: list[str], repeats: int,
            imports: bool) -> dict:
    # Fill the start cache the "later" runs read (config, tokenizer and the tiny model's).
    run_once(paths, list(_SPINDLE), "filled")
    run_once(paths, [READY], "filled")
    loads: dict[str, list] = {v: [] for v in variants}
    ready: dict[str, list] = {c: [] for c in READY_CACHES}
    statements: dict[str, list] = {s: [] for s in (IMPORTS if imports else ())}
    for _ in range(repeats):  # interleaved, so a burst of load hits every variant alike
        for variant in variants:
            steps, cache = VARIANTS[variant]
            loads[variant].append(run_once(paths, list(steps), cache))
        for cache in READY_CACHES:
            ready[cache].append(run_once(paths, [READY], cache))
        for statement in statements:
            statements[statement].append(run_once(paths, [statement]))
    return {"loads": {v: medians(r) for v, r in loads.items()},
            "ready": {c: medians(r)[0] for c, r in ready.items()},
            "imports": {s: medians(r)[0] for s, r in statements.items()}}


def format_tables(result: dict) -> str:
    lines = [f"{'variant':<10}{'config wall':>12}{'cpu':>7}{'tokenizer wall':>16}{'cpu':>7}"
             f"{'both wall':>11}{'cpu':>7}"]
    for variant, ((cw, cc), (tw, tc)) in result["loads"].items():
        lines.append(f"{variant:<10}{cw:>12.2f}{cc:>7.2f}{tw:>16.2f}{tc:>7.2f}"
                     f"{cw + tw:>11.2f}{cc + tc:>7.2f}")
    lines += ["", f"{'LLM ready (tiny Qwen3), after torch':<56}{'wall':>7}{'cpu':>7}"]
    for cache, (wall, cpu) in result["ready"].items():
        label = {"filled": "later start", "off": "start cache off"}[cache]
        lines.append(f"{'LLM(...), ' + label:<56}{wall:>7.2f}{cpu:>7.2f}")
    if result["imports"]:
        lines += ["", f"{'import, after torch':<56}{'wall':>7}{'cpu':>7}"]
    for statement, (wall, cpu) in result["imports"].items():
        lines.append(f"{statement:<56}{wall:>7.2f}{cpu:>7.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--no-imports", action="store_true",
                        help="skip the table of single imports")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {sorted(VARIANTS)}")
    import transformers

    import spindle

    print(f"spindle from {Path(spindle.__file__).parent}")
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(write_checkpoints(Path(tmp)), variants, args.repeats,
                         not args.no_imports)
    result.update(date=time.strftime("%Y-%m-%d"), python=platform.python_version(),
                  spindle=str(Path(spindle.__file__).parent),
                  torch=torch.__version__, transformers=transformers.__version__,
                  repeats=args.repeats)
    print(f"python {result['python']}, torch {result['torch']}, transformers "
          f"{result['transformers']}; medians of {args.repeats} fresh processes (seconds)")
    print(format_tables(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
