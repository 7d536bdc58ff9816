"""Reasoning models' answers split into their reasoning and their reply (the server's
--reasoning-parser): the text between <think> and </think> becomes the message's
`reasoning_content`, what follows it the `content`.

- `qwen3`: the model opens its reasoning itself ("<think>...</think>reply"); an answer
  that does not start with <think> (thinking turned off) is all reply.
- `deepseek_r1`: the template opens the reasoning in the prompt (DeepSeek-R1, and the
  Qwen3 2507 thinking models), so the answer starts inside it: everything up to
  </think> is reasoning, and an answer without the end tag is all reasoning (it was
  cut short while thinking).

A stream is split as it comes (ReasoningSplitter): a tag can arrive in pieces, so
text that may be the start of one is held back until it is known.
"""

from __future__ import annotations

REASONING_PARSERS = ("deepseek_r1", "qwen3")
# Parsers whose answers start inside the reasoning (the template opened <think>).
OPENED_BY_TEMPLATE = ("deepseek_r1",)
START, END = "<think>", "</think>"


def splits_constrained_answers(parser: str) -> bool:
    """Whether an answer shaped by structured outputs is split too: only where the
    answer opens its reasoning itself (a schema's JSON never starts with <think>, but
    where the template opened it, all of the JSON would pass for reasoning)."""
    return parser not in OPENED_BY_TEMPLATE


class ReasoningSplitter:
    """Splits one answer's text, fed in pieces, into reasoning and reply."""

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {parser!r}")
        # "start": not yet known whether the answer opens with <think>; "reasoning";
        # "after_end": the blank lines after </think>; "reply".
        self.phase = "reasoning" if parser in OPENED_BY_TEMPLATE else "start"
        self.pending = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, reply) text that text adds, past what may still be a tag; final:
        the answer ends here, so nothing is held back."""
        self.pending += text
        reasoning = ""
        if self.phase == "start":
            head = self.pending.lstrip()
            if head.startswith(START):
                self.pending, self.phase = head[len(START):], "reasoning"
            elif START.startswith(head) and not final:
                return "", ""  # (nothing yet, or a piece of "<think>")
            else:
                self.phase = "reply"
        if self.phase == "reasoning":
            end = self.pending.find(END)
            if end < 0:
                cut = len(self.pending) - (0 if final else _partial_tag(self.pending, END))
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
                return reasoning, ""
            reasoning = self.pending[:end]
            self.pending, self.phase = self.pending[end + len(END):], "after_end"
        if self.phase == "after_end":
            self.pending = self.pending.lstrip("\n")
            if not self.pending:
                return reasoning, ""
            self.phase = "reply"
        reply, self.pending = self.pending, ""
        return reasoning, reply


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of text that is a proper start of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_reasoning(text: str, parser: str) -> tuple[str | None, str | None]:
    """(reasoning, reply) of a whole answer; None for a part it does not have."""
    reasoning, reply = ReasoningSplitter(parser).feed(text, final=True)
    return reasoning or None, reply or None
