"""Regular expressions compiled into deterministic finite automata over UTF-8 bytes.

Structured outputs walk every vocabulary token's bytes through such an automaton to learn
which tokens may come next, so the automaton works on bytes, not characters, and it is
trimmed: each of its states is reachable from the start and can still reach an accepting
state, so following allowed transitions never leads into a dead end.

The pipeline: parse a subset of Python's `re` syntax (full-match semantics) into a tree
over code point sets; build a Thompson NFA whose edges are byte ranges (each code point
range becomes the byte-range sequences of its UTF-8 encodings); determinise it over byte
intervals; trim; minimise (partition refinement); then merge the byte values that behave
alike into equivalence classes to keep the table narrow.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field

import numpy as np

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)
# Building stops here: a bigger NFA would take too long to determinise in pure Python.
MAX_NFA_STATES = 300_000

DIGIT = ((0x30, 0x39),)
WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
SPACE = ((0x09, 0x0D), (0x20, 0x20))
SIMPLE_ESCAPES = {"t": 0x09, "n": 0x0A, "r": 0x0D, "f": 0x0C, "v": 0x0B, "a": 0x07}
UNSUPPORTED_ESCAPES = {"b": "word boundary", "B": "non-word boundary",
                       "A": "start-of-string anchor", "Z": "end-of-string anchor"}
BRACE_QUANTIFIER = re.compile(r"\{([0-9]*)(?:(,)([0-9]*))?\}")
OCTAL_DIGITS = re.compile(r"[0-7]{0,2}")
INLINE_FLAGS = re.compile(r"\?[-a-zA-Z]*[:)]?")
NAMED_CHARACTER = re.compile(r"\{([^}]*)\}")
HEX_DIGITS = {"x": 2, "u": 4, "U": 8}


# --- code point sets: sorted tuples of disjoint (lo, hi) ranges, surrogates excluded ---

def normalize_ranges(ranges) -> tuple[tuple[int, int], ...]:
    """Sorts and merges the ranges and cuts the surrogates out (they have no UTF-8 form)."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    result = []
    for lo, hi in merged:
        if hi < SURROGATES[0] or lo > SURROGATES[1]:
            result.append((lo, hi))
            continue
        if lo < SURROGATES[0]:
            result.append((lo, SURROGATES[0] - 1))
        if hi > SURROGATES[1]:
            result.append((SURROGATES[1] + 1, hi))
    return tuple(result)


def complement_ranges(ranges) -> tuple[tuple[int, int], ...]:
    result, next_free = [], 0
    for lo, hi in normalize_ranges(ranges):
        if lo > next_free:
            result.append((next_free, lo - 1))
        next_free = hi + 1
    if next_free <= MAX_CODE_POINT:
        result.append((next_free, MAX_CODE_POINT))
    return normalize_ranges(result)


DOT = complement_ranges([(0x0A, 0x0A)])


def utf8_sequences(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """Byte-range sequences whose concatenations are exactly the UTF-8 encodings of the
    code points lo..hi (no surrogates inside). The range is split by encoded length, then
    until every byte position varies independently of the others."""
    for limit in (0x7F, 0x7FF, 0xFFFF):
        if lo <= limit < hi:
            return utf8_sequences(lo, limit) + utf8_sequences(limit + 1, hi)
    length = len(chr(lo).encode())
    for i in range(1, length):
        mask = (1 << (6 * i)) - 1
        if lo & ~mask != hi & ~mask:
            if lo & mask:
                return utf8_sequences(lo, lo | mask) + utf8_sequences((lo | mask) + 1, hi)
            if hi & mask != mask:
                return utf8_sequences(lo, (hi & ~mask) - 1) + utf8_sequences(hi & ~mask, hi)
    return [list(zip(chr(lo).encode(), chr(hi).encode()))]


# --- parsing: nodes are ("set", ranges), ("cat", [nodes]), ("alt", [nodes]),
# ("rep", node, lo, hi or None) ---

def shorten(pattern: str) -> str:
    return repr(pattern if len(pattern) <= 80 else pattern[:77] + "...")


class _Parser:
    def __init__(self, pattern: str):
        self.pattern = pattern
        self.pos = 0
        self.nodes: dict[str, tuple] = {}

    def intern(self, node, start: int):
        """One node object for each distinct subpattern text (equal text, equal language)."""
        return self.nodes.setdefault(self.pattern[start:self.pos], node)

    def error(self, what: str, pos: int | None = None) -> ValueError:
        where = self.pos if pos is None else pos
        return ValueError(f"{what} at position {where} of regex {shorten(self.pattern)}")

    def peek(self, offset: int = 0) -> str | None:
        index = self.pos + offset
        return self.pattern[index] if index < len(self.pattern) else None

    def parse(self):
        tree = self.parse_alternation()
        if self.pos < len(self.pattern):
            raise self.error("unbalanced parenthesis ')'")
        return tree

    def parse_alternation(self):
        start = self.pos
        branches = [self.parse_sequence()]
        while self.peek() == "|":
            self.pos += 1
            branches.append(self.parse_sequence())
        return branches[0] if len(branches) == 1 else self.intern(("alt", branches), start)

    def parse_sequence(self):
        start, items = self.pos, []
        while self.peek() is not None and self.peek() not in "|)":
            atom_pos = self.pos
            atom = self.parse_atom()
            quantifier = self.parse_quantifier()
            if quantifier is not None:
                if atom is None:
                    raise self.error("quantifier with nothing to repeat", atom_pos)
                atom = self.intern(("rep", atom, *quantifier), atom_pos)
                if self.parse_quantifier(check_only=True):
                    raise self.error("multiple repeat (a quantifier after a quantifier)")
            if atom is not None:
                items.append(atom)
        return items[0] if len(items) == 1 else self.intern(("cat", items), start)

    def parse_quantifier(self, check_only: bool = False):
        """(lo, hi) of the quantifier at pos (hi None: unbounded), or None if there is none.
        Lazy forms mean the same language; possessive forms are refused."""
        char, start = self.peek(), self.pos
        if char in ("*", "+", "?"):
            bounds = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
            end = start + 1
        elif char == "{" and (brace := self.brace_quantifier(start)) is not None:
            bounds, end = brace[:2], brace[2]
        else:
            return None
        if check_only:
            return bounds
        self.pos = end
        if self.peek() == "?":
            self.pos += 1
        elif self.peek() == "+":
            raise self.error("unsupported possessive quantifier", start)
        return bounds

    def brace_quantifier(self, pos: int):
        match = BRACE_QUANTIFIER.match(self.pattern, pos)
        if match is None or (not match.group(1) and match.group(2) is None):
            return None  # Python reads such a '{' as a literal
        lo = int(match.group(1) or 0)
        hi = lo if match.group(2) is None else (int(match.group(3)) if match.group(3) else None)
        if hi is not None and hi < lo:
            raise self.error(f"quantifier {match.group(0)} has min greater than max", pos)
        return lo, hi, match.end()

    def parse_atom(self):
        char, start = self.peek(), self.pos
        if char == "(":
            return self.parse_group()
        if char == "[":
            return self.intern(("set", self.parse_class()), start)
        if char == "\\":
            return self.intern(("set", self.parse_escape(in_class=False)[0]), start)
        self.pos += 1
        if char == ".":
            return self.intern(("set", DOT), start)
        if char == "^":
            if start != 0:
                raise self.error("unsupported '^' anchor (only allowed at the start)", start)
            return None
        if char == "$":
            if start != len(self.pattern) - 1:
                raise self.error("unsupported '$' anchor (only allowed at the end)", start)
            return None
        if char in "*+?" or (char == "{" and self.brace_quantifier(start)):
            raise self.error(f"quantifier {char!r} with nothing to repeat", start)
        return self.intern(("set", normalize_ranges([(ord(char), ord(char))])), start)

    def parse_group(self):
        start = self.pos
        self.pos += 1
        if self.peek() == "?":
            if self.pattern.startswith("?#", self.pos):
                end = self.pattern.find(")", self.pos)
                if end < 0:
                    raise self.error("unterminated comment group", start)
                self.pos = end + 1
                return None
            self.parse_group_extension(start)
        body = self.parse_alternation()
        if self.peek() != ")":
            raise self.error("unbalanced parenthesis '(' (missing ')')", start)
        self.pos += 1
        return body

    def parse_group_extension(self, start: int) -> None:
        """Consumes '?:' or '?P<name>'; everything else after '(?' is refused by name."""
        rest = self.pattern[self.pos:self.pos + 4]
        if rest.startswith("?:"):
            self.pos += 2
            return
        if rest.startswith("?P<"):
            end = self.pattern.find(">", self.pos)
            name = self.pattern[self.pos + 3:end] if end >= 0 else ""
            if end < 0 or not name.isidentifier():
                raise self.error("bad group name in '(?P<...>'", start)
            self.pos = end + 1
            return
        for prefix, what in (("?P=", "backreference"), ("?=", "lookahead"),
                             ("?!", "negative lookahead"), ("?<=", "lookbehind"),
                             ("?<!", "negative lookbehind"), ("?>", "atomic group"),
                             ("?(", "conditional group")):
            if rest.startswith(prefix):
                raise self.error(f"unsupported {what} '({prefix}'", start)
        flags = INLINE_FLAGS.match(self.pattern, self.pos).group(0)
        raise self.error(f"unsupported inline flag group '({flags}'", start)

    def parse_class(self) -> tuple[tuple[int, int], ...]:
        start = self.pos
        self.pos += 1
        negate = self.peek() == "^"
        self.pos += negate
        first, ranges = self.pos, []
        while True:
            char = self.peek()
            if char is None:
                raise self.error("unterminated character class '['", start)
            if char == "]" and self.pos != first:
                self.pos += 1
                break
            low, single = self.parse_class_item()
            if self.peek() == "-" and self.peek(1) not in (None, "]"):
                self.pos += 1
                high_pos = self.pos
                high, high_single = self.parse_class_item()
                if single is None or high_single is None or high_single < single:
                    raise self.error("bad character range in class", high_pos - 1)
                ranges.append((single, high_single))
            else:
                ranges.extend(low)
        return complement_ranges(ranges) if negate else normalize_ranges(ranges)

    def parse_class_item(self):
        if self.peek() == "\\":
            return self.parse_escape(in_class=True)
        code = ord(self.peek())
        self.pos += 1
        return ((code, code),), code

    def parse_escape(self, in_class: bool):
        """(ranges, the code point if the escape stands for exactly one) for the escape at
        pos, which is consumed. ASCII semantics for \\d \\w \\s."""
        start = self.pos
        letter = self.peek(1)
        if letter is None:
            raise self.error("trailing backslash", start)
        self.pos += 2
        categories = {"d": DIGIT, "w": WORD, "s": SPACE}
        if letter.lower() in categories:
            ranges = categories[letter.lower()]
            return (complement_ranges(ranges) if letter.isupper() else ranges), None
        code = self.escaped_code_point(letter, in_class, start)
        return normalize_ranges([(code, code)]), code

    def escaped_code_point(self, letter: str, in_class: bool, start: int) -> int:
        if letter in SIMPLE_ESCAPES:
            return SIMPLE_ESCAPES[letter]
        if letter == "b" and in_class:
            return 0x08
        if letter == "0":
            digits = OCTAL_DIGITS.match(self.pattern, self.pos).group(0)
            self.pos += len(digits)
            return int("0" + digits, 8)
        if letter in HEX_DIGITS:
            count = HEX_DIGITS[letter]
            digits = self.pattern[self.pos:self.pos + count]
            if len(digits) != count or not all(c in "0123456789abcdefABCDEF" for c in digits):
                raise self.error(f"bad escape '\\{letter}' (needs {count} hex digits)", start)
            self.pos += count
            if int(digits, 16) > MAX_CODE_POINT:
                raise self.error(f"escape '\\{letter}{digits}' beyond U+10FFFF", start)
            return int(digits, 16)
        if letter == "N":
            return self.named_character(start)
        if letter in "123456789":
            raise self.error(f"unsupported backreference '\\{letter}'", start)
        if letter in UNSUPPORTED_ESCAPES:
            what = UNSUPPORTED_ESCAPES[letter]
            raise self.error(f"unsupported {what} '\\{letter}'", start)
        if letter.isascii() and letter.isalpha():
            raise self.error(f"bad escape '\\{letter}'", start)
        return ord(letter)

    def named_character(self, start: int) -> int:
        match = NAMED_CHARACTER.match(self.pattern, self.pos)
        try:
            code = ord(unicodedata.lookup(match.group(1))) if match else None
        except KeyError:
            code = None
        if code is None:
            raise self.error("bad named character escape '\\N{...}'", start)
        self.pos = match.end()
        return code


def parse_regex(pattern: str):
    """The syntax tree of pattern (see the node shapes above); ValueError when unsupported."""
    if not isinstance(pattern, str):
        raise ValueError(f"regex must be a str, got {type(pattern).__name__}")
    try:
        return _Parser(pattern).parse()
    except RecursionError:
        raise ValueError(f"regex {shorten(pattern)} nests groups too deeply") from None


# --- Thompson NFA over byte ranges ---

class _Nfa:
    """States with epsilon edges and byte-range edges. build(node, end) returns a state
    from which node's language leads on to end. A state's outgoing edges are fixed by
    whoever creates it, so its language never changes and fragments can be shared: each
    (node, end) is built once. Equal subpatterns are one node (the parser interns them), so
    the suffix that a regex repeats in several branches (JSON objects with optional
    properties do) is built once, and the DFA before minimisation stays small too."""

    def __init__(self):
        self.epsilon: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []
        self.built: dict[tuple[int, int], int] = {}
        self.steps: dict[tuple[int, int, int], int] = {}

    def new_state(self) -> int:
        if len(self.edges) >= MAX_NFA_STATES:
            raise ValueError(f"regex too large: its NFA exceeds {MAX_NFA_STATES} states")
        self.epsilon.append([])
        self.edges.append([])
        return len(self.edges) - 1

    def build(self, node, end: int) -> int:
        key = (id(node), end)  # the parse tree keeps every node alive while building
        if key not in self.built:
            self.built[key] = self.build_new(node, end)
        return self.built[key]

    def build_new(self, node, end: int) -> int:
        kind = node[0]
        if kind == "set":
            return self.build_set(node[1], end)
        if kind == "alt":
            start = self.new_state()
            self.epsilon[start].extend(self.build(branch, end) for branch in node[1])
            return start
        if kind == "cat":
            state = end
            for item in reversed(node[1]):
                state = self.build(item, state)
            return state
        return self.build_repeat(node[1], node[2], node[3], end)

    def build_set(self, ranges, end: int) -> int:
        start = self.new_state()
        for lo, hi in ranges:
            for sequence in utf8_sequences(lo, hi):
                state = end
                for byte_lo, byte_hi in reversed(sequence[1:]):
                    state = self.byte_step(byte_lo, byte_hi, state)
                self.edges[start].append((*sequence[0], state))
        return start

    def byte_step(self, lo: int, hi: int, target: int) -> int:
        """A state whose one edge is lo..hi to target: shared by all the UTF-8 sequences
        that end alike (continuation bytes), which keeps the DFA before minimisation small."""
        key = (lo, hi, target)
        if key not in self.steps:
            self.steps[key] = self.new_state()
            self.edges[self.steps[key]].append(key)
        return self.steps[key]

    def build_repeat(self, body, lo: int, hi: int | None, end: int) -> int:
        """A loop, or hi - lo nested optional copies (x(x(x)?)?: every epsilon closure stays
        small, unlike x?x?x?), after lo copies in a row."""
        if hi is None:
            state = self.new_state()
            self.epsilon[state].append(end)
            self.epsilon[state].append(self.build(body, state))
        else:
            state = end
            for _ in range(hi - lo):
                optional = self.new_state()
                self.epsilon[optional].extend((end, self.build(body, state)))
                state = optional
        for _ in range(lo):
            state = self.build(body, state)
        return state


# --- determinisation, trimming, minimisation ---

def byte_intervals(nfa: _Nfa) -> np.ndarray:
    """The interval index of each byte: intervals split wherever any edge starts or ends."""
    cuts = {0}
    for edges in nfa.edges:
        for lo, hi, _ in edges:
            cuts.add(lo)
            cuts.add(hi + 1)
    cuts.discard(256)
    return np.searchsorted(np.array(sorted(cuts)), np.arange(256), side="right") - 1


def epsilon_closure(nfa: _Nfa, seeds) -> set[int]:
    seen, stack = set(seeds), list(seeds)
    while stack:
        for target in nfa.epsilon[stack.pop()]:
            if target not in seen:
                seen.add(target)
                stack.append(target)
    return seen


def determinize(nfa: _Nfa, start: int, final: int, max_states: int):
    """Subset construction. Returns (interval of each byte, transitions, accepting)."""
    interval_of = byte_intervals(nfa)
    num_intervals = int(interval_of[-1]) + 1
    interval_edges = [[(int(interval_of[lo]), int(interval_of[hi]), target)
                       for lo, hi, target in edges] for edges in nfa.edges]

    def subset_key(seeds) -> frozenset:
        closure = epsilon_closure(nfa, seeds)
        return frozenset(s for s in closure if interval_edges[s] or s == final)

    keys = [subset_key([start])]
    index_of_key = {keys[0]: 0}
    index_of_targets: dict[frozenset, int] = {}
    rows = []
    for key in keys:  # grows while iterating
        moves: dict[int, list[int]] = {}
        for state in key:
            for first, last, target in interval_edges[state]:
                for interval in range(first, last + 1):
                    moves.setdefault(interval, []).append(target)
        row = [-1] * num_intervals
        for interval, targets in moves.items():
            targets = frozenset(targets)
            if targets not in index_of_targets:
                following = subset_key(targets)
                if following not in index_of_key:
                    if len(keys) >= max_states:
                        raise ValueError(f"regex needs more than max_states={max_states} "
                                         "DFA states")
                    index_of_key[following] = len(keys)
                    keys.append(following)
                index_of_targets[targets] = index_of_key[following]
            row[interval] = index_of_targets[targets]
        rows.append(row)
    accepting = np.array([final in key for key in keys], dtype=bool)
    return interval_of, np.array(rows, dtype=np.int32).reshape(len(keys), -1), accepting


def predecessor_index(transitions: np.ndarray):
    """(bounds, sources): the distinct predecessors of state t are
    sources[bounds[t]:bounds[t + 1]]."""
    num_states = len(transitions)
    sources, _ = np.nonzero(transitions >= 0)
    targets = transitions[transitions >= 0].astype(np.int64)
    pairs = np.unique(targets * num_states + sources)
    bounds = np.searchsorted(pairs // num_states, np.arange(num_states + 1))
    return bounds, pairs % num_states


def predecessors_of(states: np.ndarray, bounds: np.ndarray, sources: np.ndarray) -> np.ndarray:
    starts, lengths = bounds[states], bounds[states + 1] - bounds[states]
    offsets = np.repeat(starts - np.cumsum(lengths) + lengths, lengths)
    return np.unique(sources[offsets + np.arange(int(lengths.sum()))])


def live_states(transitions: np.ndarray, accepting: np.ndarray) -> np.ndarray:
    """Mask of the states from which an accepting state can be reached."""
    bounds, sources = predecessor_index(transitions)
    live = accepting.copy()
    frontier = np.nonzero(accepting)[0]
    while frontier.size:
        found = predecessors_of(frontier, bounds, sources)
        frontier = found[~live[found]]
        live[frontier] = True
    return live


def keep_states(transitions: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """The rows of the kept states, renumbered; transitions into dropped states become -1."""
    new_index = np.full(len(keep) + 1, -1, dtype=np.int32)  # the extra entry maps -1 to -1
    new_index[:-1][keep] = np.arange(int(keep.sum()), dtype=np.int32)
    return new_index[transitions[keep]]


def successor_hashes(transitions, block, states, weights) -> np.ndarray:
    """A 64-bit hash of the blocks of each state's successors (dead counts as block -1)."""
    rows = transitions[states]
    successor_blocks = np.where(rows >= 0, block[rows] + 1, 0).astype(np.uint64)
    return (successor_blocks * weights).sum(axis=1, dtype=np.uint64)


def split_blocks(block, signature, members, next_id: int):
    """Splits the blocks holding members (all members of those blocks) by signature. The
    largest group of a block keeps its id, the others get new ids, so fewer states change
    (as in Hopcroft's algorithm). Returns (states whose block changed, next free id)."""
    order = np.lexsort((signature[members], block[members]))
    members = members[order]
    old, signs = block[members], signature[members]
    starts_group = np.ones(len(members), dtype=bool)
    starts_group[1:] = (old[1:] != old[:-1]) | (signs[1:] != signs[:-1])
    group = np.cumsum(starts_group) - 1
    starts = np.nonzero(starts_group)[0]
    sizes, group_block = np.diff(np.append(starts, len(members))), old[starts]
    by_block = np.lexsort((-sizes, group_block))  # each block's largest group first
    first = np.ones(len(by_block), dtype=bool)
    first[1:] = group_block[by_block][1:] != group_block[by_block][:-1]
    keeps = np.zeros(len(starts), dtype=bool)
    keeps[by_block[first]] = True
    new_ids = group_block.copy()
    new_ids[~keeps] = next_id + np.arange(int((~keeps).sum()))
    block[members] = new_ids[group]
    return members[~keeps[group]], next_id + int((~keeps).sum())


def refine_exactly(transitions: np.ndarray, block: np.ndarray) -> np.ndarray:
    """Moore's refinement with exact row comparisons: slow, used only after a hash collision
    (which would leave a partition coarser than the right one, never finer)."""
    count = 0
    while True:
        successors = np.where(transitions >= 0, block[transitions], -1)
        rows = np.concatenate([block[:, None], successors], axis=1)
        _, block = np.unique(rows, axis=0, return_inverse=True)
        block = block.reshape(-1)
        if int(block.max()) + 1 == count:
            return block
        count = int(block.max()) + 1


def is_stable(transitions, block, representative) -> bool:
    successors = np.where(transitions >= 0, block[transitions], -1)
    return bool((successors == successors[representative[block]]).all())


def minimize(transitions: np.ndarray, accepting: np.ndarray):
    """Moore's partition refinement by hashed successor blocks, re-examining only the
    predecessors of states that changed block in the last round. Returns (transitions,
    accepting) of the quotient automaton and each state's block."""
    num_states, num_classes = transitions.shape
    weights = np.random.default_rng(0).integers(1, 2**62, num_classes, dtype=np.uint64) * 2 + 1
    bounds, sources = predecessor_index(transitions)
    block = accepting.astype(np.int64)
    signature = successor_hashes(transitions, block, np.arange(num_states), weights)
    changed, next_id = split_blocks(block, signature, np.arange(num_states), 2)
    while changed.size:
        affected = predecessors_of(changed, bounds, sources)
        signature[affected] = successor_hashes(transitions, block, affected, weights)
        marked = np.zeros(next_id, dtype=bool)
        marked[block[affected]] = True
        members = np.nonzero(marked[block])[0]
        changed, next_id = split_blocks(block, signature, members, next_id)
    _, block = np.unique(block, return_inverse=True)
    block = block.reshape(-1)
    representative = np.zeros(int(block.max()) + 1, dtype=np.int64)
    representative[block] = np.arange(num_states)  # any member: they all behave alike
    if not is_stable(transitions, block, representative):
        block = refine_exactly(transitions, block)
        representative = np.zeros(int(block.max()) + 1, dtype=np.int64)
        representative[block] = np.arange(num_states)
    rows = transitions[representative]
    quotient = np.where(rows >= 0, block[rows], -1).astype(np.int32)
    return quotient, accepting[representative], block


def breadth_first_order(transitions: np.ndarray, start: int) -> np.ndarray:
    order, seen = [start], {start}
    rows = transitions.tolist()
    for state in order:
        for target in rows[state]:
            if target >= 0 and target not in seen:
                seen.add(target)
                order.append(target)
    return np.array(order, dtype=np.int64)


def merge_byte_classes(interval_of: np.ndarray, transitions: np.ndarray):
    """Bytes whose columns are identical share a class. Returns (byte_classes, table)."""
    columns, class_of_interval = np.unique(transitions.T, axis=0, return_inverse=True)
    byte_classes = class_of_interval.reshape(-1)[interval_of].astype(np.int32)
    return byte_classes, np.ascontiguousarray(columns.T, dtype=np.int32)


@dataclass(frozen=True, eq=False)
class ByteDFA:
    """A DFA over bytes: transitions[state, byte_classes[byte]] is the next state, -1 dead."""

    byte_classes: np.ndarray
    transitions: np.ndarray
    accepting: np.ndarray
    start: int = 0
    _rows: list = field(init=False, repr=False)
    _classes: list = field(init=False, repr=False)

    def __post_init__(self):
        if self.byte_classes.shape != (256,):
            raise ValueError(f"byte_classes must have shape (256,), got {self.byte_classes.shape}")
        if self.transitions.ndim != 2 or len(self.accepting) != len(self.transitions):
            raise ValueError("transitions must be (num_states, num_classes) and accepting "
                             "(num_states,)")
        if not 0 <= self.start < len(self.transitions):
            raise ValueError(f"start state {self.start} out of range")
        # Plain lists: walking token bytes indexes them far faster than numpy scalars.
        object.__setattr__(self, "_rows", self.transitions.tolist())
        object.__setattr__(self, "_classes", self.byte_classes.tolist())

    @property
    def num_states(self) -> int:
        return len(self._rows)

    def next_state(self, state: int, byte: int) -> int:
        if state < 0:
            return -1
        return self._rows[state][self._classes[byte]]

    def walk(self, state: int, data: bytes) -> int:
        rows, classes = self._rows, self._classes
        for byte in data:
            if state < 0:
                return -1
            state = rows[state][classes[byte]]
        return state

    def fullmatch(self, text: str | bytes) -> bool:
        if isinstance(text, str):
            try:
                text = text.encode("utf-8")
            except UnicodeEncodeError:  # lone surrogates have no UTF-8 form
                return False
        return self.is_accepting(self.walk(self.start, text))

    def is_accepting(self, state: int) -> bool:
        return state >= 0 and bool(self.accepting[state])

    def can_continue(self, state: int) -> bool:
        return state >= 0 and any(target >= 0 for target in self._rows[state])


def compile_regex(pattern: str, max_states: int = 20_000) -> ByteDFA:
    """The trimmed, minimised byte DFA of the strings that fully match pattern.

    Supports Python `re` syntax without backreferences, lookaround, inline flags and word
    boundaries; ValueError names anything else, an empty language, or a DFA that would
    exceed max_states states."""
    if max_states < 1:
        raise ValueError(f"max_states must be positive, got {max_states}")
    tree = parse_regex(pattern)
    nfa = _Nfa()
    final = nfa.new_state()
    try:
        start = nfa.build(tree, final)
    except RecursionError:
        raise ValueError(f"regex {shorten(pattern)} nests groups too deeply") from None
    interval_of, transitions, accepting = determinize(nfa, start, final, max_states)
    live = live_states(transitions, accepting)
    if not live[0]:
        raise ValueError(f"regex {shorten(pattern)} matches nothing")
    transitions, accepting = keep_states(transitions, live), accepting[live]
    transitions, accepting, block = minimize(transitions, accepting)
    order = breadth_first_order(transitions, int(block[0]))  # state 0 was the start
    position = np.empty(len(order) + 1, dtype=np.int32)
    position[order], position[-1] = np.arange(len(order)), -1
    transitions, accepting = position[transitions[order]], accepting[order]
    byte_classes, table = merge_byte_classes(interval_of, transitions)
    return ByteDFA(byte_classes, table, accepting, start=0)


# --- rewriting a regex without some characters ---

def code_point_escape(code: int) -> str:
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def set_to_regex(ranges) -> str:
    if not ranges:
        return "[^\\x00-\\U0010ffff]"  # matches nothing
    parts = [code_point_escape(lo) if lo == hi
             else f"{code_point_escape(lo)}-{code_point_escape(hi)}" for lo, hi in ranges]
    return "[" + "".join(parts) + "]"


def tree_to_regex(node) -> str:
    """Regex text for a syntax tree; every compound part is grouped with (?:...)."""
    kind = node[0]
    if kind == "set":
        return set_to_regex(node[1])
    if kind == "alt":
        return "(?:" + "|".join(tree_to_regex(branch) for branch in node[1]) + ")"
    if kind == "cat":
        return "(?:" + "".join(tree_to_regex(item) for item in node[1]) + ")"
    _, body, lo, hi = node
    bounds = f"{{{lo},}}" if hi is None else f"{{{lo},{hi}}}"
    return tree_to_regex(body) + bounds if body[0] == "set" else f"(?:{tree_to_regex(body)})" \
        + bounds


def remove_code_points(node, excluded):
    """The tree with the excluded code point ranges taken out of every character set."""
    kind = node[0]
    if kind == "set":
        return ("set", complement_ranges(complement_ranges(node[1]) + tuple(excluded)))
    if kind in ("alt", "cat"):
        return (kind, [remove_code_points(child, excluded) for child in node[1]])
    return ("rep", remove_code_points(node[1], excluded), node[2], node[3])


def restrict_regex(pattern: str, excluded) -> str:
    """A regex for the strings that fully match pattern and contain no code point of the
    excluded (lo, hi) ranges. Taking those code points out of every character set gives
    exactly that: a string avoids them if and only if each of its characters does."""
    return tree_to_regex(remove_code_points(parse_regex(pattern), excluded))
