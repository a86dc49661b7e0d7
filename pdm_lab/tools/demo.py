"""``pdm-lab demo``: the masks on synthetic LLM-like batches, at a few mismatch strengths.

For each noise level σ it prints how often each rule drops a token, how often the ratio test and
Ḋ disagree in direction among tokens outside the region, and how often each top-K estimator gets
the sign of the exact Ḋ wrong — the SPEC §3 facts, measured on the spot.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from pdm_lab.config import ConfigError, at_least, non_negative
from pdm_lab.diagnosis import DIAGNOSE_MASKS, diagnose
from pdm_lab.cli.main import integer, number
from pdm_lab.lab.memory import check_memory
from pdm_lab.lab.outputs import write_output
from pdm_lab.tools.synthetic import synthetic_batch


#: Bytes per (token, vocabulary entry) the demo holds at once (μ, π, their probabilities and the
#: diagnosis' intermediates, float32): the memory estimate checked before the batch is drawn.
BYTES_PER_ENTRY = 48


def _rate(flags: torch.Tensor, where: torch.Tensor) -> float:
    """Fraction of ``where`` entries with ``flags``; NaN (printed "n/a") when there are none."""
    return float(flags[where].double().mean()) if bool(where.any()) else math.nan


def run_demo(*, tokens: int = 1024, vocab: int = 32000, k: int = 20, delta: float = 0.05,
             noises: tuple[float, ...] = (0.2, 0.5, 1.0), seed: int = 0) -> list[dict]:
    rows = []
    for noise in noises:
        batch = synthetic_batch(tokens, vocab, noise=noise, seed=seed)
        out = diagnose(batch["mu_logp"], batch["pi_logp"], batch["sampled"], batch["advantages"],
                       k=k, delta=delta)
        outside = out["outside"]
        row = {"noise": noise, "tokens": tokens, "outside": int(outside.sum()),
               "topk_kl_mean": float(out["topk_kl"].mean()), "full_kl_mean": float(out["full_kl"].mean()),
               "mu_tail_mean": float(out["mu_tail"].mean()),
               "ratio_vs_exact_disagree": _rate(out["dir_disagree_exact"], outside)}
        exact_sign = torch.sign(out["ddot_exact"])
        for est in ("agg", "uniform", "topk"):
            row[f"wrong_sign_{est}"] = _rate(torch.sign(out[f"ddot_{est}"]) != exact_sign, outside)
        row["sign_certified"] = _rate(out["sign_certified"], outside)
        for rule in DIAGNOSE_MASKS:
            row[f"dropped_{rule}"] = float(1 - out[f"mask_{rule}"].mean())
        rows.append(row)
    return rows


def _print_table(rows: list[dict]) -> None:
    cols = ["noise", "outside", "topk_kl_mean", "mu_tail_mean", "ratio_vs_exact_disagree",
            "wrong_sign_agg", "wrong_sign_uniform", "wrong_sign_topk", "sign_certified"]
    cols += [f"dropped_{r}" for r in DIAGNOSE_MASKS]
    print(" | ".join(f"{c:>10.10}" for c in cols))
    for row in rows:
        print(" | ".join(("{:>10}".format("n/a") if math.isnan(row[c]) else f"{row[c]:>10.4g}")
                         if isinstance(row[c], float) else f"{row[c]:>10}" for c in cols))


def main(args: argparse.Namespace) -> int:
    if args.k > args.vocab:
        raise ConfigError(f"--k {args.k}: must be ≤ --vocab ({args.vocab}): K of μ's most probable tokens")
    # the batch and its diagnosis hold about a dozen [tokens, vocab] float32 tensors at once
    check_memory(BYTES_PER_ENTRY * args.tokens * args.vocab, f"--tokens {args.tokens:g} × --vocab {args.vocab}")
    start = time.perf_counter()
    rows = run_demo(tokens=args.tokens, vocab=args.vocab, k=args.k, delta=args.delta, seed=args.seed)
    _print_table(rows)
    plain = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]
    out = write_output(args.out, json.dumps(plain, indent=2))  # null: no outside token to measure on
    print(f"\nwrote {out} ({time.perf_counter() - start:.1f} s)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("demo", help="the masks on synthetic LLM-like batches (prints a table, writes JSON)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=integer(at_least(1)), default=1024, help="tokens per batch (default 1024)")
    p.add_argument("--vocab", type=integer(at_least(2)), default=32000, help="vocabulary size n (default 32000)")
    p.add_argument("--k", type=integer(at_least(1)), default=20, help="top-K, at most --vocab (default 20)")
    p.add_argument("--delta", type=number(non_negative), default=0.05, help="threshold δ (default 0.05)")
    p.add_argument("--seed", type=integer(at_least(0)), default=0)
    p.add_argument("--out", default="results/demo.json", help="JSON output (default results/demo.json)")
    p.set_defaults(func=main)
