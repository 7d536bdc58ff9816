"""A/B of engine switches on the GPU: throughput.py in fresh processes, one per variant
and round, the variants alternating (a process's batch-1 speed moves by up to 20% from
one process to the next on the same machine, so one run per variant says little).

A variant is a name and the environment variables it sets; "main=" sets none. An item
that starts with "--" is an option of throughput.py instead (--block-size=32):

    python benchmarks/switch_ab.py --variant main= \\
        --variant batch_order=SPINDLE_DECODE_LONGEST_FIRST=0 \\
        --variant both_off=SPINDLE_DECODE_LONGEST_FIRST=0,SPINDLE_PDL=0 \\
        --variant pages32=--block-size=32 \\
        [--rounds 2] [--skip-nano] [--json out.json] [--out-dir DIR]

Every run uses one random checkpoint (written by the first). Prints per variant the
median (and range) of batch-1 tok/s, the decode graph replay at 1, 64 and the largest
captured batch, nano tok/s and its ratio to the roofline, and whether the batch-1
greedy tokens equal the first variant's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
COLUMNS = (("batch1_tok_s", "batch-1 tok/s", "{:.0f}"),
           ("graph_replay_ms_b1", "replay b1 ms", "{:.3f}"),
           ("graph_replay_ms_b64", "replay b64 ms", "{:.3f}"),
           ("graph_replay_ms_bmax", "replay max ms", "{:.3f}"),
           ("nano_tok_s", "nano tok/s", "{:.0f}"),
           ("ratio_to_roofline", "x roofline", "{:.3f}"))


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """"name=VAR=VAL,VAR2=VAL2" (or "name=") -> (name, {VAR: VAL, ...})."""
    name, sep, rest = spec.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"a variant is NAME=[VAR=VALUE,...], got {spec!r}")
    env = {}
    for item in filter(None, rest.split(",")):
        var, sep, value = item.partition("=")
        if not sep or not var:
            raise argparse.ArgumentTypeError(f"variant {name!r}: {item!r} is not VAR=VALUE")
        env[var] = value
    return name, env


def one_run(variant: dict[str, str], checkpoint: Path, skip_nano: bool, out: Path) -> dict:
    options = [f"{key}={value}" for key, value in variant.items() if key.startswith("--")]
    env = {key: value for key, value in variant.items() if not key.startswith("--")}
    cmd = [sys.executable, str(HERE / "throughput.py"), "--json", str(out),
           "--checkpoint", str(checkpoint), *options] + (["--skip-nano"] if skip_nano else [])
    proc = subprocess.run(cmd, env={**os.environ, **env}, cwd=HERE, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"throughput.py failed ({variant}):\n{proc.stdout[-2000:]}"
                         f"\n{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    # (throughput.py names the replay sizes it found: b1, b64 and its largest.)
    largest = max((k for k in result if k.startswith("graph_replay_ms_b")),
                  key=lambda k: int(k.rsplit("b", 1)[1]), default=None)
    if largest is not None:
        result["graph_replay_ms_bmax"] = result[largest]
    return result


def summary(runs: list[dict], key: str, fmt: str) -> str:
    values = [r[key] for r in runs if key in r]
    if not values:
        return "-"
    med = fmt.format(statistics.median(values))
    if len(values) == 1:
        return med
    return f"{med} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", type=parse_variant, action="append", required=True,
                        help="NAME=[VAR=VALUE,...]; give it once per variant")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-nano", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--out-dir", type=Path, help="keep each run's JSON here")
    args = parser.parse_args()
    names = [name for name, _ in args.variant]
    if len(set(names)) != len(names):
        raise SystemExit(f"variant names must differ, got {names}")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.out_dir or Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        checkpoint = Path(tmp) / "checkpoint"
        for round_ in range(args.rounds):
            for name, env in args.variant:
                start = time.perf_counter()
                result = one_run(env, checkpoint, args.skip_nano,
                                 out_dir / f"{name}_{round_}.json")
                runs[name].append(result)
                print(f"round {round_ + 1} {name}: batch-1 {result['batch1_tok_s']:.0f} tok/s"
                      + (f", nano x{result['ratio_to_roofline']:.3f}"
                         if "ratio_to_roofline" in result else "")
                      + f" ({time.perf_counter() - start:.0f} s)", flush=True)
    first_hash = runs[names[0]][0]["batch1_tokens_hash"]
    header = ["variant", *(label for _, label, _ in COLUMNS), "greedy = first"]
    rows = [[name, *(summary(runs[name], key, fmt) for key, _, fmt in COLUMNS),
             "yes" if all(r["batch1_tokens_hash"] == first_hash for r in runs[name]) else "NO"]
            for name in names]
    first = runs[names[0]][0]
    print(f"\n{first.get('device')}, torch {first.get('torch')}, triton {first.get('triton')}, "
          f"{args.rounds} rounds, median (min-max)")
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(str(cell).rjust(w) for cell, w in zip(row, widths)))
    if args.json:
        args.json.write_text(json.dumps({"variants": dict(args.variant), "runs": runs},
                                        indent=1))


if __name__ == "__main__":
    main()
