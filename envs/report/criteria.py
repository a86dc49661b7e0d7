"""How the sweep's report ranks configurations: a criterion (a per-run outcome and its better
direction) and ``decide``, which names a winner only where it is separated from the runner-up at
95% with enough seeds (``pdm_lab.lab.evidence``)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from pdm_lab.lab.evidence import COLLAPSE_MIN_STEPS, collapse_measurable, separation, shortfalls

from pdm_lab.envs.report.summary import config_label, group_rows, newcombe_diff_ci


def _num(x: float, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if abs(x) < 0.5 * 10 ** -digits:
        x = 0.0  # no "-0.000" from rounding-level values
    return f"{x:.{digits}f}"


@dataclass(frozen=True)
class Criterion:
    """One way to rank configurations: a per-run outcome and its better direction."""

    what: str
    value: Callable[[dict], float]
    higher: bool
    rate: str | None = None
    """a 0/1 row field counted as a rate (Newcombe interval of the difference) instead of a mean."""


REWARD = Criterion("final reward", lambda r: r["final_reward"], higher=True)
COLLAPSE = Criterion("collapse rate", lambda r: float(bool(r["collapsed"])), higher=False, rate="collapsed")
UNSAFE_KEEP = Criterion("unsafe-keep rate (mean of runs' rates)", lambda r: r["unsafe_keep"], higher=False)
MASKED = Criterion("fraction of tokens masked", lambda r: r["mask_fraction"], higher=False)


def _rate_pair(best: list[dict], second: list[dict], field: str) -> tuple[str, str, str, bool]:
    """Counts of ``field`` in each, the Newcombe interval of the difference, whether it is < 0."""
    hits = [sum(bool(r[field]) for r in rows) for rows in (best, second)]
    d, lo, hi = newcombe_diff_ci(hits[0], len(best), hits[1], len(second))
    separated = hi < 0
    diff = f"difference {d:+.2f}, 95% Newcombe CI [{lo:+.2f}, {hi:+.2f}]" + ("" if separated else " includes 0")
    return f"{hits[0]}/{len(best)}", f"{hits[1]}/{len(second)}", diff, separated


def decide(groups: dict[str, list[dict]], crit: Criterion) -> tuple[str | None, str]:
    """(the winning label or None, the report's words) for configurations ``groups`` (label →
    rows) on ``crit``: a winner only where it is separated from the runner-up at 95%
    (``pdm_lab.lab.evidence``) with enough seeds; otherwise "no winner: tied (…)"."""
    if crit.rate and not all(collapse_measurable(r["steps"]) for rows in groups.values() for r in rows):
        short = min(r["steps"] for rows in groups.values() for r in rows)
        return None, (f"n/a (runs of {short} steps; the collapse definition needs ≥ {COLLAPSE_MIN_STEPS})")
    scored = []
    for label, rows in groups.items():
        values = [float(v) for v in map(crit.value, rows) if v is not None and math.isfinite(float(v))]
        if values:
            scored.append((sum(values) / len(values), label, values))
    if not scored:
        return None, "no data"
    scored.sort(key=lambda item: item[0], reverse=crit.higher)
    if len(scored) == 1:
        return None, f"only one configuration with data ({scored[0][1]}, {_num(scored[0][0])}): nothing to compare"
    (_, best, best_v), (_, second, second_v) = scored[0], scored[1]
    if crit.rate:
        b_txt, s_txt, diff, separated = _rate_pair(groups[best], groups[second], crit.rate)
    else:
        sep = separation(best_v, second_v, higher=crit.higher)
        b_txt, s_txt, diff, separated = sep.best.text(), sep.runner_up.text(), sep.text(), sep.separated
    short = shortfalls(steps=None, seeds=min(_seeds(groups[best]), _seeds(groups[second])))
    body = f"best {best} {b_txt}; runner-up {second} {s_txt}; {diff}"
    if separated and not short:
        return best, f"**{best}** ({body})"
    return None, f"no winner: tied ({body}" + "".join(f"; {why}" for why in short) + ")"


def _seeds(rows: list[dict]) -> int:
    return len({r.get("seed", i) for i, r in enumerate(rows)})


def _winner(groups: dict[str, list[dict]], crit: Criterion) -> str:
    return decide(groups, crit)[1]


def _by_config(rows: list[dict]) -> dict[str, list[dict]]:
    return {label: group for (label,), group in group_rows(rows, lambda r: (config_label(r),)).items()}
