"""sympy building blocks shared by the claims: simplex points, softmax weights, finite sums.

Two kinds of symbolic proof are used:

* fixed size (n = 2..6): explicit symbols, the identity reduced with ``cancel`` to exactly 0;
* general n: ``sympy.Sum`` over an ``IndexedBase``, reduced by ``expand_sums`` (linearity of a
  finite sum, constants pulled out, one canonical dummy index) until both sides are the same
  linear combination of the same sums.
"""
from __future__ import annotations

import sympy as sp

# General-n symbols: n tokens indexed 1..n, distributions μ, π and a logit direction v.
n = sp.Symbol("n", integer=True, positive=True)
i, j, m, q = sp.symbols("i j m q", integer=True, positive=True)
eta = sp.Symbol("eta", real=True)
mu_, pi_, v_, z_ = (sp.IndexedBase(name) for name in ("mu", "pi", "v", "z"))


def weights(count: int, prefix: str = "w") -> list[sp.Symbol]:
    """Positive symbols w_1..w_count: the exponentiated logits, π_i = w_i / Σ w."""
    return list(sp.symbols(f"{prefix}0:{count}", positive=True))


def softmax_of(w: list) -> list:
    """π_i = w_i / Σ_j w_j (softmax of z with w = exp z)."""
    total = sp.Add(*w)
    return [wi / total for wi in w]


def simplex_point(count: int, prefix: str = "mu") -> list:
    """A generic point of the probability simplex: count−1 free positive symbols, last = 1 − Σ."""
    free = list(sp.symbols(f"{prefix}0:{count - 1}", positive=True))
    return free + [1 - sp.Add(*free)]


def residual(expr) -> sp.Expr:
    """expr reduced to a canonical rational form; 0 exactly when the identity holds."""
    return sp.cancel(sp.together(expr))


def kl_along(mu: list, w: list, v: list) -> sp.Expr:
    """KL(μ‖softmax(z + ηv)) with exp z = w, as a sympy expression in η."""
    moved = [wi * sp.exp(eta * vi) for wi, vi in zip(w, v)]
    total = sp.Add(*moved)
    return sp.Add(*[mi * (sp.log(mi) - sp.log(xi / total)) for mi, xi in zip(mu, moved)])


def d_at_zero(expr) -> sp.Expr:
    """d expr/dη at η = 0."""
    return sp.diff(expr, eta).subs(eta, 0)


def expand_sums(expr) -> sp.Expr:
    """Rewrite finite sums by linearity until only sums of single monomials remain.

    Σ_i (a_i + c·b_i) → Σ_i a_i + c·Σ_i b_i for c free of i, Σ_i c → n·c, and every dummy index
    renamed to ``i`` so that equal sums compare equal.
    """
    expr = sp.sympify(expr)
    if isinstance(expr, sp.Sum) and len(expr.limits) > 1:  # Σ_j Σ_i: the inner sum first
        inner = expand_sums(sp.Sum(expr.function, expr.limits[0]))
        return expand_sums(sp.Sum(inner, *expr.limits[1:]))
    if isinstance(expr, sp.Sum):
        body, (idx, lo, hi) = expr.function, expr.limits[0]
        body = sp.expand(expand_sums(body))
        total = sp.Integer(0)
        for term in sp.Add.make_args(body):
            const, rest = term.as_independent(idx, as_Add=False)
            if rest == 1:
                total += const * (hi - lo + 1)
            else:
                canonical = i if (idx == i or i not in rest.free_symbols) else idx
                total += const * sp.Sum(rest.subs(idx, canonical), (canonical, lo, hi))
        return total
    if expr.args:
        return expr.func(*[expand_sums(a) for a in expr.args])
    return expr


def general_residual(lhs, rhs) -> sp.Expr:
    """lhs − rhs for general-n sum expressions, after ``expand_sums`` on both."""
    return sp.simplify(sp.expand(expand_sums(lhs) - expand_sums(rhs)))


def in_vocabulary(expr) -> sp.Expr:
    """Resolve Σ_i δ_{im} x_i = x_m: evaluate Kronecker-delta sums, then keep the branch of each
    Piecewise whose condition is a token id (m or q) lying in 1..n, which token ids do."""
    expr = expr.replace(lambda e: isinstance(e, sp.Sum) and e.has(sp.KroneckerDelta),
                        lambda e: e.doit())

    def branch(pw: sp.Piecewise) -> sp.Expr:
        value, condition = pw.args[0]
        parts = condition.args if isinstance(condition, sp.And) else (condition,)
        upper = [c for c in parts if isinstance(c, (sp.Le, sp.Ge)) and c.gts == n and c.lts in (m, q)]
        lower = [c for c in parts if isinstance(c, (sp.Le, sp.Ge)) and c.lts == 1 and c.gts in (m, q)]
        if len(upper) + len(lower) != len(parts) or not upper:
            raise ValueError(f"unexpected Piecewise condition {condition}")
        return value
    return expr.replace(lambda e: isinstance(e, sp.Piecewise), branch)


def kl_general(logits) -> sp.Expr:
    """KL(μ‖softmax(ζ)) for general n, ζ_i = logits(i): Σ_i μ_i(log μ_i − ζ_i + log Σ_j exp ζ_j)."""
    lse = sp.log(sp.Sum(sp.exp(logits(j)), (j, 1, n)))
    return sp.Sum(mu_[i] * (sp.log(mu_[i]) - logits(i) + lse), (i, 1, n))


def on_simplex(expr, normaliser: sp.Symbol) -> sp.Expr:
    """Use Σ_i μ_i = 1 and exp z_i = Z·π_i (π = softmax z, Z = Σ exp z) in a general-n expression."""
    expr = expand_sums(expr)
    expr = expr.subs(sp.Sum(mu_[i], (i, 1, n)), 1)
    expr = expr.subs(sp.Sum(sp.exp(z_[i]), (i, 1, n)), normaliser)
    expr = expr.replace(lambda e: isinstance(e, sp.exp) and isinstance(e.args[0], sp.Indexed)
                        and e.args[0].base == z_, lambda e: normaliser * pi_[e.args[0].indices[0]])
    return expand_sums(expr)


def topk_kl_along(mu: list, w: list, v: list, support: list[int]) -> sp.Expr:
    """D(μ, softmax(z + ηv)) on a fixed support S (exp z = w): the KL of the coarsened pair."""
    moved = [wi * sp.exp(eta * vi) for wi, vi in zip(w, v)]
    total = sp.Add(*moved)
    tail = [t for t in range(len(mu)) if t not in support]
    mu_tail = sp.Add(*[mu[t] for t in tail])
    pi_tail = sp.Add(*[moved[t] for t in tail]) / total
    head = sp.Add(*[mu[t] * (sp.log(mu[t]) - sp.log(moved[t] / total)) for t in support])
    return head + mu_tail * (sp.log(mu_tail) - sp.log(pi_tail)) if tail else head

#: Z = Σ_j exp z_j, the softmax normaliser, in general-n proofs.
Z_SYMBOL = sp.Symbol("Z", positive=True)
