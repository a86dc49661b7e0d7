"""The two-axis strength study: the staleness axis really trains M optimiser steps per rollout
batch, and the summary's "first degrades" / "separates" lines come from the intervals."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from pdm_lab.envs.problems.bandit import BanditConfig
from pdm_lab.envs.problems.problem import ProblemConfig
from pdm_lab.envs.report import strength
from pdm_lab.envs.sweep import grid
from pdm_lab.envs.sweep.grid import RunJob, SweepConfig, cell_id, run_job
from pdm_lab.envs.train import grpo
from pdm_lab.envs.train.grpo import TrainConfig
from pdm_lab.config import to_dict

TINY = TrainConfig(problem=ProblemConfig(kind="bandit", bandit=BanditConfig(vocab_size=32, num_prompts=4)),
                   policy="neural", steps=2, groups_per_step=4, group_size=4, eval_sequences=64,
                   track_unsafe_keep=False)


def _count_steps(monkeypatch) -> list[int]:
    """Every optimiser step the trainer takes, counted at torch's optimiser (not by the trainer)."""
    calls = [0]
    real = grpo.make_optimizer

    def counting(name, params, lr):
        opt = real(name, params, lr)
        step = opt.step

        def counted(*a, **k):
            calls[0] += 1
            return step(*a, **k)
        opt.step = counted
        return opt
    monkeypatch.setattr(grpo, "make_optimizer", counting)
    return calls


def test_axes_design_lays_out_two_axes_through_the_anchor():
    cfg = SweepConfig(base=TINY, rules=("none",), tis_rules=("none",), mismatches=("none", "noise:0.5"),
                      minibatches=(1, 2, 4), design="axes", seeds=1)
    assert cfg.points() == [("none", 1), ("noise:0.5", 1), ("none", 2), ("none", 4)]
    cells = cfg.cells()
    assert len(cells) == 2 * 4 and sorted({c.minibatches for c in cells}) == [1, 2, 4]
    assert {c.mask.clip_ratio_c for c in cells} == {None, 2.0}  # TIS beside the plain rule
    assert len(replace(cfg, design="grid").cells()) == 2 * 2 * 3


@pytest.mark.parametrize("m", [1, 4, 8])
def test_staleness_axis_takes_m_optimiser_steps_per_rollout_batch(monkeypatch, tmp_path, m):
    calls = _count_steps(monkeypatch)
    cell = replace(TINY, minibatches=m)
    out = run_job(RunJob(cell_id(cell), 0, to_dict(cell), str(tmp_path / "log.jsonl")))
    assert calls[0] == TINY.steps * m  # counted at the optimiser
    assert out["row"]["optimizer_steps"] == TINY.steps * m and out["row"]["minibatches"] == m


def test_a_planted_single_step_trainer_fails_the_check(monkeypatch, tmp_path):
    """A trainer that ignores M (one optimiser step per rollout batch) is caught by the sweep."""
    real = grpo.train

    def single_step(cfg, **kw):
        return real(replace(cfg, minibatches=1), **kw)
    monkeypatch.setattr(grid, "train", single_step)
    calls = _count_steps(monkeypatch)
    cell = replace(TINY, minibatches=4)
    with pytest.raises(RuntimeError, match="expected 8"):
        run_job(RunJob(cell_id(cell), 0, to_dict(cell), str(tmp_path / "log.jsonl")))
    assert calls[0] == TINY.steps  # it really stepped once per batch


def _row(rule: str, mismatch: str, m: int, seed: int, reward: float, collapsed: bool = False,
         outside: float = 0.003, tail: float = 100.0) -> dict:
    return {"rule": rule, "delta": 0.15, "k": 20, "convention": "union", "mismatch": mismatch, "minibatches": m,
            "seed": seed, "final_reward": reward, "collapsed": collapsed, "steps": 30, "epochs": 1,
            "optimizer_steps": 30 * m, "nonfinite": False, "outside_fraction": 0.0 if mismatch == "none" and m == 1
            else outside, "update_tail_ratio": tail, "clip_ratio_c": math.nan}


NOISE = [-0.01, 0.0, 0.01, 0.005, -0.005]


def _study(rewards: dict) -> list[dict]:
    """rewards: (rule, mismatch, M) → mean; five seeds each with the same small spread."""
    return [_row(rule, mm, m, s, mean + NOISE[s]) for (rule, mm, m), mean in rewards.items() for s in range(5)]


def test_first_degrades_and_separates_come_from_the_intervals():
    rows = _study({("none", "none", 1): 0.5, ("pdm_topk", "none", 1): 0.5,
                   ("none", "lognormal:0.1", 1): 0.495, ("pdm_topk", "lognormal:0.1", 1): 0.5,  # inside the noise
                   ("none", "lognormal:1", 1): 0.2, ("pdm_topk", "lognormal:1", 1): 0.45,      # far below
                   ("none", "none", 4): 0.5, ("pdm_topk", "none", 4): 0.5})
    study = strength.axes(rows)
    assert [p.label for p in study["precision"]] == ["none", "lognormal:0.1", "lognormal:1"]
    assert [p.m for p in study["staleness"]] == [1, 4]
    point, words = strength.first_degrades(study["precision"], "none")
    assert point.label == "lognormal:1" and words.startswith("**lognormal:1**")
    point, found = strength.first_separation(study["precision"])
    assert point.label == "lognormal:1" and [(p.a, p.b, p.what) for p in found] == [("none", "pdm_topk δ=0.15", "reward")]
    assert found[0].hi < 0
    table = "\n".join(strength.summary_rows(rows))
    assert "first at **lognormal:1**" in table and "none − pdm_topk δ=0.15 reward -0.250" in table
    # the staleness axis ties everywhere: said so, with the detectable difference
    assert "staleness axis: where rules separate | – | no pair of rules separates at any point" in table


def test_a_planted_tie_is_not_called_a_separation():
    """Means 0.1 apart but seeds spread ±0.3: the Welch interval includes 0, so no separation —
    and a point estimate below the anchor is not "degraded" while the intervals overlap."""
    spread = [-0.3, 0.3, -0.2, 0.2, 0.0]
    rows = [_row(rule, mm, 1, s, mean + spread[s])
            for (rule, mm), mean in {("none", "none"): 0.5, ("pdm_topk", "none"): 0.5,
                                     ("none", "x:1"): 0.4, ("pdm_topk", "x:1"): 0.5}.items() for s in range(5)]
    study = strength.axes(rows)
    assert strength.first_separation(study["precision"]) == (None, [])
    assert strength.first_degrades(study["precision"], "none")[0] is None
    mdd = study["precision"][1].mdd()
    assert mdd > 0.1  # the tie is below what these seeds can detect
    line = strength.powered_null(study)  # x:1 lies in the band (0.3% outside, tail 100): a powered null
    assert line is not None and "powered null" in line and f"{mdd:.3f}" in line
    assert "where rules separate | – | no pair" in "\n".join(strength.summary_rows(rows))


def test_too_few_seeds_never_separate():
    rows = [_row(rule, "x:1", 1, s, mean) for (rule, mean) in (("none", 0.1), ("pdm_topk", 0.9)) for s in range(2)]
    rows += [_row(rule, "none", 1, s, 0.5) for rule in ("none", "pdm_topk") for s in range(2)]
    study = strength.axes(rows)
    assert not any(p.separated for p in strength.pairs(study["precision"][1]))


def test_trainer_reports_a_tail_ratio():
    torch.manual_seed(0)
    out = grpo.train(replace(TINY, mismatch="noise:1"))
    assert out["optimizer_steps"] == TINY.steps and out["update_tail_ratio"] > 1


def test_the_summary_closing_line_counts_the_studys_separations():
    """A separated pair in the strength study is a finding the summary's closing line names, with
    the number of comparisons made (the planted bug: a report that looked only at its audits said
    "no finding" beside a separated study)."""
    from pdm_lab.envs.report.summary_table import summary_lines

    separated = _study({("none", "none", 1): 0.5, ("pdm_topk", "none", 1): 0.5,
                        ("none", "lognormal:1", 1): 0.2, ("pdm_topk", "lognormal:1", 1): 0.45})
    assert strength.separation_count(separated) == (1, 4)  # reward and collapse at 2 points, 1 pair
    text = "\n".join(summary_lines(separated, {}, None, None))
    assert "Separated (the interval excludes 0): 1 of 4 rule-pair comparisons of the strength study" in text
    assert "No finding" not in text
    tied = _study({("none", "none", 1): 0.5, ("pdm_topk", "none", 1): 0.5,
                   ("none", "lognormal:1", 1): 0.5, ("pdm_topk", "lognormal:1", 1): 0.5})
    assert strength.separation_count(tied)[0] == 0
    assert "No finding here has an interval that excludes 0." in "\n".join(summary_lines(tied, {}, None, None))
