"""The proofs' random instances, and the oracle their claims are checked against.

The oracle (SPEC's definitions at 50 digits, ``Instance``, the divergences, the derivative of a
definition) lives in the core as ``pdm_lab.oracle``, the one oracle ``pdm_lab.testing`` uses too;
its names are re-exported here so that a claim reads ``reference.topk_kl``.
"""
from __future__ import annotations

import math
import random

from pdm_lab.oracle import (PRECISION, Instance, TailSums, binary_kl, binary_tv, coarsen,  # noqa: F401
                            covariance, derivative_at_zero, direction, kl, kth_largest, log_softmax_float64,
                            moved, softmax, spec_support, topk_kl, topk_tv, total_variation)


# --------------------------------------------------------------------------- random instances

def random_logits(rng: random.Random, n: int, style: str | None = None) -> list[float]:
    """Float logits of one of several shapes: gauss, peaked, flat, zipf (LLM-like), ties, and
    extreme (log-probs down to −300, as float32 LLM logits give: tails far below rounding)."""
    style = style or rng.choice(("gauss", "peaked", "flat", "zipf", "ties", "extreme"))
    if style == "gauss":
        scale = rng.choice((0.3, 1.0, 3.0))
        return [rng.gauss(0.0, scale) for _ in range(n)]
    if style == "peaked":
        x = [rng.gauss(0.0, 1.0) for _ in range(n)]
        x[rng.randrange(n)] += rng.uniform(4.0, 12.0)
        return x
    if style == "flat":
        return [rng.gauss(0.0, 0.1) for _ in range(n)]
    if style == "zipf":
        ranks = list(range(1, n + 1))
        rng.shuffle(ranks)
        s = rng.uniform(0.8, 2.0)
        return [-s * math.log(r) + rng.gauss(0.0, 0.1) for r in ranks]
    if style == "extreme":
        live = rng.randint(1, max(1, n // 3))
        return [rng.gauss(0.0, 1.0) if t < live else -rng.uniform(30.0, 300.0) for t in range(n)]
    if style == "ties":
        levels = [rng.gauss(0.0, 1.5) for _ in range(max(1, n // 3))]
        return [rng.choice(levels) for _ in range(n)]
    raise ValueError(f"unknown style {style!r}")


def random_pair(rng: random.Random, n: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(log μ, log π) in float64: π a perturbation of μ (near, far) or independent of it."""
    x = random_logits(rng, n)
    mode = rng.choice(("near", "far", "independent"))
    if mode == "independent":
        y = random_logits(rng, n)
    else:
        noise = 0.05 if mode == "near" else 1.0
        y = [xi + rng.gauss(0.0, noise) for xi in x]
    return log_softmax_float64(x), log_softmax_float64(y)


def random_instance(rng: random.Random, n: int, K: int, convention: str = "union", *,
                    k: int | None = None, label: str = "") -> Instance:
    """A random token; k uniform over the vocabulary unless given (so often outside the top-K)."""
    mu_logp, pi_logp = random_pair(rng, n)
    k = rng.randrange(n) if k is None else k
    advantage = rng.choice((-1.0, 1.0, 0.5, -2.0, 0.0))
    return Instance(mu_logp, pi_logp, k, K, convention, advantage, label)
