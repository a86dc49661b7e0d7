"""Re-running the main command just works: the same grid resumes, another grid's folder is moved
aside under a dated name (``--move-aside``, as ``make run`` runs it), a run that went non-finite
is marked in the report and the exit status, and the regime cache is keyed by everything the
table was computed from."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from pdm_lab.cli import main as cli

TINY_GRID = ["sweep", "rules=[none]", "mismatches=[none]", "tis_rules=[]", "minibatches=[1]", "base.steps=2", "base.groups_per_step=4",
             "base.group_size=4", "base.eval_sequences=16", "--seeds", "1", "--no-audit", "--quiet",
             "--workers", "1"]


def sweep(out: Path, *extra: str) -> int:
    try:
        return cli.main([*TINY_GRID, *extra, "--out", str(out)])
    except SystemExit as stop:
        return int(stop.code)


def test_rerun_move_aside_and_nonfinite(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "sweep-quick"
    assert sweep(out) == 0
    assert sweep(out) == 0 and "0 runs now, 1 reused" in capsys.readouterr().out  # twice in a row
    # a grid change (an upgrade): refused without --move-aside, leaving the folder as it was
    assert sweep(out, "base.steps=3") == 2 and "different sweep" in capsys.readouterr().err
    assert sweep(out, "base.steps=3", "--move-aside") == 0
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("sweep-quick.")]
    assert len(moved) == 1 and (moved[0] / "results.json").exists()
    assert json.loads((out / "sweep.json").read_text())["base"]["steps"] == 3
    # a run that went non-finite (its stored record, as the loop writes it): report and status say so
    record_path = next(out.glob("cells/*/seed_0.json"))
    record = json.loads(record_path.read_text())
    record["row"].update(nonfinite=True, final_reward=math.nan, collapsed=True)
    record_path.write_text(json.dumps(record))
    assert sweep(out, "base.steps=3") == 3
    assert "went non-finite" in capsys.readouterr().err
    assert "**1 of 1 runs went non-finite**" in (out / "report.md").read_text()


def test_regime_key_is_the_full_specification():
    from pdm_lab.envs.audit.study import AuditConfig
    from pdm_lab.envs.pipeline import regime_key

    base = AuditConfig(mismatch="noise:1", sequences=64, group_size=4)
    other_problem = replace(base, problem=replace(base.problem, bandit=replace(base.problem.bandit, seed=1)))
    assert regime_key(base, 1) == regime_key(replace(base), 1)
    assert len({regime_key(base, 1), regime_key(other_problem, 1), regime_key(replace(base, mismatch="noise:2"), 1),
                regime_key(base, 2), regime_key(replace(base, k=5), 1)}) == 5
