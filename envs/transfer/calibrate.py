"""``pdm-lab calibrate``: the regime of a mismatch setting (SPEC §6b), and the knob that hits a target.

A toy setting (an audit configuration: problem, policy, mismatch, batch) is rolled out for a few
seeds; per response token, D = top-K KL(μ‖π) in float64, whether it lies outside δ, Â ≠ 0, μ's
top-K mass and entropy, and the tokens per distinct context. The table (``pdm_lab.audit.measure.
regime_table``) has ``d_quantiles`` {p50, p90, p99, p999, max}, ``outside_fraction`` (of Â ≠ 0
tokens), ``tail_ratio`` (p99.9/p50), ``topk_mass_quantiles``, ``entropy_quantiles`` and
``tokens_per_state``. The same table comes from a scaling run's logged per-token mismatch
sample (``mismatch_sample.jsonl``: D, μ_T, π_T, r, Â and the mini-batch j per sampled token), so a
user can set the toy to their engine's regime. A run's table is the pooled one over its mini-batches
j = 0 … M−1 — the regime in which the mask acts (SPEC §6b: mini-batch j meets π after j optimiser
steps on the same rollouts) — with a table per j under ``mini_batches`` (a row without
``mini_batch`` is j = 0); a toy is compared with the pooled row. ``--target F`` searches the strength of the mismatch's tunable
source (its first with a strength: σ of ``lognormal``) by bisection on a log scale until the
outside fraction is F.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch

from pdm_lab.audit.measure import regime_table
from pdm_lab.config import ConfigError

from pdm_lab.envs.audit.batch import audit_batch, float64_tokens
from pdm_lab.envs.audit.config import AuditConfig
from pdm_lab.envs.audit.seed import regime_inputs, regime_of
from pdm_lab.envs.problems.mismatch import Mismatch, MismatchSource
from pdm_lab.masks import outside_region
from pdm_lab.lab.records import read_jsonl
from pdm_lab.envs.train.update import current_stats


def toy_inputs(cfg: AuditConfig, seeds: int) -> list[tuple]:
    """Per seed, the regime inputs of one fresh batch (``envs.audit.seed.regime_inputs``)."""
    out = []
    for seed in range(cfg.first_seed, cfg.first_seed + seeds):
        _, policy, batch, adv = audit_batch(cfg, seed)
        mask = cfg.mask(cfg.rules[0])
        tokens = float64_tokens(batch, adv, mask)
        stats = current_stats(policy.double(), tokens, full=False)
        resp = tokens.response_mask.reshape(-1)
        considered = resp & (tokens.advantages.reshape(-1) != 0)
        outside = outside_region(stats.topk_kl, tokens.advantages.reshape(-1), mask) & considered
        out.append(regime_inputs(tokens, stats.topk_kl, outside, considered, mask.k, resp))
    return out


def toy_table(cfg: AuditConfig, seeds: int = 4) -> dict:
    """The calibration table of a toy setting over `seeds` fresh batches."""
    inputs = toy_inputs(cfg, seeds)
    cat = [torch.cat([p[i] for p in inputs]) for i in range(5)]
    table = regime_of((*cat, sum(p[5] for p in inputs) / len(inputs)))
    table.update(source="toy", mismatch=cfg.mismatch, seeds=seeds, delta=cfg.delta, k=cfg.k,
                 sequences=cfg.sequences)
    return table


def run_table(path: Path, delta: float = 0.15) -> dict:
    """The calibration table of a scaling run's per-token mismatch sample (jsonl or its folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / "mismatch_sample.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no per-token mismatch sample (the scaling loop writes it)")
    rows = read_sample(path)
    table = _sample_table(rows, delta)
    by_j: dict[int, list[dict]] = {}
    for r in rows:
        by_j.setdefault(int(r.get("mini_batch", 0)), []).append(r)
    table.update(source="scaling run", path=path.name, delta=delta, compared="pooled",
                 mini_batches={str(j): _sample_table(by_j[j], delta) for j in sorted(by_j)})
    return table


def _sample_table(rows: list[dict], delta: float) -> dict:
    d = torch.tensor([r["d"] for r in rows], dtype=torch.float64)
    adv = torch.tensor([r.get("adv", 1.0) for r in rows], dtype=torch.float64)
    mu_tail = torch.tensor([r["mu_tail"] for r in rows], dtype=torch.float64)
    considered = adv != 0
    return regime_table(d, (d > delta) & considered, considered, topk_mass=1.0 - mu_tail)


def read_sample(path: Path) -> list[dict]:
    """The rows of a ``mismatch_sample.jsonl``; a row that is not JSON, lacks ``d`` or
    ``mu_tail``, or holds a non-finite number is a ``ConfigError`` naming the file and line."""
    rows = []
    for line_no, row in read_jsonl(path, error=ConfigError):
        if not isinstance(row, dict):
            raise ConfigError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
        missing = [key for key in ("d", "mu_tail") if key not in row]
        if missing:
            raise ConfigError(f"{path}:{line_no}: no {missing[0]!r} (each row holds D and μ_T of a token)")
        for key in ("d", "mu_tail", "adv"):
            value = row.get(key, 0.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{path}:{line_no}: {key} = {value!r} is not a finite number")
        j = row.get("mini_batch", 0)
        if isinstance(j, bool) or not isinstance(j, int) or j < 0:
            raise ConfigError(f"{path}:{line_no}: mini_batch = {j!r} is not a mini-batch index ≥ 0")
        rows.append(row)
    if not rows:
        raise ConfigError(f"{path}: the mismatch sample is empty")
    return rows


def with_strength(spec: str, strength: float) -> str:
    """`spec` with its tunable source (the first with a strength knob) set to `strength`."""
    m = Mismatch.parse(spec)
    for i, s in enumerate(m.sources):
        if s.kind != "stale":
            sources = list(m.sources)
            sources[i] = MismatchSource(s.kind, strength, s.tail)
            return str(Mismatch(tuple(sources)))
    raise ValueError(f"mismatch {spec!r}: no source with a strength to search")


def search_strength(cfg: AuditConfig, target: float, *, seeds: int = 2, iters: int = 12,
                    lo: float = 1e-3, hi: float = 10.0, progress=None) -> tuple[str, dict]:
    """Bisection on log strength for outside_fraction ≈ target; returns (mismatch, its table)."""
    if not 0 < target < 1:
        raise ValueError(f"target: an outside fraction in (0, 1), got {target}")
    best = None
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        spec = with_strength(cfg.mismatch, mid)
        table = toy_table(replace(cfg, mismatch=spec), seeds)
        frac = table["outside_fraction"]
        if progress:
            progress(spec, frac)
        if best is None or abs(math.log((frac + 1e-9) / target)) < abs(math.log((best[1]["outside_fraction"] + 1e-9) / target)):
            best = (spec, table)
        if frac < target:
            lo = mid
        else:
            hi = mid
    return best


def format_table(table: dict) -> str:
    """The table as printed by the command (and written into reports)."""
    q = table["d_quantiles"]
    lines = [f"D = top-K KL(μ‖π) per response token ({table['tokens']} tokens, "
             f"{table['zero_advantage_tokens']} with Â = 0):",
             "  " + "  ".join(f"{k} {v:.3g}" for k, v in q.items()),
             f"outside δ among Â ≠ 0 tokens: {100 * table['outside_fraction']:.3f}% "
             f"({table['outside_tokens']} of {table['nonzero_advantage_tokens']}); tail ratio p99.9/p50 = {table['tail_ratio']:.3g}"]
    if table.get("topk_mass_quantiles"):
        m = table["topk_mass_quantiles"]
        lines.append("μ's top-K mass quantiles: " + "  ".join(f"{k} {v:.4f}" for k, v in m.items())
                     + (f"; ≥ 0.99 at {100 * table['topk_mass_ge_099']:.1f}% of positions"
                        if "topk_mass_ge_099" in table else ""))
    if table.get("entropy_quantiles"):
        lines.append("μ's entropy (nats): " + "  ".join(f"{k} {v:.3g}" for k, v in table["entropy_quantiles"].items()))
    if table.get("tokens_per_state") is not None:
        lines.append(f"tokens per distinct context: {table['tokens_per_state']:.2f}")
    return "\n".join(lines)


def format_mini_batches(table: dict) -> str:
    """A run table's regime per mini-batch j and pooled (``run_table``), one row each, and which row
    a toy is compared with."""
    head = f"{'mini-batch':>10}  {'tokens':>7}  {'D p50':>9}  {'D p99':>9}  {'D p99.9':>9}  {'D max':>9}  {'outside δ':>10}"

    def row(name: str, t: dict) -> str:
        q = t["d_quantiles"]
        return (f"{name:>10}  {t['tokens']:>7}  {q['p50']:>9.3g}  {q['p99']:>9.3g}  {q['p999']:>9.3g}  "
                f"{q['max']:>9.3g}  {100 * t['outside_fraction']:>9.3f}%")

    lines = ["the regime per mini-batch j (after j optimiser steps on the batch) and pooled:", head]
    lines += [row(f"j = {j}", t) for j, t in table.get("mini_batches", {}).items()]
    lines.append(row("pooled", table))
    lines.append(f"a toy is compared with the {table.get('compared', 'pooled')} row (the regime the mask acts in)")
    return "\n".join(lines)


def _fmt(x, spec: str, scale: float = 1.0, unit: str = "") -> str:
    """`x` formatted, or "n/a" where nothing was measured (None or NaN: no token in the setting)."""
    return "n/a" if x is None or x != x else f"{scale * x:{spec}}{unit}"


def markdown_row(name: str, table: dict) -> str:
    """One row of the README / report calibration table ("n/a" where the setting had no token)."""
    q = table["d_quantiles"]
    mass = table.get("topk_mass_ge_099")
    tps = table.get("tokens_per_state")
    return (f"| {name} | {_fmt(q.get('p50'), '.2g')} | {_fmt(q.get('p99'), '.2g')} | {_fmt(q.get('p999'), '.2g')} | "
            f"{_fmt(q.get('max'), '.2g')} | {_fmt(table.get('outside_fraction'), '.3f', 100, '%')} | "
            f"{_fmt(table.get('tail_ratio'), '.3g')} | {'–' if mass is None else _fmt(mass, '.0f', 100, '%')} | "
            f"{'–' if tps is None else _fmt(tps, '.2f')} |")


MARKDOWN_HEADER = ("| setting | D p50 | D p99 | D p99.9 | D max | outside δ (Â ≠ 0) | p99.9/p50 | "
                   "top-20 mass ≥ 0.99 | tokens / context |\n"
                   "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
