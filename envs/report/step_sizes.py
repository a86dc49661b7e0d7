"""The step-size figure of SPEC §6d: each rule's unsafe-keep against the step's median |ΔD|/D.

One point per audited step size (``steps/…`` records: the toy's ``audit.json["step_scales"]`` or a
loop line's ``step_scales``), with Wilson 95% bars, beside the two controls (outside tokens every
rule kept; the momentum-only step). Where median |ΔD|/D is well below 1 the step is first order
and a direction test can matter; where it is above 1 the step overshoots whatever the mask.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def step_size_rows(records: dict) -> list[dict]:
    """Scale → ``step_scale_record`` as rows sorted by median |ΔD|/D: x, and per series (each rule
    and the controls) its rate with Wilson bounds and count."""
    rows = []
    for rec in records.values():
        x = rec["steps/median_abs_dd_over_d"]["value"]
        series = {}
        for key, entry in rec.items():
            if key.startswith("steps/unsafe_keep/") or key.startswith("steps/control/"):
                name = key.removeprefix("steps/unsafe_keep/").removeprefix("steps/control/")
                series[name] = {"rate": entry["unsafe_keep"], "lo": entry["lo"], "hi": entry["hi"],
                                "n": entry["count"]}
        rows.append({"scale": rec["steps/lr_scale"], "x": x, "series": series})
    return sorted(rows, key=lambda r: r["x"])


def step_size_figure(records: dict, path: Path, title: str = "") -> Path:
    """Draw ``step_size_rows(records)`` into `path` (PNG)."""
    rows = step_size_rows(records)
    fig, ax = plt.subplots(figsize=(5.4, 3.8))
    names = list(dict.fromkeys(n for r in rows for n in r["series"]))
    for name in names:
        pts = [(r["x"], r["series"][name]) for r in rows if name in r["series"] and r["series"][name]["n"]]
        if not pts:
            continue
        xs = [x for x, _ in pts]
        ys = [s["rate"] for _, s in pts]
        # Wilson bounds can sit a rounding error inside the rate at 0 or 1
        err = [[max(s["rate"] - s["lo"], 0.0) for _, s in pts], [max(s["hi"] - s["rate"], 0.0) for _, s in pts]]
        style = "--" if name in ("kept_by_all", "momentum_only") else "-"
        ax.errorbar(xs, ys, yerr=err, fmt="o" + style, capsize=3, ms=4, lw=1, label=name)
    ax.set_xscale("log")
    ax.axvline(1.0, color="grey", lw=0.6)
    ax.set_xlabel("median |ΔD|/D of the audited step (outside tokens)")
    ax.set_ylabel("unsafe-keep (ΔD > tol), Wilson 95%")
    ax.set_ylim(-0.02, 1.02)
    if title:
        ax.set_title(title, fontsize=9)
    if names:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
