"""PEFT's rank_pattern / alpha_pattern lookup without Python's backtracking ``re``.

PEFT (``peft.utils.other.get_pattern_key``) gives a module the value of the first key, in the
config's order, for which ``re.match(rf"(.*\\.)?({key})$", module)`` matches: a key is a module-name
suffix (``q_proj``, ``layers.3.mlp.down_proj``, ``model.layers.0.self_attn.q_proj``) or a regular
expression. A key such as ``(.|.)*X`` makes ``re`` backtrack for hours with the GIL held, so keys are
parsed here into the regular subset of ``re``'s syntax (literals, ``.``, escapes, classes, groups,
alternation, ``* + ? {m,n}``, ``^``, ``$``) and run as an automaton, whose cost is linear in the
module name whatever the key; what is not regular (backreferences, lookaround, flags, possessive
quantifiers) and keys past the limits below are refused with a PatternError that says why.
"""
from __future__ import annotations

from typing import Callable

MAX_KEYS = 1024               # keys in one pattern table (PEFT's EVA writes one per module)
MAX_KEY_CHARS = 256
MAX_REPEAT = 64               # the largest count of a {m,n}
MAX_PROGRAM = 1024            # automaton instructions per key
MAX_DEPTH = 32                # nested groups
MAX_WORK = 2_000_000          # instruction visits per table before it is refused as too costly

_META = set("^$*+?{}[]\\|()")     # a key with none of these is a plain suffix ('.' is any character)
_CLASSES: dict[str, Callable[[str], bool]] = {
    "d": str.isdecimal, "w": lambda c: c.isalnum() or c == "_", "s": str.isspace,
    "D": lambda c: not c.isdecimal(), "W": lambda c: not (c.isalnum() or c == "_"), "S": lambda c: not c.isspace(),
}


class PatternError(ValueError):
    """A rank_pattern / alpha_pattern key this matcher cannot take; the message says why."""


# ---- parsing: key -> tree of ("char", test) | ("cat", [..]) | ("alt", [..]) | ("rep", node, lo, hi) | ("bol",) | ("eol",)

class _Parser:
    def __init__(self, key: str):
        self.key, self.i, self.depth = key, 0, 0

    def fail(self, why: str) -> PatternError:
        return PatternError(f"key {self.key!r}: {why} (at character {self.i})")

    def peek(self) -> str | None:
        return self.key[self.i] if self.i < len(self.key) else None

    def take(self) -> str:
        c = self.key[self.i]
        self.i += 1
        return c

    def parse(self):
        node = self.alternation()
        if self.i != len(self.key):
            raise self.fail("unbalanced ')'")
        return node

    def alternation(self):
        branches = [self.sequence()]
        while self.peek() == "|":
            self.take()
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def sequence(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            items.append(self.repeat(self.atom()))
        return ("cat", items)

    def repeat(self, node):
        c = self.peek()
        if c in ("*", "+", "?"):
            self.take()
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{":
            lo, hi = self.braces()
        else:
            return node
        if node[0] in ("bol", "eol"):
            raise self.fail("nothing to repeat")
        if self.peek() == "?":          # lazy: the same strings match
            self.take()
        if self.peek() in ("*", "+", "{"):
            raise self.fail("possessive or repeated quantifiers are not supported")
        return ("rep", node, lo, hi)

    def braces(self) -> tuple[int, int | None]:
        self.take()
        end = self.key.find("}", self.i)
        body = self.key[self.i:end] if end >= 0 else ""
        lo_text, comma, hi_text = body.partition(",")
        if end < 0 or not all(t == "" or (t.isascii() and t.isdigit()) for t in (lo_text, hi_text)) \
                or (not comma and not lo_text):
            raise self.fail("'{' that is not a {m,n} quantifier")
        if len(lo_text) > 3 or len(hi_text) > 3:
            raise self.fail(f"repeat counts above {MAX_REPEAT} are not supported")
        lo = int(lo_text) if lo_text else 0
        hi = (int(hi_text) if hi_text else None) if comma else lo
        if max(lo, hi or 0) > MAX_REPEAT:
            raise self.fail(f"repeat counts above {MAX_REPEAT} are not supported")
        if hi is not None and hi < lo:
            raise self.fail("{m,n} with n < m")
        self.i = end + 1
        return lo, hi

    def atom(self):
        c = self.take()
        if c == "(":
            if self.peek() == "?":
                if self.key.startswith("?:", self.i):
                    self.i += 2
                elif self.key.startswith("?P<", self.i) and ">" in self.key[self.i:]:
                    self.i = self.key.index(">", self.i) + 1
                else:
                    raise self.fail("lookaround, backreferences and inline flags are not supported")
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise self.fail(f"groups nested more than {MAX_DEPTH} deep")
            node = self.alternation()
            if self.peek() != ")":
                raise self.fail("missing ')'")
            self.take()
            self.depth -= 1
            return node
        if c in ("*", "+", "?", "{"):
            raise self.fail("nothing to repeat")
        if c == ".":
            return ("char", lambda ch: ch != "\n")
        if c == "^":
            return ("bol",)
        if c == "$":
            return ("eol",)
        if c == "[":
            return ("char", self.char_class())
        if c == "\\":
            return ("char", self.escape())
        return ("char", c.__eq__)

    def escape(self) -> Callable[[str], bool]:
        if self.peek() is None:
            raise self.fail("a trailing backslash")
        c = self.take()
        if c in _CLASSES:
            return _CLASSES[c]
        if c.isalnum():
            raise self.fail(f"the escape \\{c} is not supported")
        return c.__eq__

    def char_class(self) -> Callable[[str], bool]:
        negate = self.peek() == "^"
        if negate:
            self.take()
        ranges: list[tuple[str, str]] = []
        tests: list[Callable[[str], bool]] = []
        first = True
        while True:
            c = self.peek()
            if c is None:
                raise self.fail("missing ']'")
            if c == "]" and not first:
                self.take()
                break
            first = False
            self.take()
            if c == "\\":
                test = self.escape()
                if test in _CLASSES.values():
                    tests.append(test)
                    continue
                c = self.key[self.i - 1]
            if self.peek() == "-" and self.key[self.i + 1:self.i + 2] not in ("", "]"):
                self.take()
                hi = self.take()
                if hi == "\\":
                    test = self.escape()
                    if test in _CLASSES.values():
                        raise self.fail("a range that ends in a class")
                    hi = self.key[self.i - 1]
                if hi < c:
                    raise self.fail(f"the range {c}-{hi} is reversed")
                ranges.append((c, hi))
            else:
                ranges.append((c, c))

        def member(ch: str) -> bool:
            return (any(lo <= ch <= hi for lo, hi in ranges) or any(t(ch) for t in tests)) != negate
        return member


# ---- the automaton: instructions ("char", test), ("split", a, b), ("jmp", a), ("bol",), ("eol",), ("match",)

def _compile(node, program: list, key: str) -> None:
    kind = node[0]
    if len(program) > MAX_PROGRAM:
        raise PatternError(f"key {key!r} is too large to match (more than {MAX_PROGRAM} instructions)")
    if kind in ("char", "bol", "eol"):
        program.append(node)
    elif kind == "cat":
        for item in node[1]:
            _compile(item, program, key)
    elif kind == "alt":
        jumps = []
        for branch in node[1][:-1]:
            split = len(program)
            program.append(None)
            _compile(branch, program, key)
            jumps.append(len(program))
            program.append(None)
            program[split] = ("split", split + 1, len(program))
        _compile(node[1][-1], program, key)
        for j in jumps:
            program[j] = ("jmp", len(program))
    else:                           # ("rep", node, lo, hi)
        _, body, lo, hi = node
        for _ in range(lo):
            _compile(body, program, key)
        if hi is None:              # body*: split -> body -> jmp back
            split = len(program)
            program.append(None)
            _compile(body, program, key)
            program.append(("jmp", split))
            program[split] = ("split", split + 1, len(program))
        else:                       # (body (body ...)?)? up to hi - lo times
            splits = []
            for _ in range(hi - lo):
                splits.append(len(program))
                program.append(None)
                _compile(body, program, key)
            for s in splits:
                program[s] = ("split", s + 1, len(program))


class _Automaton:
    """One key as PEFT matches it, ``(.*\\.)?(key)$`` from the name's start, run as a DFA built
    lazily from the instructions (a state is the set of instructions the threads are at)."""

    def __init__(self, key: str, table: PatternTable):
        tree = _Parser(key).parse()
        prefix = ("rep", ("cat", [("rep", ("char", lambda ch: ch != "\n"), 0, None), ("char", ".".__eq__)]), 0, 1)
        program: list = []
        _compile(("cat", [prefix, tree, ("eol",)]), program, key)
        program.append(("match",))
        self.program, self.table, self.key = program, table, key
        self.steps: dict[tuple[frozenset, str], frozenset] = {}

    def closure(self, pcs, at_start: bool, at_end: bool) -> frozenset:
        """The instructions reachable from ``pcs`` without reading a character: chars, matches and
        the '$' not passed yet (they pass at the name's end)."""
        out, todo = set(), list(pcs)
        while todo:
            pc = todo.pop()
            if pc in out:
                continue
            out.add(pc)
            op = self.program[pc]
            self.table.spend(1, self.key)
            if op[0] == "jmp":
                todo.append(op[1])
            elif op[0] == "split":
                todo += [op[1], op[2]]
            elif (op[0] == "bol" and at_start) or (op[0] == "eol" and at_end):
                todo.append(pc + 1)
        return frozenset(pc for pc in out if self.program[pc][0] in ("char", "match", "eol"))

    def matches(self, name: str) -> bool:
        state = self.closure([0], True, not name)
        for ch in name:
            if not state:
                return False
            step = self.steps.get((state, ch))
            if step is None:
                self.table.spend(len(state), self.key)
                step = self.closure([pc + 1 for pc in state if self.program[pc][0] == "char"
                                     and self.program[pc][1](ch)], False, False)
                self.steps[(state, ch)] = step
            state = step
        self.table.spend(1, self.key)
        return any(self.program[pc][0] == "match" for pc in self.closure(state, not name, True))


class PatternTable:
    """A rank_pattern or alpha_pattern: ``lookup(module, default)`` as PEFT resolves it."""

    def __init__(self, patterns: dict[str, object], what: str):
        if len(patterns) > MAX_KEYS:
            raise PatternError(f"{what} has {len(patterns)} keys; at most {MAX_KEYS} are supported")
        self.what, self.values, self.work = what, list(patterns.values()), 0
        self.plain: dict[tuple[int, tuple[int, ...]], dict[str, int]] = {}   # (length, '.' positions) -> key -> index
        self.regex: list[tuple[int, _Automaton]] = []
        for index, key in enumerate(patterns):
            if len(key) > MAX_KEY_CHARS:
                raise PatternError(f"{what} key {key[:40]!r}... is {len(key)} characters; at most {MAX_KEY_CHARS}")
            if _META.isdisjoint(key):
                dots = tuple(i for i, c in enumerate(key) if c == ".")
                self.plain.setdefault((len(key), dots), {}).setdefault(key, index)
            else:
                try:
                    self.regex.append((index, _Automaton(key, self)))
                except PatternError as e:
                    raise PatternError(f"{what} {e}") from None

    def spend(self, work: int, key: str) -> None:
        self.work += work
        if self.work > MAX_WORK:
            raise PatternError(f"{self.what} key {key[:40]!r} is too costly to match against the model's modules")

    def lookup(self, module: str, default):
        """The value of the first key that matches ``module``, else ``default``."""
        first = len(self.values)
        # a plain key matches where it equals a suffix that starts the name or follows a '.', its
        # '.'s matching any character: mask the suffix's characters at the key's '.' positions
        starts = [0] + [i + 1 for i, c in enumerate(module) if c == "."]
        for (length, dots), keys in self.plain.items():
            for s in starts:
                suffix = module[s:]
                if len(suffix) == length and "\n" not in suffix:
                    masked = list(suffix)
                    for d in dots:
                        masked[d] = "."
                    first = min(first, keys.get("".join(masked), first))
        for index, automaton in self.regex:
            if index >= first:
                break
            if automaton.matches(module):
                first = index
                break
        return self.values[first] if first < len(self.values) else default
