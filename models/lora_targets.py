# SPDX-License-Identifier: Apache-2.0
"""PEFT's string `target_modules`: a regular expression that must match a module's whole path,
run here by a matcher whose time is linear in the path's length (a Thompson NFA simulation), so
that no pattern an adapter brings can stall the engine as a backtracking engine would on, say,
`(a+)+$`.

The syntax is the part of Python's `re` that names modules: literals, `.`, escapes (`\\d \\w \\s`,
their negations, an escaped punctuation character), classes (`[a-z_]`, `[^.]`), groups
(`(...)`, `(?:...)`), alternation, the quantifiers `* + ? {m} {m,} {m,n}` (a trailing `?`, lazy,
changes nothing for a whole-string match) and `^`/`$` at the pattern's ends. Anything else
(backreferences, lookarounds, flags, possessive quantifiers) is refused by name, as is a pattern
longer than `MAX_PATTERN_LENGTH` or one whose bounded repeats expand beyond `MAX_STATES`.
"""

from __future__ import annotations

import dataclasses

MAX_PATTERN_LENGTH = 1024
MAX_STATES = 20_000
_REPEAT_LIMIT = 100  # the largest m or n of `{m,n}`


class PatternError(ValueError):
    """A `target_modules` pattern this matcher does not run, with the reason."""


@dataclasses.dataclass(frozen=True)
class _Chars:
    """One position's set of characters: ranges and named classes (`d`, `w`, `s`, `.`), negated."""

    ranges: tuple[tuple[str, str], ...] = ()
    classes: tuple[str, ...] = ()
    negate: bool = False

    def __contains__(self, c: str) -> bool:
        hit = any(lo <= c <= hi for lo, hi in self.ranges) or any(_in_class(c, k) for k in self.classes)
        return hit != self.negate


def _in_class(c: str, kind: str) -> bool:
    if kind == ".":
        return c != "\n"
    if kind in "dD":
        return c.isdecimal() == (kind == "d")
    if kind in "wW":
        return (c.isalnum() or c == "_") == (kind == "w")
    return c.isspace() == (kind == "s")


# AST: ("chars", _Chars) | ("seq", [nodes]) | ("alt", [nodes]) | ("repeat", node, low, high|None)


class _Parser:
    def __init__(self, pattern: str):
        self.pattern = pattern
        self.i = 0

    def fail(self, what: str) -> PatternError:
        return PatternError(f"{what} at position {self.i} of target_modules pattern {self.pattern!r}")

    def peek(self) -> str | None:
        return self.pattern[self.i] if self.i < len(self.pattern) else None

    def take(self) -> str:
        c = self.pattern[self.i]
        self.i += 1
        return c

    def parse(self) -> tuple:
        node = self.alternation()
        if self.peek() is not None:
            raise self.fail("unbalanced ')'")
        return node

    def alternation(self) -> tuple:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.take()
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def sequence(self) -> tuple:
        items = []
        while self.peek() not in (None, "|", ")"):
            if self.peek() == "^" and self.i == 0:
                self.take()
                continue
            if self.peek() == "$" and self.i == len(self.pattern) - 1:
                self.take()
                continue
            items.append(self.quantified(self.atom()))
        return ("seq", items)

    def quantified(self, node: tuple) -> tuple:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.take()
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{" and self._is_repeat():
            low, high = self._repeat_bounds()
        else:
            return node
        if self.peek() == "?":  # lazy: the same strings match
            self.take()
        if self.peek() in ("*", "+", "?", "{"):
            raise self.fail("a quantifier after a quantifier (possessive or nested) is not supported")
        return ("repeat", node, low, high)

    def _is_repeat(self) -> bool:
        end = self.pattern.find("}", self.i)
        body = self.pattern[self.i + 1 : end] if end > 0 else ""
        return (
            bool(body) and all(part.isdigit() or part == "" for part in body.split(",", 1)) and body[0] != ","
        )

    def _repeat_bounds(self) -> tuple[int, int | None]:
        end = self.pattern.index("}", self.i)
        body = self.pattern[self.i + 1 : end]
        self.i = end + 1
        low_text, _, high_text = body.partition(",")
        low = int(low_text)
        high = low if "," not in body else (int(high_text) if high_text else None)
        if max(low, high or 0) > _REPEAT_LIMIT or (high is not None and high < low):
            raise self.fail(f"repeat {{{body}}} is not supported (bounds up to {_REPEAT_LIMIT}, m <= n)")
        return low, high

    def atom(self) -> tuple:
        c = self.take()
        if c == "(":
            if self.peek() == "?":
                if self.pattern.startswith("?:", self.i):
                    self.i += 2
                else:
                    raise self.fail("'(?' groups (lookarounds, flags, named groups) are not supported")
            node = self.alternation()
            if self.peek() != ")":
                raise self.fail("missing ')'")
            self.take()
            return node
        if c == "[":
            return ("chars", self.char_class())
        if c == ".":
            return ("chars", _Chars(classes=(".",)))
        if c == "\\":
            return ("chars", self.escape())
        if c in "*+?":
            raise self.fail(f"nothing to repeat before {c!r}")
        if c in "^$":
            raise self.fail(f"{c!r} is supported only at the pattern's ends")
        return ("chars", _Chars(ranges=((c, c),)))

    def escape(self) -> _Chars:
        if self.peek() is None:
            raise self.fail("a trailing backslash")
        c = self.take()
        if c in "dDwWsS":
            return _Chars(classes=(c,))
        if c.isalnum():
            raise self.fail(f"escape \\{c} is not supported (backreferences, anchors, ...)")
        return _Chars(ranges=((c, c),))

    def char_class(self) -> _Chars:
        negate = self.peek() == "^"
        if negate:
            self.take()
        ranges, classes = [], []
        first = True
        while True:
            c = self.peek()
            if c is None:
                raise self.fail("missing ']'")
            if c == "]" and not first:
                self.take()
                return _Chars(tuple(ranges), tuple(classes), negate)
            first = False
            self.take()
            if c == "\\":
                escaped = self.escape()
                classes += escaped.classes
                ranges += escaped.ranges
                continue
            if c == "[" and self.peek() in (":", "=", "."):
                raise self.fail("POSIX classes ([:alpha:]) are not supported")
            if self.peek() == "-" and self.pattern[self.i + 1 : self.i + 2] not in ("]", ""):
                self.take()
                high = self.take()
                if high == "\\":
                    raise self.fail("an escape as a range's end is not supported")
                if high < c:
                    raise self.fail(f"bad character range {c}-{high}")
                ranges.append((c, high))
            else:
                ranges.append((c, c))


class _Nfa:
    """Thompson's construction: state i is ("chars", _Chars, next) or ("split", a, b) or ("match",)."""

    def __init__(self) -> None:
        self.states: list[list] = []

    def add(self, *state) -> int:
        if len(self.states) >= MAX_STATES:
            raise PatternError(
                f"target_modules pattern expands to more than {MAX_STATES} states; simplify it"
            )
        self.states.append(list(state))
        return len(self.states) - 1

    def build(self, node: tuple, out: int) -> int:
        """States for `node` that continue to `out`; returns the entry state."""
        kind = node[0]
        if kind == "chars":
            return self.add("chars", node[1], out)
        if kind == "seq":
            for item in reversed(node[1]):
                out = self.build(item, out)
            return out
        if kind == "alt":
            entries = [self.build(branch, out) for branch in node[1]]
            entry = entries[-1]
            for other in reversed(entries[:-1]):
                entry = self.add("split", other, entry)
            return entry
        _, inner, low, high = node
        if high is None:  # inner{low,}: low copies then a loop
            loop = self.add("split", -1, out)
            self.states[loop][1] = self.build(inner, loop)
            entry = loop
        else:  # optional copies, innermost last
            entry = out
            for _ in range(high - low):
                entry = self.add("split", self.build(inner, entry), out)
                out = entry
        for _ in range(low):
            entry = self.build(inner, entry)
        return entry


@dataclasses.dataclass(frozen=True)
class TargetPattern:
    """A compiled `target_modules` pattern; `fullmatch(path)` in time linear in `len(path)`."""

    pattern: str
    states: tuple[tuple, ...]
    start: int

    def fullmatch(self, text: str) -> bool:
        current = self._closure({self.start})
        for c in text:
            step = {s[2] for s in (self.states[i] for i in current) if s[0] == "chars" and c in s[1]}
            if not step:
                return False
            current = self._closure(step)
        return any(self.states[i][0] == "match" for i in current)

    def _closure(self, states: set[int]) -> set[int]:
        seen, stack = set(states), list(states)
        while stack:
            state = self.states[stack.pop()]
            if state[0] == "split":
                for nxt in state[1:]:
                    if nxt not in seen:
                        seen.add(nxt)
                        stack.append(nxt)
        return seen


def compile_target_pattern(pattern: str) -> TargetPattern:
    """`pattern` compiled for `TargetPattern.fullmatch`; a PatternError names what is refused."""
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise PatternError(
            f"target_modules pattern is {len(pattern)} characters long; at most {MAX_PATTERN_LENGTH} are "
            "accepted (list the module names instead)"
        )
    tree = _Parser(pattern).parse()
    nfa = _Nfa()
    start = nfa.build(tree, nfa.add("match"))
    return TargetPattern(pattern, tuple(tuple(s) for s in nfa.states), start)
