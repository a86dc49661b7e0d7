"""Exact values of short math answers, and the worker process that computes them under a budget.

A small recursive-descent parser (numbers, + − × ÷ ^, parentheses, ``\\frac``, ``\\sqrt``, π)
builds sympy numbers directly (no ``eval``, no ``sympify`` of text); ``grade_values`` compares
two answers' values. Model output is data, possibly adversarial: the parser counts its steps and
bounds the height of what it builds, and the symbolic test bounds what it expands (the limits
below, all counted in work, so a verdict never depends on the machine's load). sympy's own
algorithms still run in C-speed loops that no counter sees, so the verifier never calls them in
its own process: ``serve`` runs this file as a separate worker (``python math_value.py --serve``,
``pdm_lab.scaling.math_worker`` starts and kills it) with a CPU-time and an address-space limit
as a safety net.

This module imports only the standard library and sympy: the worker runs it by path, without
``pdm_lab`` (and torch) in its memory.
One module of ~440 lines on purpose: the worker runs this one file by path, so the parser, the
grader and the serve loop cannot be split into package modules it would then have to import.
"""
from __future__ import annotations

import json
import math
import re
import sys

import sympy

# ---------------------------------------------------------------------------- budget

#: Limits per grading, all counted in work, never in time: a verdict is a function of the two
#: answers alone, the same on an idle and on a loaded machine. A completion is data from a model,
#: possibly adversarial, and one stalled verifier call stalls its rank and, through the
#: collectives, every rank.
MAX_ANSWER_CHARS = 512
"""Extracted answers longer than this are unparseable (a real final answer is short)."""
MAX_TOKENS = 200
"""Tokens in one parsed answer."""
MAX_OPS = 4 * MAX_TOKENS
"""Parser steps per answer (each token is taken once; the bound leaves room for \\frac12)."""
MAX_BITS = 4096
"""Cap on the height of every value the parser keeps (``_height``: the bits of its rationals, a
power's exponent times its base's height; about 1233 digits); a power is refused *before* it is
computed if its result would exceed it, so no intermediate ever exceeds 2·MAX_BITS."""
MAX_DEPTH = 32
"""Nesting depth of groups (parentheses, braces, fractions, roots)."""
MAX_ROOT = 64
"""Largest root index / exponent denominator: ``\\sqrt[n]{x}`` and ``x^{p/q}`` need n, q ≤ this."""
MAX_EXPAND_TERMS = 2048
"""Terms the symbolic zero test may expand the difference into (``_terms``: an upper bound
computed before expanding); beyond it equality is decided numerically."""
SAFETY_S = 20.0
"""Wall-clock seconds after which the worker is stopped (its CPU limit, the parent's kill): a
safety net for a sympy algorithm the work counts above missed, not the budget; a grading that
reaches it is "unparseable" and counted (``math_worker.WorkerCounts``)."""


class _ParseError(ValueError):
    pass


class _Budget:
    """Counts parser steps (``ops``, at most ``max_ops``) and caps every value's height at
    ``bits``; ``max_bits`` records the largest integer built (for tests bounding the worst case)."""

    def __init__(self, *, max_ops: int = MAX_OPS, bits: int = MAX_BITS):
        self.max_ops = max_ops
        self.bits = bits
        self.ops = 0
        self.max_bits = 0

    def tick(self) -> None:
        self.ops += 1
        if self.ops > self.max_ops:
            raise _ParseError("work budget exceeded")

    def check(self, value: sympy.Expr) -> sympy.Expr:
        """Refuse a value whose height (``_height``) exceeds the cap."""
        if isinstance(value, sympy.Rational):
            bits = max(int(value.p).bit_length(), int(value.q).bit_length())
            self.max_bits = max(self.max_bits, bits)
            if bits > self.bits:
                raise _ParseError("number too large")
        elif value.is_number and _height(value) > self.bits:
            raise _ParseError("number too large")
        return value


def _height(e: sympy.Expr) -> int:
    """An upper bound on the bits needed to write `e` out: a rational's bit length, 2 for π, a sum
    or product the sum of its parts' (+1 per term), a power p/q the base's times |p| (the exponent
    is no number the value holds). (√2 + 1)^4096 is 16384: refused, where counting the atoms'
    bits (2 and 4096) let it through to sympy's minimal_polynomial for minutes."""
    if isinstance(e, sympy.Rational):
        return max(int(e.p).bit_length(), int(e.q).bit_length(), 1)
    if e.is_Atom:
        return 2
    if isinstance(e, sympy.Pow) and isinstance(e.exp, sympy.Rational):
        return abs(int(e.exp.p)) * _height(e.base)
    return sum(_height(arg) for arg in e.args) + (len(e.args) if isinstance(e, sympy.Add) else 0)


def _terms(e: sympy.Expr) -> int:
    """An upper bound on the terms of ``sympy.expand(e)``, computed without expanding: a sum adds
    its parts', a product multiplies them, an integer power n of t terms gives C(n + t − 1, t − 1);
    a root counts its radicand's."""
    if isinstance(e, sympy.Add):
        return sum(_terms(arg) for arg in e.args)
    if isinstance(e, sympy.Mul):
        return math.prod(_terms(arg) for arg in e.args)
    if isinstance(e, sympy.Pow):
        t = _terms(e.base)
        exp = e.exp
        if isinstance(exp, sympy.Integer) and t > 1:
            return math.comb(abs(int(exp)) + t - 1, t - 1)
        return t
    return 1


# ---------------------------------------------------------------------------- safe value parser

# ASCII digits only: Python's \d and str.isdigit also take '٣' and '１２３', which are not numbers
_DIGITS_ASCII = "0123456789"
_TOKEN = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?[eE][-+]?[0-9]+|\.[0-9]+[eE][-+]?[0-9]+|[0-9]+\.[0-9]*|\.[0-9]+"
                    r"|[0-9]+|\\frac|\\sqrt|\\pi|\\cdot|\\times|\\div|[-+*/^(){}\[\]]|pi)", re.ASCII)
_SCI = re.compile(r"([0-9.]+)[eE]([-+]?[0-9]+)", re.ASCII)


def _is_number_token(tok: str) -> bool:
    return tok[0] in _DIGITS_ASCII or tok[0] == "."


def _rational(tok: str) -> sympy.Rational:
    """A decimal or scientific literal as an exact rational, its size bounded *before* it is built."""
    m = _SCI.fullmatch(tok)
    if m is None:
        if len(tok) > MAX_BITS // 3:
            raise _ParseError("number too long")
        return sympy.Rational(tok)
    mantissa, exp = m.group(1), int(m.group(2))
    if abs(exp) * 3.33 + len(mantissa) * 3.33 > MAX_BITS:  # 10^exp needs ~3.32·exp bits
        raise _ParseError("number too large")
    return sympy.Rational(mantissa) * sympy.Integer(10) ** exp


class _Parser:
    """expr := term (('+'|'-') term)*; term := factor (('*'|'/'|implicit) factor)*;
    factor := ('+'|'-') factor | power; power := atom ('^' factor)?;
    atom := number | π | '(' expr ')' | '{' expr '}' | \\frac{expr}{expr} | \\sqrt[n]{expr}.

    Every value built passes ``_Budget.check`` (bit-length caps); a power is computed only when
    its result fits (exponent bounded by the *result's* size, not by a fixed constant).
    """

    def __init__(self, text: str, budget: _Budget):
        self.budget = budget
        self.toks: list[str] = []
        pos = 0
        text = text.strip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m or m.end() == pos:
                raise _ParseError(f"unexpected {text[pos:pos + 10]!r}")
            self.toks.append(m.group(1))
            pos = m.end()
            if len(self.toks) > MAX_TOKENS:
                raise _ParseError("too long")
        self.i = 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, want: str | None = None) -> str:
        self.budget.tick()
        tok = self.peek()
        if tok is None or (want is not None and tok != want):
            raise _ParseError(f"expected {want!r}, got {tok!r}")
        self.i += 1
        return tok

    def parse(self) -> sympy.Expr:
        value = self.expr()
        if self.peek() is not None:
            raise _ParseError(f"trailing {self.peek()!r}")
        return value

    def expr(self) -> sympy.Expr:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term()
            value = self.budget.check(value + rhs if op == "+" else value - rhs)
        return value

    def term(self) -> sympy.Expr:
        value = self.factor()
        while True:
            tok = self.peek()
            if tok in ("*", "\\cdot", "\\times", "/", "\\div"):
                self.take()
                rhs = self.factor()
                if tok in ("/", "\\div"):
                    if rhs == 0:
                        raise _ParseError("division by zero")
                    value = value / rhs
                else:
                    value = value * rhs
            elif tok is not None and (_is_number_token(tok) or tok in ("(", "\\frac", "\\sqrt", "\\pi", "pi")):
                value = value * self.factor()  # implicit product: 2\pi, 3\sqrt{2}
            else:
                return value
            self.budget.check(value)

    def factor(self) -> sympy.Expr:
        if self.peek() in ("+", "-"):
            sign = self.take()
            value = self.factor()
            return -value if sign == "-" else value
        return self.power()

    def power(self) -> sympy.Expr:
        base = self.atom()
        if self.peek() == "^":
            self.take()
            return self._pow(base, self.factor())
        return base

    def _pow(self, base: sympy.Expr, exp: sympy.Expr) -> sympy.Expr:
        """base^exp for a rational exponent p/q (q ≤ MAX_ROOT) whose result fits the bit cap."""
        if not isinstance(exp, sympy.Rational) or exp.q > MAX_ROOT:
            raise _ParseError("exponent must be a rational p/q with a small q")
        if base == 0 and exp < 0:
            raise _ParseError("division by zero")
        if base == 0 and exp == 0:
            return sympy.Integer(1)  # the convention 0^0 = 1 (``grade_values``)
        # the result's height is at most |p| × the base's (sympy folds (√n)^p into n^{p/2})
        if abs(int(exp.p)) * _height(base) > self.budget.bits:  # refuse before computing it
            raise _ParseError("power too large")
        return self.budget.check(base ** exp)

    def atom(self) -> sympy.Expr:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _ParseError("nested too deeply")
        try:
            return self._atom()
        finally:
            self.depth -= 1

    def _atom(self) -> sympy.Expr:
        tok = self.take()
        if _is_number_token(tok):
            return self.budget.check(_rational(tok))
        if tok in ("\\pi", "pi"):
            return sympy.pi
        if tok in ("(", "{"):
            value = self.expr()
            self.take(")" if tok == "(" else "}")
            return value
        if tok == "\\frac":
            num = self._group()
            den = self._group()
            if den == 0:
                raise _ParseError("division by zero")
            return self.budget.check(num / den)
        if tok == "\\sqrt":
            index = sympy.Integer(2)
            if self.peek() == "[":
                self.take("[")
                index = self.expr()
                self.take("]")
            if not (isinstance(index, sympy.Integer) and 1 <= index <= MAX_ROOT):
                raise _ParseError(f"root index must be an integer in [1, {MAX_ROOT}]")
            return self._pow(self._group(), sympy.Rational(1, int(index)))
        raise _ParseError(f"unexpected {tok!r}")

    def _group(self) -> sympy.Expr:
        # \frac12 (single-digit shorthand) or \frac{..}{..}
        if self.peek() == "{":
            self.take("{")
            value = self.expr()
            self.take("}")
            return value
        tok = self.take()
        if tok.isascii() and tok.isdigit():
            if len(tok) > 1:  # \frac12: the first digit is the group, the rest stays in the stream
                self.toks.insert(self.i, tok[1:])
            return sympy.Integer(tok[0])
        raise _ParseError(f"expected a group, got {tok!r}")


def parse_value(s: str, budget: _Budget | None = None) -> sympy.Expr | None:
    """Exact value of a simple numeric expression (LaTeX or plain, ASCII digits), or None if
    unparseable (not one, too long, too large, or past the budget's deadline).

    Every step is counted (``_Budget``): the result is the same whatever the machine's load."""
    if len(s) > MAX_ANSWER_CHARS:
        return None
    budget = budget or _Budget()
    try:
        value = _Parser(s, budget).parse()
    except (_ParseError, ValueError, TypeError, ZeroDivisionError, OverflowError, RecursionError):
        return None
    return value if value.is_number else None


#: Relative tolerance for irrational values the symbolic test leaves undecided, compared at
#: ``_DIGITS`` significant digits. Tight on purpose: with roots limited to index ≤ MAX_ROOT,
#: distinct answers differ far above it, and a loose 1e-9 made ``\\sqrt[10^{64}]{2}`` equal to 1.
_DIGITS = 60
_REL_TOL = 1e-40


def _is_zero(d: sympy.Expr, terms: int = MAX_EXPAND_TERMS) -> bool | None:
    """Whether `d` is symbolically 0: True when it is 0 after expanding, then with its
    denominators rationalised and its nested radicals denested (``radsimp``: at most 4 radicals
    per denominator; ``sqrtdenest``: 3 passes); False when one of those forms is a nonzero
    rational; None (undecided) otherwise, or when ``_terms`` says an expansion would exceed
    `terms`."""
    for rewrite in (lambda e: e, sympy.expand, lambda e: sympy.expand(sympy.radsimp(e)),
                    lambda e: sympy.expand(sympy.radsimp(sympy.sqrtdenest(e)))):
        if _terms(d) > terms:
            return None
        e = rewrite(d)
        if e == 0:
            return True
        if isinstance(e, sympy.Rational):
            return False
    return None


def grade_values(a: str, b: str, *, max_ops: int = MAX_OPS, bits: int = MAX_BITS,
                 terms: int = MAX_EXPAND_TERMS) -> str:
    """``"equal"``, ``"unequal"`` or ``"unparseable"`` for two normalised answers.

    Rationals are compared exactly. Otherwise equality is decided symbolically where sympy can:
    the difference is zero after expanding, rationalising and denesting (``_is_zero``:
    ``(1+\\sqrt{2})^{2}-(3+2\\sqrt{2})`` is 0), or a nonzero rational. A difference it cannot
    reduce to either is compared numerically: equal within 1e-40 relative at 60 digits, else unequal. Conventions: 0^0 = 1;
    0/0 and x^{-1} at x = 0 (any division by zero) are undefined, so "unparseable". Every bound
    is counted work (``_Budget``, ``MAX_EXPAND_TERMS``), never time: the verdict does not depend
    on the machine's load. The verifier calls it in the worker (``serve``), whose time and memory
    limits are a safety net only."""
    budget = _Budget(max_ops=max_ops, bits=bits)
    va, vb = parse_value(a, budget), parse_value(b, budget)
    if va is None or vb is None:
        return "unparseable"
    try:
        if isinstance(va, sympy.Rational) and isinstance(vb, sympy.Rational):
            return "equal" if va == vb else "unequal"
        zero = _is_zero(va - vb, terms)
        if zero is not None:
            return "equal" if zero else "unequal"
        fa, fb = va.evalf(_DIGITS), vb.evalf(_DIGITS)
        scale = max(abs(fb), sympy.Integer(1))
        return "equal" if abs(fa - fb) <= _REL_TOL * scale else "unequal"
    except (_ParseError, TypeError, ValueError, OverflowError, ZeroDivisionError):
        return "unparseable"


# ---------------------------------------------------------------------------- the worker's side

#: What the worker answers when it is up, before the first request.
READY = b"ready\n"
#: Resident memory the worker may gain over its start before it drops sympy's caches: the caches
#: make a grading ~8× cheaper (measured: 0.7 vs 5.8 ms for a fraction against a root), but an
#: answer's large expressions must not stay in memory for the rest of the run.
CACHE_BYTES = 64 << 20


def _resident_bytes() -> int:
    """This process's resident memory (Linux procfs; 0 where there is none: caches then stay)."""
    import resource

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


def _limit_memory(extra_bytes: int) -> None:
    """Address space capped at what the worker maps now (Python + sympy) plus `extra_bytes`: a
    runaway allocation raises MemoryError here instead of swapping the machine."""
    import resource

    try:
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * resource.getpagesize()
    except OSError:  # no procfs: the CPU limit and the parent's kill still hold
        return
    cap = mapped + extra_bytes
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


def _limit_cpu(seconds: float) -> None:
    """SIGXCPU (which terminates) once this request has used `seconds` of CPU, rounded up to the
    kernel's whole seconds plus one: the bound that holds even when the parent is gone. Only the
    soft limit moves (an unprivileged process cannot raise a hard limit back)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(math.ceil(usage.ru_utime + usage.ru_stime + seconds)) + 1
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def serve(memory_bytes: int) -> None:
    """The worker loop: one JSON request ``[a, b, limits]`` per line on stdin (``limits``: the
    keyword arguments of ``grade_values`` and ``seconds``, the safety net), one reply
    ``[verdict, outcome]`` per line on stdout (outcome ``done``, ``error`` or ``memory``).

    Returns at EOF (the parent closed the pipe or died) and after a MemoryError (sympy's caches
    may hold the half-built value: the parent starts a fresh worker)."""
    from sympy.core.cache import clear_cache

    _limit_memory(memory_bytes)
    start = _resident_bytes()
    out, inp = sys.stdout.buffer, sys.stdin.buffer
    out.write(READY)
    out.flush()
    for line in inp:
        a, b, limits = json.loads(line)
        _limit_cpu(limits.pop("seconds", SAFETY_S))
        try:
            verdict, outcome = grade_values(a, b, **limits), "done"
        except MemoryError:
            verdict, outcome = "unparseable", "memory"
        except Exception:  # noqa: BLE001 - sympy failing on model output: no value was read
            verdict, outcome = "unparseable", "error"
        if _resident_bytes() > start + CACHE_BYTES:
            clear_cache()
        out.write(json.dumps([verdict, outcome]).encode() + b"\n")
        out.flush()
        if outcome == "memory":
            return


if __name__ == "__main__":
    if sys.argv[1:2] != ["--serve"] or len(sys.argv) != 3:
        raise SystemExit("usage: math_value.py --serve MEMORY_BYTES")
    serve(int(sys.argv[2]))
