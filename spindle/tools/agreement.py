"""How often two engine configurations of one model pick the same next token.

The baseline answers each prompt greedily; then both configurations predict the next
token after every prefix of those answers (teacher forcing), so one early difference
does not make every later position differ. Used to state what a lossy option (e.g.
quantization="fp8") costs: benchmarks/fp8.py and the GPU tests.
"""

from __future__ import annotations

from typing import Any, Sequence

TOP_LOGPROBS = 20


def chat_prompts(model: str, questions: Sequence[str]) -> list[list[int]]:
    """Each question as one user turn in the checkpoint's chat template, tokenized
    (model: anything LLM takes, a GGUF file included)."""
    from transformers import AutoTokenizer

    from spindle.config import model_directory

    tokenizer = AutoTokenizer.from_pretrained(str(model_directory(model)))
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                          add_generation_prompt=True, return_dict=False)
            for q in questions]


def _next_tokens(llm, prefixes: list[list[int]], reference: list[int] | None = None):
    """(top token, logprob of the reference token or None if outside the top 20) after
    each prefix."""
    from spindle import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=TOP_LOGPROBS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prefixes], params, use_tqdm=False)
    result = []
    for i, out in enumerate(outs):
        answer = out.outputs[0]
        token = answer.token_ids[0]
        wanted = token if reference is None else reference[i]
        entry = answer.logprobs[0].get(wanted)
        result.append((token, entry.logprob if entry is not None else None))
    return result


def top1_agreement(model: str, questions: Sequence[str], max_new: int,
                   baseline: dict[str, Any], candidate: dict[str, Any]) -> dict[str, Any]:
    """Teacher-forced top-1 agreement of candidate with baseline (LLM keyword
    arguments) over every position of the baseline's greedy answers, the mean absolute
    logprob difference of the baseline's token (where it is in the candidate's top 20),
    how many whole greedy answers are the same, both sides' answers, and the
    baseline's logprob of each of its tokens (teacher-forced)."""
    from spindle import LLM, SamplingParams

    prompts = chat_prompts(model, questions)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_new)
    answers_of = {}
    with LLM(model, **baseline) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        answers = [list(o.outputs[0].token_ids) for o in outs]
        prefixes = [p + a[:j] for p, a in zip(prompts, answers) for j in range(len(a))]
        targets = [t for a in answers for t in a]
        base = _next_tokens(llm, prefixes, targets)
        answers_of["baseline"] = answers
    with LLM(model, **candidate) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        answers_of["candidate"] = [list(o.outputs[0].token_ids) for o in outs]
        cand = _next_tokens(llm, prefixes, targets)
    agree = sum(c[0] == t for c, t in zip(cand, targets))
    gaps = [abs(c[1] - b[1]) for c, b in zip(cand, base) if c[1] is not None and b[1] is not None]
    return {"positions": len(targets), "top1_agreement": agree / max(len(targets), 1),
            "baseline_self_agreement": sum(b[0] == t for b, t in zip(base, targets))
            / max(len(targets), 1),
            "mean_abs_logprob_gap": sum(gaps) / max(len(gaps), 1),
            "identical_answers": sum(a == b for a, b in zip(answers_of["baseline"],
                                                             answers_of["candidate"])),
            "answers": len(answers), "baseline_answers": answers_of["baseline"],
            "candidate_answers": answers_of["candidate"],
            "baseline_logprobs": [b[1] for b in base]}
