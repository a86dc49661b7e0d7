"""A resumable grid of training runs: rules × mismatch (kind, strength) × δ × K × seeds.

Layout of a results directory::

    sweep.json                      the grid that was asked for: names the sweep this folder holds
    cells/<cell_id>/config.json     the cell's TrainConfig (everything but the seed)
    cells/<cell_id>/seed_<s>.jsonl  per-step metrics, appended while the run goes
    cells/<cell_id>/seed_<s>.json   the finished run: its table row and reward curve
    results.csv, results.json       the tidy table, one ``pdm_lab.lab.results.SweepRow`` per cell × seed

A run counts as finished once ``seed_<s>.json`` exists; it is written atomically by the
coordinating process as soon as the run's result arrives. Re-running the same command skips
finished runs, so a crash or a kill loses only the runs in flight.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Annotated

from pdm_lab.config import (ConfigError, at_least, config_dataclass, from_dict, in_range, non_empty,  # field checks
                            non_negative, one_of, to_dict)
from pdm_lab.lab.locking import DirLock
from pdm_lab.lab.outputs import claim_output_dir
from pdm_lab.masks import get_mask_rule
from pdm_lab.lab.results import COLUMNS, ResultsError, SweepRow, cell_path, row_from_dict, write_results

from pdm_lab.envs.problems.mismatch import Mismatch
from pdm_lab.lab.records import plain, read_json_or_quarantine, write_json_atomic
from pdm_lab.envs.train.grpo import TrainConfig, train


@config_dataclass("")
class SweepConfig:
    """The grid. Every combination of the tuple fields is one cell; each cell runs ``seeds`` times."""

    base: TrainConfig = field(default_factory=TrainConfig)
    """everything that is not swept (problem, policy, optimiser, steps, …)."""
    rules: Annotated[tuple[str, ...], non_empty] = ("dppo_topk_kl", "pdm_uniform")
    """mask rules (pdm_lab.masks registry)."""
    mismatches: Annotated[tuple[str, ...], non_empty] = ("none", "noise:1")
    """μ's mismatch per cell, ``kind:strength`` (see ``mismatch``)."""
    base_mismatch: str = ""
    """composed into every cell's mismatch (e.g. ``stale:2``); empty for none."""
    deltas: Annotated[tuple[float, ...], non_negative, non_empty] = (0.15,)
    """δ values."""
    ks: Annotated[tuple[int, ...], at_least(1), non_empty] = (20,)
    """K values, each at most the problem's vocabulary n."""
    conventions: Annotated[tuple[str, ...], non_empty] = ("union",)
    """support conventions."""
    seeds: Annotated[int, in_range(1, 100_000)] = 3
    """runs per cell, seeds first_seed … first_seed + seeds − 1 (beyond 10⁵ is a typo: weeks of CPU)."""
    first_seed: Annotated[int, at_least(0)] = 0
    """first seed."""
    minibatches: Annotated[tuple[int, ...], at_least(1)] = ()
    """the staleness axis: M, optimiser steps per rollout batch (each cell's
    ``TrainConfig.minibatches``); empty: ``base.minibatches`` only."""
    design: str = "grid"
    """``grid``: every combination of the axes; ``axes``: the two-axis strength study — the
    mismatch axis at the first M, the staleness axis at the first mismatch (one-at-a-time from
    the anchor point ``mismatches[0]``, ``minibatches[0]``)."""
    tis_rules: tuple[str, ...] = ()
    """rules that also run with the truncated importance weight min(r, ``tis_cap``) beside their
    mask (``MaskConfig.clip_ratio_c``; labelled ``+TIS``), e.g. ``none``: TIS alone."""
    tis_cap: Annotated[float, at_least(1.0)] = 2.0
    """c of the TIS cap."""

    def __post_init__(self) -> None:
        axes = [("mismatches", spec, Mismatch.parse) for spec in self.mismatches]  # not in a worker
        axes.append(("base_mismatch", self.base_mismatch, Mismatch.parse))
        axes += [("rules", rule, lambda r: replace(self.base.mask, rule=r)) for rule in self.rules]
        axes += [("conventions", c, lambda c: replace(self.base.mask, convention=c)) for c in self.conventions]
        axes += [("tis_rules", rule, lambda r: replace(self.base.mask, rule=r)) for rule in self.tis_rules]
        one_of("design", self.design, DESIGNS)
        sequences = self.base.groups_per_step * self.base.group_size
        if self.minibatches and max(self.minibatches) > sequences:  # an empty mini-batch is no step
            raise ConfigError(f"minibatches: M = {max(self.minibatches)} exceeds the sequences per step "
                              f"(base.groups_per_step × base.group_size = {sequences})")
        for name, value, check in axes:
            try:
                check(value)
            except ValueError as err:  # named by the sweep's field, not the cell's
                raise ConfigError(f"{name}: {err}") from None
        for rule in self.rules:  # pdm_kernel's h_t needs the policy's unembedding W
            if "kernel" in get_mask_rule(rule).needs and self.base.policy == "tabular":
                raise ConfigError(f"rules: {rule!r} needs the policy's unembedding W, which base.policy: tabular has "
                                  "none of; use base.policy=neural or transformer")
        vocab = self.base.problem.vocab_size
        if max(self.ks) > vocab:
            raise ConfigError(f"ks: K = {max(self.ks)} exceeds the vocabulary (base.problem."
                              f"{self.base.problem.kind}.vocab_size = {vocab})")

    def cells(self) -> list[TrainConfig]:
        """One TrainConfig per cell (seed 0; the seed is set per run).

        A rule whose declared record reads no δ (``MaskRule.uses_delta``), or whose drops do not
        change with K and the convention (``uses_k``), gets one value of that axis (the first)
        instead of repeats of one run.
        """
        out = []
        variants = [(rule, self.base.mask.clip_ratio_c) for rule in self.rules]
        variants += [(rule, self.tis_cap) for rule in self.tis_rules]
        for rule, cap in variants:
            record = get_mask_rule(rule)
            deltas = self.deltas if record.uses_delta else self.deltas[:1]
            ks = self.ks if record.uses_k else self.ks[:1]
            conventions = self.conventions if record.uses_k else self.conventions[:1]
            for spec, m in self.points():
                for delta in deltas:
                    for k in ks:
                        for convention in conventions:
                            mask = replace(self.base.mask, rule=rule, delta=delta, k=k,
                                           convention=convention, clip_ratio_c=cap)
                            out.append(replace(self.base, mask=mask, seed=0, minibatches=m,
                                               mismatch=compose(spec, self.base_mismatch)))
        return out

    def points(self) -> list[tuple[str, int]]:
        """(mismatch, M) of every grid point: the cross product (``design: grid``) or the two
        axes through the anchor ``(mismatches[0], minibatches[0])`` (``design: axes``)."""
        ms = self.minibatches or (self.base.minibatches,)
        if self.design == "grid":
            return [(spec, m) for spec in self.mismatches for m in ms]
        return [(spec, ms[0]) for spec in self.mismatches] + [(self.mismatches[0], m) for m in ms[1:]]

    @property
    def seed_list(self) -> list[int]:
        return list(range(self.first_seed, self.first_seed + self.seeds))


#: How the grid's points are laid out (``SweepConfig.design``).
DESIGNS = ("grid", "axes")


def compose(spec: str, base: str) -> str:
    """``spec`` + ``base`` as one mismatch string (``none`` parts dropped)."""
    parts = [str(Mismatch.parse(s)) for s in (spec, base) if s and str(Mismatch.parse(s)) != "none"]
    return "+".join(parts) or "none"


def cell_id(cfg: TrainConfig) -> str:
    """12 hex digits of the SHA-1 of the cell's canonical JSON (seed excluded)."""
    doc = to_dict(replace(cfg, seed=0))
    return hashlib.sha1(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:12]


def mismatch_axis(spec: str) -> tuple[str, float]:
    """(kind, strength) of a cell's first mismatch source: the sweep's mismatch axis."""
    sources = Mismatch.parse(spec).sources
    if not sources:
        return "none", 0.0
    return sources[0].kind, sources[0].strength


@dataclass(frozen=True)
class RunJob:
    """One run for an executor: a cell config, its seed and where its step log goes."""

    cell_id: str
    seed: int
    config: dict
    log_path: str


def run_job(job: RunJob) -> dict:
    """Executor entry point: train one cell × seed; returns its table row and reward curve."""
    cfg = replace(from_dict(TrainConfig, job.config), seed=job.seed)
    result = train(cfg, log_path=job.log_path)
    curve = result.pop("curve")
    kind, strength = mismatch_axis(cfg.mismatch)
    row = {
        "cell_id": job.cell_id, "seed": job.seed, "problem": cfg.problem.kind, "policy": cfg.policy,
        "rule": cfg.mask.rule, "delta": cfg.mask.delta, "k": cfg.mask.k,
        "convention": cfg.mask.convention, "estimator": cfg.mask.direction_estimator,
        "mismatch": cfg.mismatch, "mismatch_kind": kind, "mismatch_strength": strength,
        "optimizer": cfg.optimizer, "lr": cfg.lr, "steps": cfg.steps, "epochs": cfg.epochs,
        "minibatches": max(cfg.minibatches, Mismatch.parse(cfg.mismatch).stale_steps),
        "clip_ratio_c": math.nan if cfg.mask.clip_ratio_c is None else float(cfg.mask.clip_ratio_c),
        **result,
    }
    expected = result["steps_done"] * cfg.epochs * row["minibatches"]
    if not result["nonfinite"] and result["optimizer_steps"] != expected:  # the staleness axis is real
        raise RuntimeError(f"cell {job.cell_id} seed {job.seed}: the trainer took {result['optimizer_steps']} "
                           f"optimiser steps, expected {expected} ({result['steps_done']} rollout batches × "
                           f"{cfg.epochs} epoch(s) × M = {row['minibatches']})")
    typed = row_from_dict({c: row[c] for c in COLUMNS if c in row}, f"cell {job.cell_id} seed {job.seed}")
    return {"row": asdict(typed), "curve": curve}


def run_path(out: Path, cid: str, seed: int) -> Path:
    return cell_path(out, cid, f"seed_{seed}.json")


def read_run(path: Path) -> dict | None:
    """A finished run's record; None if missing or corrupt (then named and moved aside)."""
    return read_json_or_quarantine(path, valid=lambda doc: isinstance(doc, dict) and "row" in doc)


def pending_jobs(cfg: SweepConfig, out: Path) -> tuple[list[RunJob], int]:
    """Jobs not yet finished in ``out`` (writes each cell's config.json), and the total count."""
    jobs, total = [], 0
    for cell in cfg.cells():
        cid = cell_id(cell)
        cell_dir = cell_path(out, cid)
        if not (cell_dir / "config.json").exists():
            write_json_atomic(cell_dir / "config.json", to_dict(cell))
        for seed in cfg.seed_list:
            total += 1
            if read_run(run_path(out, cid, seed)) is None:  # missing, or corrupt (moved aside)
                jobs.append(RunJob(cid, seed, to_dict(cell), str(cell_dir / f"seed_{seed}.jsonl")))
    return jobs, total


#: What a sweep writes at the top of its folder (another grid's are refused without ``force``).
PRODUCTS = ("results.json", "results.csv", "report.md")
#: Fields that grow a grid rather than change it: more seeds of the same cells resume it.
GROWS = ("seeds", "first_seed")


def claim_out(cfg: SweepConfig, out: Path, *, force: bool = False) -> None:
    """Refuse ``out`` when it holds another grid's table or report (``sweep.json`` differs beyond
    the seed range): the sweep would overwrite them (``pdm_lab.lab.outputs``)."""
    claim_output_dir(out, marker="sweep.json", identity=to_dict(cfg), products=PRODUCTS, what="sweep",
                     ignore=GROWS, force=force)


def run_sweep(cfg: SweepConfig, out: str | Path, *, executor=None, progress: bool = True,
              force: bool = False) -> dict:
    """Run every unfinished cell × seed, storing each result as it arrives; then the table.

    ``out`` holding another grid's results is refused unless ``force`` (``claim_out``).

    Returns:
        ``{"total": runs in the grid, "skipped": already finished, "ran": finished now,
        "wall_s": seconds}``.
    """
    out = Path(out)
    with DirLock(out, what="sweep output"):  # one sweep per --out: no cell runs twice
        claim_out(cfg, out, force=force)
        return _run_sweep_locked(cfg, out, executor, progress)


def _run_sweep_locked(cfg: SweepConfig, out: Path, executor, progress: bool) -> dict:
    from pdm_lab.envs.sweep.executors import LocalExecutor

    write_json_atomic(out / "sweep.json", to_dict(cfg))
    jobs, total = pending_jobs(cfg, out)
    executor = executor or LocalExecutor()
    start = time.perf_counter()
    bar = None
    if progress and jobs:
        from tqdm import tqdm
        bar = tqdm(total=len(jobs), desc="sweep", unit="run", dynamic_ncols=True)
    ran = 0
    try:
        for job, result in executor.run(run_job, jobs):
            write_json_atomic(run_path(out, job.cell_id, job.seed), result)
            ran += 1
            if bar is not None:
                row = result["row"]
                bar.set_postfix_str(f"{row['rule']} {row['mismatch']} reward={row['final_reward']:.2f}")
                bar.update()
    finally:
        if bar is not None:
            bar.close()
    write_table(cfg, out)
    return {"total": total, "skipped": total - len(jobs), "ran": ran,
            "wall_s": time.perf_counter() - start}


def load_runs(cfg: SweepConfig, out: str | Path) -> list[dict]:
    """Finished runs of this grid in ``out``: ``{"row": …, "curve": […]}`` each, in grid order."""
    out = Path(out)
    runs = []
    for cell in cfg.cells():
        cid = cell_id(cell)
        for seed in cfg.seed_list:
            run = read_run(run_path(out, cid, seed))
            if run is not None:
                runs.append(run)
    return runs


def write_table(cfg: SweepConfig, out: str | Path) -> list[SweepRow]:
    """results.csv and results.json (``pdm_lab.lab.results``): one typed row per finished cell × seed."""
    out = Path(out)
    try:
        rows = [row_from_dict(run["row"], str(run_path(out, run["row"]["cell_id"], run["row"]["seed"])))
                for run in load_runs(cfg, out)]
    except ResultsError as err:  # a run stored by an older pdm_lab (another schema)
        raise ResultsError(f"{err} (stored by another pdm_lab version: use a new --out)") from None
    return write_results(out, rows)

