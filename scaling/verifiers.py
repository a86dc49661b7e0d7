"""Verifiers: score a response against the reference answer. Model output is data, never code.

* ``math``: the last ``\\boxed{...}`` (or, failing that, the last ``Answer: ...`` line, DAPO's
  format) compared with the reference by normalised string equality, then by exact value with a
  small recursive-descent parser (numbers, + − × ÷ ^, parentheses, ``\\frac``, ``\\sqrt``, π)
  that builds sympy numbers directly (no ``eval``, no ``sympify`` of text, bounded exponents).
* ``exact``: stripped string equality (the synthetic tasks).
* ``module:function``: any importable ``fn(response: str, answer: str) -> float``.

``score_responses`` runs a verifier over a batch and turns an exception into a skipped sample
(``reward.on_error: skip``, counted in the metrics) or a stop (``error``).
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Callable

import sympy

Verifier = Callable[[str, str], float]


# ---------------------------------------------------------------------------- extraction

def _braced(text: str, start: int) -> tuple[str, int] | None:
    """Content of the balanced ``{...}`` group opening at ``text[start]``, and the end index."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i], i + 1
    return None


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed 5``), else None."""
    last = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*", text):
        j = m.end()
        got = _braced(text, j)
        if got is not None:
            last = got[0]
        else:
            tail = re.match(r"[^\s$]+", text[j:])
            if tail:
                last = tail.group(0)
    return last


def extract_answer_line(text: str) -> str | None:
    """DAPO-Math's format: the text after the last ``Answer:``, up to the end of its line."""
    hits = re.findall(r"Answer\s*:\s*([^\n]+)", text)
    return hits[-1].strip() if hits else None


def extract_final_answer(text: str) -> str | None:
    """Boxed answer first, then an ``Answer:`` line."""
    boxed = extract_boxed(text)
    return boxed if boxed is not None else extract_answer_line(text)


# ---------------------------------------------------------------------------- normalisation

_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mbox|mathbf)\s*\{([^{}]*)\}")


def normalize_answer(s: str) -> str:
    """Canonical string form: no $, spacing commands, \\left/\\right, units of degrees, etc."""
    s = s.strip()
    s = _TEXT_CMD.sub(r"\1", s)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""),
                     ("\\:", ""), ("\\quad", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                     ("^\\circ", ""), ("^{\\circ}", ""), ("\\circ", ""), ("\\%", ""), ("%", ""),
                     ("\\$", ""), ("$", ""), ("\\displaystyle", "")):
        s = s.replace(old, new)
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 5" -> "5"
    s = s.replace(" ", "").rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # thousands separators
        s = s.replace(",", "")
    return s.lower()


# ---------------------------------------------------------------------------- safe value parser

class _ParseError(ValueError):
    pass


_TOKEN = re.compile(r"\s*(\d+\.\d*|\.\d+|\d+|\\frac|\\sqrt|\\pi|\\cdot|\\times|\\div|[-+*/^(){}\[\]]|pi)")
MAX_EXPONENT = 64
MAX_TOKENS = 200


class _Parser:
    """expr := term (('+'|'-') term)*; term := factor (('*'|'/'|implicit) factor)*;
    factor := ('+'|'-') factor | power; power := atom ('^' factor)?;
    atom := number | π | '(' expr ')' | '{' expr '}' | \\frac{expr}{expr} | \\sqrt[n]{expr}."""

    def __init__(self, text: str):
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

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, want: str | None = None) -> str:
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
            value = value + rhs if op == "+" else value - rhs
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
            elif tok is not None and (tok[0].isdigit() or tok[0] == "." or tok in ("(", "\\frac", "\\sqrt", "\\pi", "pi")):
                value = value * self.factor()  # implicit product: 2\pi, 3\sqrt{2}
            else:
                return value

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
            exp = self.factor()
            if not (exp.is_number and abs(float(exp)) <= MAX_EXPONENT):
                raise _ParseError("exponent too large")
            return base ** exp
        return base

    def atom(self) -> sympy.Expr:
        tok = self.take()
        if tok[0].isdigit() or tok[0] == ".":
            return sympy.Rational(tok)
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
            return num / den
        if tok == "\\sqrt":
            index = sympy.Integer(2)
            if self.peek() == "[":
                self.take("[")
                index = self.expr()
                self.take("]")
            return sympy.root(self._group(), index)
        raise _ParseError(f"unexpected {tok!r}")

    def _group(self) -> sympy.Expr:
        # \frac12 (single-digit shorthand) or \frac{..}{..}
        if self.peek() == "{":
            self.take("{")
            value = self.expr()
            self.take("}")
            return value
        tok = self.take()
        if tok.isdigit():
            if len(tok) > 1:  # \frac12: the first digit is the group, the rest stays in the stream
                self.toks.insert(self.i, tok[1:])
            return sympy.Integer(tok[0])
        raise _ParseError(f"expected a group, got {tok!r}")


def parse_value(s: str) -> sympy.Expr | None:
    """Exact value of a simple numeric expression (LaTeX or plain), or None if not one."""
    try:
        value = _Parser(s).parse()
    except (_ParseError, ValueError, TypeError, ZeroDivisionError, OverflowError):
        return None
    return value if value.is_number else None


def math_equal(pred: str, ref: str) -> bool:
    """Normalised string equality, else equal exact values (within 1e-9 relative if irrational)."""
    a, b = normalize_answer(pred), normalize_answer(ref)
    if a == b:
        return True
    va, vb = parse_value(a), parse_value(b)
    if va is None or vb is None:
        return False
    try:
        if va.is_rational and vb.is_rational:
            return bool(va == vb)
        fa, fb = complex(va.evalf(30)), complex(vb.evalf(30))
    except (TypeError, ValueError, OverflowError):
        return False
    return abs(fa - fb) <= 1e-9 * max(1.0, abs(fb))


# ---------------------------------------------------------------------------- verifiers

def verify_math(response: str, answer: str) -> float:
    """1.0 if the response's final answer equals the reference, else 0.0."""
    got = extract_final_answer(response)
    return 1.0 if got is not None and math_equal(got, answer) else 0.0


def verify_exact(response: str, answer: str) -> float:
    """1.0 if the stripped response equals the stripped reference."""
    return 1.0 if response.strip() == answer.strip() else 0.0


VERIFIERS: dict[str, Verifier] = {"math": verify_math, "exact": verify_exact}


def get_verifier(name: str) -> Verifier:
    """A registered verifier, or ``module:function`` imported (plugins)."""
    if name in VERIFIERS:
        return VERIFIERS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"reward.verifier: cannot import {name!r}: {err}") from None
        if not callable(fn):
            raise ValueError(f"reward.verifier: {name!r} is not callable")
        return fn
    raise ValueError(f"reward.verifier: unknown {name!r}; valid: {', '.join(sorted(VERIFIERS))} "
                     "or module:function")


class RewardError(RuntimeError):
    """A verifier raised and ``reward.on_error`` is ``error``."""


@dataclass
class Scores:
    """rewards [B] (0.0 where skipped), ok [B] (False: the verifier failed; sample leaves the loss)."""

    rewards: list[float]
    ok: list[bool]
    errors: list[str]


def score_responses(verifier: Verifier, responses: list[str], answers: list[str], *,
                    on_error: str = "skip") -> Scores:
    """Score each response; an exception or a non-finite reward skips the sample or raises."""
    rewards, ok, errors = [], [], []
    for i, (resp, ans) in enumerate(zip(responses, answers)):
        try:
            r = float(verifier(resp, ans))
            if r != r or r in (float("inf"), float("-inf")):
                raise ValueError(f"non-finite reward {r}")
        except Exception as err:  # noqa: BLE001 - a verifier is user code; report, don't crash mid-step
            msg = f"sample {i}: verifier raised {type(err).__name__}: {err}"
            if on_error == "error":
                raise RewardError(msg + " (set reward.on_error: skip to skip such samples)") from err
            rewards.append(0.0)
            ok.append(False)
            errors.append(msg)
            continue
        rewards.append(r)
        ok.append(True)
    return Scores(rewards=rewards, ok=ok, errors=errors)
