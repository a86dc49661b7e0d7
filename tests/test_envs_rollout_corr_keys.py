"""The toys log verl's ``rollout_corr/*`` set as the loop does: every key of ``ROLLOUT_CORR_KEYS``
with a TIS cap, all but ``rollout_is_*`` without one (verl computes those only with a threshold),
from the same ``as_mismatch`` the loop's ``train_step`` calls."""
from __future__ import annotations

import dataclasses
import json

import pytest

from pdm_lab.envs.problems.problem import ProblemConfig
from pdm_lab.envs.train.grpo import TrainConfig, train
from pdm_lab.rollout_corr import ROLLOUT_CORR_KEYS


@pytest.mark.parametrize("cap", [None, 2.0])
def test_a_toy_run_logs_the_loops_rollout_corr_set(tmp_path, cap):
    cfg = TrainConfig(problem=ProblemConfig(kind="bandit"), steps=2, groups_per_step=4, group_size=4,
                      mismatch="noise:0.5")
    cfg = dataclasses.replace(cfg, mask=dataclasses.replace(cfg.mask, clip_ratio_c=cap))
    train(cfg, log_path=tmp_path / "log.jsonl")
    records = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    want = {v for v in ROLLOUT_CORR_KEYS.values() if cap is not None or not v.startswith("rollout_corr/rollout_is_")}
    for record in records:
        assert {k for k in record if k.startswith("rollout_corr/")} == want
    assert len(want) == (16 if cap else 11)
