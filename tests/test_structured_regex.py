"""compile_regex: byte DFAs that agree with Python's re.fullmatch, stay trimmed and minimal,
never accept invalid UTF-8, and refuse unsupported syntax by name."""

from __future__ import annotations

import random
import re
import time

import numpy as np
import pytest

from spindle.structured.regex_dfa import ByteDFA, compile_regex, refine_exactly, restrict_regex

# (pattern, alphabet the random strings are drawn from)
PATTERNS = [
    ("abc", "abcx"),
    ("a|b|c", "abcd"),
    ("a*", "ab"),
    ("a+b?", "ab"),
    ("(ab)*c", "abc"),
    ("(a|b)*abb", "ab"),
    ("[a-z]+", "az09A"),
    ("[^a-z]", "azA9é\n"),
    ("[^abc]*", "abcdé😀\n"),
    (".", "a\né😀\x00"),
    (".*x", "ax\n😀"),
    (r"\d{3}-\d{4}", "0123456789-a"),
    (r"\w+@\w+\.com", "ab_1@.com"),
    (r"\s*\S+\s*", " \ta\n\x0b\x0ceé"),
    (r"[\d\s]+", "1 a\t"),
    (r"[^\d\s]", "1 aé\t"),
    (r"\W+", "a !é_"),
    ("x{3}", "xy"),
    ("x{2,4}", "xy"),
    ("x{2,}", "x"),
    ("x{,3}", "x"),
    ("(ab){1,3}c?", "abc"),
    ("(a|)b", "ab"),
    ("(|a|bc)+d", "abcd"),
    ("((a|b)c)*|d", "abcd"),
    ("(?:ab|cd)(?P<name>e|f)?", "abcdef"),
    ("a*?b+?c??", "abc"),
    ("[]a]+", "]ab"),
    ("[-a]+", "-ab"),
    ("[a-]+", "-ab"),
    ("[^]a]", "]abé"),
    (r"[\]\-\\]+", "]-\\a"),
    ("é+ü?", "éüe"),
    ("[α-ω]+", "αβωa"),
    ("[^α-ω]", "αωa😀"),
    ("😀{2}|[😀-😃]", "😀😁😃😄"),
    (r"\u00e9\x41\t", "éA\ta"),
    (r"[\U0001F600-\U0001F64F]+", "😀🙏a"),
    ("a{1}b{0}c", "abc"),
    ("a{b|a{x}|a{}", "a{bx}"),
    ("^ab$", "ab"),
    ("[a-c]{0,30}d", "abcd"),
    ("(a(b(c|d)*)+)?e", "abcde"),
    (r"\.\*\+\?\(\)\[\]\{\}\|\^\$", ".*+?()[]{}|^$"),
    (r"[\x00-\x1f]+", "\x00\x1f a"),
    (r"\0\n", "\x00\na"),
    (r"[^\x00-\x7f]+", "aé😀"),
    ("(?#a comment)ab", "ab"),
    (r"[\s\S]{2}", "a\né"),
    (r"\N{GREEK SMALL LETTER ALPHA}+", "αa"),
]
HAND_PICKED = ["", "a", "ab", "abc", "abb", "aabb", "x", "xx", "xxx", "xxxx", "é", "😀😀",
               "abcabc", "\n", "123-4567", "ab_1@cd.com", "]", "-", "{", "a{b", "a{x}", "a{}"]
INVALID_UTF8 = [b"\x80", b"\xbf", b"\xc0\x80", b"\xc1\xbf", b"\xc3", b"\xe0\x80\x80",
                b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf0\x80\x80\x80", b"\xf4\x90\x80\x80",
                b"\xf5\x80\x80\x80", b"\xff", b"\xe2\x82", b"a\xc3(", b"\xf0\x9f\x98"]


def python_fullmatch(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text, re.ASCII) is not None


def random_strings(alphabet: str, rng: random.Random, count: int = 150) -> list[str]:
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
            for _ in range(count)]


def distances_to_accept(dfa: ByteDFA) -> np.ndarray:
    """Fewest bytes from each state to an accepting state (num_states + 1: unreachable)."""
    unreachable = dfa.num_states + 1
    distance = np.where(dfa.accepting, 0, unreachable)
    while True:
        successor = np.where(dfa.transitions >= 0, distance[dfa.transitions], unreachable)
        updated = np.minimum(distance, successor.min(axis=1) + 1)
        if (updated == distance).all():
            return distance
        distance = updated


def random_walk(dfa: ByteDFA, rng: random.Random, distance: np.ndarray,
                soft_limit: int = 60) -> bytes:
    """Random allowed bytes from the start; stops at random once accepting. Past soft_limit
    bytes it only takes bytes that bring an accepting state closer, so it always ends."""
    state, produced = dfa.start, bytearray()
    while True:
        if dfa.is_accepting(state) and (rng.random() < 0.25 or len(produced) >= soft_limit
                                        or not dfa.can_continue(state)):
            return bytes(produced)
        allowed = [byte for byte in range(256) if dfa.next_state(state, byte) >= 0]
        if len(produced) >= soft_limit:
            allowed = [byte for byte in allowed
                       if distance[dfa.next_state(state, byte)] < distance[state]]
        byte = rng.choice(allowed)
        produced.append(byte)
        state = dfa.next_state(state, byte)


@pytest.fixture(scope="module")
def compiled() -> dict[str, ByteDFA]:
    return {pattern: compile_regex(pattern) for pattern, _ in PATTERNS}


@pytest.mark.parametrize("pattern,alphabet", PATTERNS, ids=[p for p, _ in PATTERNS])
def test_agrees_with_python_re(compiled, pattern, alphabet):
    dfa = compiled[pattern]
    rng = random.Random(pattern)
    for text in HAND_PICKED + random_strings(alphabet, rng):
        assert dfa.fullmatch(text) == python_fullmatch(pattern, text), (pattern, text)
        assert dfa.fullmatch(text.encode()) == python_fullmatch(pattern, text)


@pytest.mark.parametrize("pattern", [p for p, _ in PATTERNS])
def test_random_walks_produce_matching_utf8(compiled, pattern):
    dfa = compiled[pattern]
    rng, distance = random.Random(pattern), distances_to_accept(dfa)
    for _ in range(25):
        text = random_walk(dfa, rng, distance).decode("utf-8")  # strict: raises if invalid
        assert python_fullmatch(pattern, text), (pattern, text)


def test_trimmed_and_minimal(compiled):
    for pattern, dfa in compiled.items():
        assert dfa.start == 0 and dfa.transitions.dtype == np.int32
        assert dfa.byte_classes.shape == (256,) and dfa.byte_classes.dtype == np.int32
        reached, frontier = {dfa.start}, [dfa.start]
        while frontier:
            following = {int(t) for t in dfa.transitions[frontier].ravel() if t >= 0}
            frontier = list(following - reached)
            reached |= following
        assert reached == set(range(dfa.num_states)), pattern
        assert (distances_to_accept(dfa) <= dfa.num_states).all(), pattern
        blocks = refine_exactly(dfa.transitions, dfa.accepting.astype(np.int64))
        assert int(blocks.max()) + 1 == dfa.num_states, pattern


@pytest.mark.parametrize("pattern", [".*", "[^a]*", r"[\s\S]*", "[^\"]{0,3}", r"\W*"])
def test_invalid_utf8_never_accepted(pattern):
    dfa = compile_regex(pattern)
    for data in INVALID_UTF8:
        state = dfa.walk(dfa.start, data)
        assert not dfa.is_accepting(state), (pattern, data)
        assert dfa.walk(dfa.start, data + b"a") == -1, (pattern, data)


def count_accepted(dfa: ByteDFA, length: int) -> int:
    """How many byte strings of exactly this length the DFA accepts."""
    class_sizes = np.bincount(dfa.byte_classes, minlength=dfa.transitions.shape[1])
    ways = np.zeros(dfa.num_states, dtype=np.int64)
    ways[dfa.start] = 1
    for _ in range(length):
        following = np.zeros_like(ways)
        for state, row in enumerate(dfa.transitions):
            live = row >= 0
            np.add.at(following, row[live], ways[state] * class_sizes[live])
        ways = following
    return int(ways[dfa.accepting].sum())


def test_dot_accepts_exactly_the_utf8_encodings_of_code_points():
    dfa = compile_regex(".")
    surrogates = 0xE000 - 0xD800
    assert count_accepted(dfa, 1) == 127  # all ASCII but '\n'
    assert count_accepted(dfa, 2) == 0x800 - 0x80
    assert count_accepted(dfa, 3) == 0x10000 - 0x800 - surrogates
    assert count_accepted(dfa, 4) == 0x110000 - 0x10000
    for first in range(256):
        for second in range(256):
            data = bytes([first, second])
            try:
                valid = len(data.decode("utf-8")) == 1
            except UnicodeDecodeError:
                valid = False
            assert dfa.fullmatch(data) == valid, data


def test_dfa_methods():
    dfa = compile_regex("ab*c")
    assert dfa.next_state(-1, ord("a")) == -1
    after_a = dfa.next_state(dfa.start, ord("a"))
    assert after_a >= 0 and not dfa.is_accepting(after_a) and dfa.can_continue(after_a)
    assert dfa.next_state(dfa.start, ord("b")) == -1
    assert dfa.walk(dfa.start, b"abbb") >= 0
    assert dfa.walk(dfa.start, b"ax" + b"c" * 5) == -1
    assert dfa.walk(-1, b"") == -1
    end = dfa.walk(dfa.start, b"abc")
    assert dfa.is_accepting(end) and not dfa.can_continue(end)
    assert not dfa.is_accepting(-1) and not dfa.can_continue(-1)
    assert dfa.fullmatch("abbc") and dfa.fullmatch(b"ac") and not dfa.fullmatch("ab")
    assert not dfa.fullmatch("a\ud800c")  # a lone surrogate has no UTF-8 form


def test_large_counted_repetition_compiles_quickly():
    started = time.perf_counter()
    dfa = compile_regex("[a-z]{0,500}")
    string_dfa = compile_regex(r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4}){0,200}"')
    assert time.perf_counter() - started < 10
    assert dfa.num_states == 501
    assert dfa.fullmatch("a" * 500) and not dfa.fullmatch("a" * 501)
    assert string_dfa.fullmatch('"' + "é" * 200 + '"')
    assert not string_dfa.fullmatch('"' + "é" * 201 + '"')


ERRORS = [
    (r"(a)\1", "backreference"),
    ("(?P<n>a)(?P=n)", "backreference"),
    ("(?=a)a", "lookahead"),
    ("(?!a)b", "negative lookahead"),
    ("(?<=a)b", "lookbehind"),
    ("(?<!a)b", "negative lookbehind"),
    ("(?>a)", "atomic group"),
    ("(?i)a", "inline flag"),
    ("(?i:a)", "inline flag"),
    (r"\bword", "word boundary"),
    (r"a\Bb", "non-word boundary"),
    (r"\Aa", "start-of-string anchor"),
    (r"a\Z", "end-of-string anchor"),
    ("a*+", "possessive"),
    ("a{2}+", "possessive"),
    ("(ab", "missing ')'"),
    ("ab)", "unbalanced parenthesis"),
    ("*a", "nothing to repeat"),
    ("a|+b", "nothing to repeat"),
    ("(?:{2})", "nothing to repeat"),
    ("a{3,2}", "min greater than max"),
    ("a**", "multiple repeat"),
    ("a{2}{3}", "multiple repeat"),
    ("[abc", "unterminated character class"),
    ("[z-a]", "bad character range"),
    (r"[a-\d]", "bad character range"),
    (r"\q", "bad escape"),
    (r"\x4", "hex digits"),
    ("a\\", "trailing backslash"),
    ("a^b", "'^' anchor"),
    ("a$b", "'$' anchor"),
    ("(?P<1>a)", "group name"),
]


@pytest.mark.parametrize("pattern,construct", ERRORS, ids=[p for p, _ in ERRORS])
def test_unsupported_syntax_is_named(pattern, construct):
    with pytest.raises(ValueError, match=re.escape(construct)) as caught:
        compile_regex(pattern)
    assert "position" in str(caught.value)


def test_error_names_the_position():
    with pytest.raises(ValueError, match="lookahead.*position 2"):
        compile_regex("ab(?=c)")


@pytest.mark.parametrize("pattern", ["[^\\x00-\\U0010ffff]", r"a[^\s\S]b", "\ud800"])
def test_empty_language_is_refused(pattern):
    with pytest.raises(ValueError, match="matches nothing"):
        compile_regex(pattern)


def test_max_states_limit():
    with pytest.raises(ValueError, match="max_states=50"):
        compile_regex("[a-z]{0,100}", max_states=50)
    assert compile_regex("[a-z]{0,100}", max_states=200).num_states == 101


def test_restrict_regex_removes_characters_everywhere():
    excluded = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
    dfa = compile_regex(restrict_regex(r"^.+@(a|[^x]{2,})\W?$", excluded))
    assert dfa.fullmatch("é@a") and dfa.fullmatch("x@yy!") and dfa.fullmatch("1@aa")
    for text in ['"@a', "x@a\\", "x@\tb", "x@a\x01", "x@xx", "@a"]:
        assert not dfa.fullmatch(text), text
