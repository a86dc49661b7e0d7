"""The rollout/trainer mismatch as the mask meets it, per mini-batch (SPEC §6b): a bounded per-token
sample for ``pdm-lab calibrate --from-run``, and the regime table logged every step.

One rollout batch is trained on over M = ``trainer.mini_batches`` optimiser steps, so mini-batch j
meets π after j steps on the same rollouts: D at mini-batch j is the engine's numerics plus j steps
of staleness. Both outputs below are taken at loss time, from the D the mask sees on mini-batch j
(the core's ``TokenStats`` of each micro-batch, π in the trainer's dtype), for every j.

**The sample.** Every ``1/RATE``-th response token of each mini-batch — at most ``MAX_PER_STEP`` per
mini-batch of a step — is appended to ``run_dir/mismatch_sample.jsonl`` as ``{"step",
"mini_batch", "d", "mu_tail", "pi_tail", "r", "adv"}``: the mini-batch index j, the top-K KL D,
the tail masses μ_T and π_T, the ratio r and Â. The toys' calibration table is computed from the
same fields (``envs.transfer.calibrate.run_table``: a row per j and the pooled row), so a toy can
be set to this engine's regime. A row without ``mini_batch`` (a sample written before the split
was recorded) is read as j = 0. Only the main rank writes; the sample is a fixed stride, no RNG.

**The regime table per mini-batch** (``MiniBatchRegime``, logged by ``train_step.update_policy``
into ``metrics.jsonl``). For each j, and pooled over j = 0 … M−1 (the regime in which the mask
acts; SPEC §6b), ``pdm_lab.audit.measure.regime_table`` on the response tokens, under the keys
``mismatch/mb{j}/…`` and ``mismatch/pooled/…``:

* ``d_p50``, ``d_p90``, ``d_p99``, ``d_p999``, ``d_max``: quantiles of D;
* ``outside_frac``: the fraction of Â ≠ 0 tokens outside the mask's δ (δ_neg for Â < 0);
  ``outside_frac@{x}`` the same at each smaller δ = x of ``llm_regime.DELTA_LADDER``;
* ``tail_ratio``: D's p99.9 / p50;
* ``topk_mass_p01``, ``topk_mass_p50``: quantiles of μ's top-K mass 1 − μ_T, and
  ``topk_mass_ge_099`` the fraction of positions where it is ≥ 0.99;
* ``tokens``: the response tokens behind the row.

Beside them, the mean keys of the step's ``mismatch/*`` (``pdm_lab.metrics.MISMATCH_KEYS``:
``topk_kl_mean``, ``topk_kl_max``, ``frac_outside``, ``ratio_min``, …) per mini-batch as
``mismatch/mb{j}/topk_kl_mean`` … and pooled as ``mismatch/pooled/topk_kl_mean`` … (exact sums over
ranks). The plain ``mismatch/*`` keys keep their meaning: mini-batch 0, before any step on the batch.
The quantiles are over at most ``REGIME_TOKENS`` tokens per mini-batch and rank (a fixed stride;
exact below it), gathered from every rank.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

RATE = 64
"""one token in RATE is kept."""
MAX_PER_STEP = 256
"""at most this many tokens per mini-batch of a step."""
REGIME_TOKENS = 1 << 16
"""the per-mini-batch regime table's quantiles: at most this many tokens per mini-batch and rank."""


class MismatchSample:
    """Appends the per-token sample; ``enabled=False`` (non-main ranks) makes it a no-op."""

    def __init__(self, run_dir: str | Path, *, enabled: bool = True):
        self.path = Path(run_dir) / "mismatch_sample.jsonl"
        self.enabled = enabled
        self._written: dict[tuple[int, int | None], int] = {}  # (step, mini-batch) → rows so far

    @torch.no_grad()
    def write(self, step: int, stats, advantages: Tensor, response_mask: Tensor, mini_batch: int | None = None) -> int:
        """Sample one micro-batch's tokens (stats: the core's ``TokenStats`` over [N] rows) of
        mini-batch ``mini_batch`` (None: the row carries no ``mini_batch``, read as 0). Returns the
        number of rows written."""
        if not self.enabled:
            return 0
        done = self._written.get((step, mini_batch), 0)
        idx = torch.nonzero(response_mask.reshape(-1).bool())[:, 0][::RATE][:max(MAX_PER_STEP - done, 0)]
        self._written[(step, mini_batch)] = done + int(idx.numel())
        where = {"step": step} if mini_batch is None else {"step": step, "mini_batch": mini_batch}
        cols = {"d": stats.topk_kl, "mu_tail": stats.mu_tail, "pi_tail": stats.pi_tail, "r": stats.ratio,
                "adv": advantages.reshape(-1)}
        values = {k: v.detach().reshape(-1)[idx].double().cpu().tolist() for k, v in cols.items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            for i in range(idx.numel()):
                f.write(json.dumps({**where, **{k: values[k][i] for k in cols}}) + "\n")
        return int(idx.numel())


class MiniBatchRegime:
    """SPEC §6b's regime table per mini-batch and pooled (module docstring), collected at loss time."""

    def __init__(self, mask_cfg):
        self.mask_cfg = mask_cfg
        self.parts: dict[int, list[tuple[Tensor, Tensor, Tensor]]] = {}

    @torch.no_grad()
    def add(self, mini_batch: int, stats, advantages: Tensor, response_mask: Tensor) -> None:
        """One micro-batch of mini-batch ``mini_batch``: the D, Â and μ_T of its response tokens."""
        rows = response_mask.reshape(-1).bool()
        self.parts.setdefault(mini_batch, []).append(
            tuple(x.detach().reshape(-1)[rows].float().cpu() for x in (stats.topk_kl, advantages, stats.mu_tail)))

    def _local(self) -> dict[int, Tensor]:
        out = {}
        for j, parts in self.parts.items():
            cols = torch.stack([torch.cat([p[i] for p in parts]) for i in range(3)])  # [3, n]: D, Â, μ_T
            stride = -(-cols.shape[1] // REGIME_TOKENS) if cols.shape[1] else 1
            out[j] = cols[:, ::stride]
        return out

    def metrics(self) -> dict[str, float]:
        """``mismatch/mb{j}/…`` and ``mismatch/pooled/…`` (the same on every rank; collective)."""
        from pdm_lab.audit.live import gather_objects

        merged: dict[int, list[Tensor]] = {}
        for local in gather_objects(self._local()):
            for j, cols in local.items():
                merged.setdefault(j, []).append(cols)
        tables = {f"mb{j}": torch.cat(merged[j], dim=1) for j in sorted(merged)}
        if tables:
            tables["pooled"] = torch.cat(list(tables.values()), dim=1)
        out = {}
        for name, cols in tables.items():
            out.update({f"mismatch/{name}/{k}": v for k, v in regime_row(cols[0], cols[1], cols[2], self.mask_cfg).items()})
        return out


def regime_row(d: Tensor, adv: Tensor, mu_tail: Tensor, mask_cfg) -> dict[str, float]:
    """The regime table (``pdm_lab.audit.measure.regime_table``) of these tokens as flat floats,
    with the outside fraction at the mask's δ and at each smaller δ of ``llm_regime.DELTA_LADDER``."""
    from pdm_lab.audit.measure import regime_table
    from pdm_lab.masks import outside_region

    from .llm_regime import DELTA_LADDER

    if d.numel() == 0:
        return {"tokens": 0.0}
    d = d.double()
    considered = adv != 0
    table = regime_table(d, outside_region(d, adv, mask_cfg) & considered, considered, topk_mass=1.0 - mu_tail.double())
    out = {f"d_{k}": v for k, v in table["d_quantiles"].items()}
    out.update(outside_frac=table["outside_fraction"], tail_ratio=table["tail_ratio"], tokens=float(table["tokens"]),
               topk_mass_p01=table["topk_mass_quantiles"]["p01"], topk_mass_p50=table["topk_mass_quantiles"]["p50"],
               topk_mass_ge_099=table["topk_mass_ge_099"])
    for x in sorted({x for x in DELTA_LADDER if x < mask_cfg.delta}, reverse=True):
        out[f"outside_frac@{x:g}"] = regime_table(d, (d > x) & considered, considered)["outside_fraction"]
    return out
