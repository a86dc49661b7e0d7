"""PNG figures of a sweep (and of an audit), drawn with matplotlib's Agg backend."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from pdm_lab.envs.report.summary import (collapse_rate, config_label, group_rows, mean_ci, mismatch_label,  # noqa: E402,F401
                                         point_label, wilson_ci)

X_LABEL = "realised mismatch: mean top-K KL(μ‖π) at update time"


def _panels(count: int, width: float = 4.2, height: float = 3.2):
    cols = min(count, 3)
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _colors(labels: list[str]) -> dict[str, tuple]:
    cmap = plt.get_cmap("tab10")
    return {label: cmap(i % 10) for i, label in enumerate(labels)}


def _legend_or_na(axes) -> None:
    """The legend, or "n/a" where no panel has a line (e.g. a collapse rate on runs too short for
    the definition: every value is n/a)."""
    if any(ax.get_legend_handles_labels()[0] for ax in axes):
        axes[0].legend(fontsize=8)
    else:
        axes[0].text(0.5, 0.5, "n/a: no finite value to plot", ha="center", va="center",
                     transform=axes[0].transAxes)


def learning_curves(runs: list[dict], path: Path) -> Path:
    """Mean training reward per step (± 1.96 s.e. over seeds), a panel per mismatch setting."""
    rows = [dict(run["row"], curve=run["curve"]) for run in runs]
    by_mismatch = group_rows(rows, lambda r: (point_label(r),))
    labels = list(dict.fromkeys(config_label(r) for r in rows))
    colors = _colors(labels)
    fig, axes = _panels(len(by_mismatch))
    for ax, ((mismatch,), group) in zip(axes, by_mismatch.items()):
        for label, cell in group_rows(group, lambda r: (config_label(r),)).items():
            curves = [r["curve"] for r in cell if r["curve"]]
            if not curves:
                continue
            length = min(len(c) for c in curves)
            data = torch.tensor([c[:length] for c in curves], dtype=torch.float64)
            mean = data.mean(dim=0)
            half = 1.96 * data.std(dim=0, unbiased=True) / math.sqrt(len(curves)) if len(curves) > 1 else torch.zeros_like(mean)
            steps = range(length)
            ax.plot(steps, mean, color=colors[label[0]], label=label[0], lw=1.5)
            ax.fill_between(steps, mean - half, mean + half, color=colors[label[0]], alpha=0.2)
        ax.set_title(f"mismatch: {mismatch}", fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel("mean reward of the batch")
        ax.grid(alpha=0.3)
    _legend_or_na(axes)
    return _save(fig, path)


def _vs_mismatch(rows: list[dict], metric: Callable[[list[dict]], tuple[float, float, float]],
                 ylabel: str, path: Path) -> Path:
    """metric(cell rows) → (value, lo, hi) against realised mismatch; a panel per mismatch kind."""
    kinds = [k for k in dict.fromkeys(r["mismatch_kind"] for r in rows) if k != "none"] or ["none"]
    labels = list(dict.fromkeys(config_label(r) for r in rows))
    colors = _colors(labels)
    fig, axes = _panels(len(kinds))
    for ax, kind in zip(axes, kinds):
        subset = [r for r in rows if r["mismatch_kind"] in (kind, "none")]
        for label, cfg_rows in group_rows(subset, lambda r: (config_label(r),)).items():
            points = []
            for _, cell in group_rows(cfg_rows, lambda r: (r["mismatch"], r["minibatches"])).items():
                x = mean_ci((r["update_topk_kl_mean"] for r in cell), n_boot=200)[0]
                points.append((x, *metric(cell)))
            points = sorted(p for p in points if not math.isnan(p[0]) and not math.isnan(p[1]))
            if not points:
                continue
            xs, ys, lo, hi = zip(*points)
            ax.plot(xs, ys, "o-", color=colors[label[0]], label=label[0], lw=1.5, ms=4)
            ax.fill_between(xs, lo, hi, color=colors[label[0]], alpha=0.18)
        ax.set_title(f"mismatch kind: {kind}", fontsize=10)
        ax.set_xlabel(X_LABEL, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    _legend_or_na(axes)
    return _save(fig, path)


def sweep_figures(runs: list[dict], out: Path) -> dict[str, Path]:
    """All sweep figures into ``out``; returns name → path."""
    rows = [run["row"] for run in runs]
    figs = {"learning_curves": learning_curves(runs, out / "learning_curves.png")}
    figs["final_reward"] = _vs_mismatch(
        rows, lambda cell: mean_ci(r["final_reward"] for r in cell), "final reward of π (95% CI)",
        out / "final_reward_vs_mismatch.png")
    figs["collapse"] = _vs_mismatch(
        rows, collapse_rate, "collapse rate (Wilson 95% CI)", out / "collapse_vs_mismatch.png")
    figs["unsafe_keep"] = _vs_mismatch(
        rows, lambda cell: mean_ci(r["unsafe_keep"] for r in cell), "unsafe-keep rate (95% CI)",
        out / "unsafe_keep_vs_mismatch.png")
    figs["mask_fraction"] = _vs_mismatch(
        rows, lambda cell: mean_ci(r["mask_fraction"] for r in cell), "fraction of tokens masked",
        out / "mask_fraction_vs_mismatch.png")
    figs.update(strength_figures(rows, out))
    return figs


def strength_figures(rows: list[dict], out: Path) -> dict[str, Path]:
    """The two-axis strength study (``envs.report.strength``): final reward (Student-t 95% band)
    and collapse rate (Wilson 95% band) of each rule against each axis, SPEC §6b's realistic
    points shaded; nothing when the grid has no axis of ≥ 2 points."""
    from pdm_lab.envs.report.strength import axes as study_axes
    from pdm_lab.lab.evidence import mean_t_ci

    study = study_axes(rows)
    if not study:
        return {}
    labels = list(dict.fromkeys(config_label(r) for r in rows))
    colors = _colors(labels)

    def reward(cell):
        e = mean_t_ci(r["final_reward"] for r in cell)
        return (e.mean, e.lo, e.hi) if not math.isnan(e.lo) else (e.mean, e.mean, e.mean)

    figs = {}
    for name, metric, ylabel in (("strength_reward", reward, "final reward of π (95% t band)"),
                                 ("strength_collapse", collapse_rate, "collapse rate (95% Wilson band)")):
        fig, panels = _panels(len(study), width=5.0, height=3.6)
        for ax, (axis, points) in zip(panels, study.items()):
            xs = [p.m for p in points] if axis == "staleness" else list(range(len(points)))
            real = [x for x, p in zip(xs, points) if p.realistic]
            if real:  # the realistic band: the span of the points in SPEC §6b's band
                pad = 0.25 if axis == "precision" else 0.0
                lo, hi = (min(real) - pad, max(real) + pad) if axis == "precision" else (min(real) / 1.3, max(real) * 1.3)
                ax.axvspan(lo, hi, color="0.85", zorder=0, label="realistic (SPEC §6b)")
            for label in labels:
                pts = [(x, *metric(p.by_rule()[label])) for x, p in zip(xs, points) if label in p.by_rule()]
                pts = [q for q in pts if not math.isnan(q[1])]
                if not pts:
                    continue
                x, y, lo, hi = zip(*pts)
                ax.plot(x, y, "o-", color=colors[label], label=label, lw=1.5, ms=4)
                ax.fill_between(x, lo, hi, color=colors[label], alpha=0.15)
            if axis == "staleness":
                ax.set_xscale("log", base=2)
                ax.set_xticks(xs, [str(x) for x in xs])
                ax.set_xlabel(f"M: optimiser steps per rollout batch (mismatch {points[0].mismatch})", fontsize=8)
            else:
                ax.set_xticks(xs, [p.label for p in points], rotation=20, fontsize=7)
                ax.set_xlabel(f"precision mismatch (M = {points[0].m})", fontsize=8)
            ax.set_title(f"{axis} axis", fontsize=10)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.grid(alpha=0.3)
        _legend_or_na(panels)
        figs[name] = _save(fig, out / f"{name}.png")
    return figs


def audit_figures(doc: dict, out: Path) -> dict[str, Path]:
    """Per-seed unsafe-keep of the main pair (paired dots) and the K sweep with μ_T."""
    figs = {}
    pair = doc["pairs"][0]
    a, b = pair["a"], pair["b"]
    xa, xb = pair[a]["unsafe_keep_per_seed"], pair[b]["unsafe_keep_per_seed"]
    fig, ax = plt.subplots(figsize=(4.6, 4.2))
    ok = [(x, y) for x, y in zip(xa, xb) if x is not None and y is not None
          and not (math.isnan(x) or math.isnan(y))]
    if ok:
        xs, ys = zip(*ok)
        ax.scatter(xs, ys, s=14, alpha=0.7)
    ax.plot([0, 1], [0, 1], "k--", lw=0.8)
    ax.set_xlabel(f"{a}: unsafe-keep per seed")
    ax.set_ylabel(f"{b}: unsafe-keep per seed")
    ax.set_title(f"below the diagonal: {b} lower", fontsize=9)
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.02, 1.02)
    figs["audit_per_seed"] = _save(fig, out / "audit_per_seed.png")
    if len(doc.get("step_scales") or {}) > 1:  # SPEC §6d: unsafe-keep against the step's |ΔD|/D
        from pdm_lab.envs.report.step_sizes import step_size_figure

        figs["audit_step_sizes"] = step_size_figure(doc["step_scales"], out / "audit_step_sizes.png")
    points = doc.get("trajectory") or []
    if points:
        figs["audit_trajectory"] = audit_trajectory(points, (a, b), out / "audit_trajectory.png")
    ks = doc["studies"].get("k_sweep") or []
    if ks:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
        kv = [row["k"] for row in ks]
        for rule in (a, b):
            ax1.plot(kv, [row[rule]["unsafe_keep_pooled"] for row in ks], "o-", label=rule)
        ax1.set_xscale("log")
        ax1.set_xlabel("K")
        ax1.set_ylabel("unsafe-keep (pooled)")
        ax1.legend(fontsize=8)
        ax1.grid(alpha=0.3)
        stats = []
        for row in ks:  # token quantiles of μ_T, averaged over seeds
            qs = [q for q in row["mu_tail_quantiles"] if q.get("count")]
            avg = {key: sum(q[key] for q in qs) / len(qs) for key in ("q05", "q25", "q50", "q75", "q95")}
            stats.append({"label": str(row["k"]), "whislo": avg["q05"], "q1": avg["q25"], "med": avg["q50"],
                          "q3": avg["q75"], "whishi": avg["q95"], "fliers": []})
        ax2.bxp(stats, showfliers=False)
        ax2.set_xlabel("K")
        ax2.set_ylabel("μ tail mass μ_T over tokens (5–95%)")
        ax2.grid(alpha=0.3)
        figs["audit_k_sweep"] = _save(fig, out / "audit_k_sweep.png")
    return figs


def audit_trajectory(points: list[dict], rules: tuple[str, ...], path: Path) -> Path:
    """Unsafe-keep of each rule (pooled over the point's seeds, Wilson 95% CI over its kept
    disagreement tokens) against the training step of the audit point."""
    fig, ax = plt.subplots(figsize=(5.2, 3.8))
    colors = _colors(list(rules))
    for rule in rules:
        xs, ys, lo, hi = [], [], [], []
        for p in points:
            kept, rate = p[rule]["kept_disagreement_tokens"], p[rule]["unsafe_keep_pooled"]
            if not kept or rate is None or math.isnan(rate):
                continue
            low, high = wilson_ci(round(rate * kept), kept)[1:]
            xs.append(p["step"])
            ys.append(rate)
            lo.append(low)
            hi.append(high)
        if xs:
            ax.plot(xs, ys, "o-", color=colors[rule], label=rule, lw=1.5, ms=4)
            ax.fill_between(xs, lo, hi, color=colors[rule], alpha=0.18)
    ax.set_xlabel("training step of the audit point (plain GRPO under the mismatch)")
    ax.set_ylabel("unsafe-keep on disagreement tokens")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
