"""Every bad input to the command line is one line naming the input and exit status 2, never a
traceback (issue 9). Table-driven, end to end: the real ``pdm-lab`` run as a user would."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdm_lab.runtime.locking import DirLock

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "scaling" / "configs" / "tiny-cpu.yaml"
Q4B = REPO / "scaling" / "configs" / "qwen3-4b-base-dapo.yaml"

#: (case id, argv after ``pdm-lab``, text the one error line must contain). ``{tmp}``: the case's
#: working directory, holding the files written by ``_files``.
TABLE = [
    ("yaml-malformed", ["train", "--config", "{tmp}/bad.yaml"], "bad.yaml"),
    ("yaml-python-tag", ["train", "--config", "{tmp}/evil.yaml"], "python/object"),
    ("config-missing", ["train", "--config", "{tmp}/nope.yaml"], "nope.yaml"),
    ("plugin-missing", ["train", "--config", str(TINY), "plugins=[no_such_plugin_xyz]"], "no_such_plugin_xyz"),
    ("delta-nan", ["train", "--config", str(TINY), "mask.delta=.nan"], "mask.delta"),
    ("delta-neg-nan", ["train", "--config", str(TINY), "mask.delta_neg=.nan"], "mask.delta_neg"),
    ("lr-nan", ["train", "--config", str(TINY), "trainer.lr=.nan"], "trainer.lr"),
    ("temperature-inf", ["train", "--config", str(TINY), "rollout.temperature=.inf"], "rollout.temperature"),
    ("icepop-high-nan", ["train", "--config", str(TINY), "mask.icepop_high=.nan"], "mask.icepop_high"),
    ("clip-ratio-c-nan", ["train", "--config", str(TINY), "mask.clip_ratio_c=.nan"], "mask.clip_ratio_c"),
    ("k-fractional", ["train", "--config", str(TINY), "mask.k=2.5"], "mask.k"),
    ("k-above-vocab", ["train", "--config", str(TINY), "mask.k=100000"], "mask.k"),
    ("max-prompt-tokens-0", ["train", "--config", str(TINY), "data.max_prompt_tokens=0"], "data.max_prompt_tokens"),
    ("run-dir-locked", ["train", "--config", str(TINY), "run_dir={tmp}/locked"], "in use by pid"),
    ("empty-dataset", ["train", "--config", str(Q4B), "model.path={model}", "data.train_files=[{tmp}/empty.jsonl]",
                       "data.eval_files=[]", "run_dir={tmp}/run"], "empty.jsonl"),
    ("sweep-deltas-neg", ["sweep", "deltas=[-1]", "--out", "{tmp}/s"], "deltas"),
    ("sweep-ks-0", ["sweep", "ks=[0]", "--out", "{tmp}/s"], "ks"),
    ("sweep-lr-neg", ["sweep", "base.lr=-1", "--out", "{tmp}/s"], "lr"),
    ("sweep-lr-nan", ["sweep", "base.lr=.nan", "--out", "{tmp}/s"], "lr"),
    ("sweep-mismatch-nan", ["sweep", "mismatches=[noise:nan]", "--out", "{tmp}/s"], "strength"),
    ("sweep-steps-0", ["sweep", "base.steps=0", "--out", "{tmp}/s"], "steps"),
    ("sweep-seeds-0", ["sweep", "--seeds", "0", "--out", "{tmp}/s"], "seeds"),
    ("sweep-workers-0", ["sweep", "--workers", "0", "--out", "{tmp}/s"], "--workers"),
    ("sweep-out-is-file", ["sweep", "base.steps=1", "--seeds", "1", "--no-audit", "--out", "{tmp}/afile"], "afile"),
    ("sweep-config-malformed", ["sweep", "--config", "{tmp}/bad.yaml", "--out", "{tmp}/s"], "bad.yaml"),
    ("audit-seeds-0", ["audit", "--seeds", "0", "--out", "{tmp}/a"], "seeds"),
]


def _files(tmp: Path) -> None:
    (tmp / "bad.yaml").write_text("model: [1, 2\nname: x\n")
    (tmp / "evil.yaml").write_text('model: !!python/object/apply:os.system ["echo pwned"]\n')
    (tmp / "empty.jsonl").write_text("")
    (tmp / "afile").write_text("not a directory\n")


@pytest.fixture(scope="module")
def fake_model(tmp_path_factory):
    from test_scaling_config import make_fake_model

    return make_fake_model(tmp_path_factory.mktemp("cli_model") / "model")


def _run_table(tmp_root: Path, model: Path) -> dict[str, subprocess.CompletedProcess]:
    """Run every case, a few at a time (each is a fresh interpreter)."""
    env = dict(os.environ, PDM_LAB_CACHE=str(tmp_root / "cache"), PYTHONUNBUFFERED="1")
    env.pop("PDM_LAB_DEBUG", None)
    procs, results = {}, {}
    for name, argv, _ in TABLE:
        tmp = tmp_root / name
        tmp.mkdir(exist_ok=True)
        _files(tmp)
        args = [a.format(tmp=tmp, model=model) for a in argv]
        procs[name] = subprocess.Popen([sys.executable, "-m", "pdm_lab", *args], cwd=tmp, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if len(procs) >= 4:
            _collect(procs, results)
    _collect(procs, results)
    return results


def _collect(procs: dict, results: dict) -> None:
    for name, proc in list(procs.items()):
        out, err = proc.communicate(timeout=600)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        del procs[name]


def test_every_bad_input_is_one_line_and_status_2(tmp_path, fake_model):
    holder = DirLock(tmp_path / "run-dir-locked" / "locked", what="run directory")
    holder.acquire()  # a live holder (this process) for the locked-run-dir case
    try:
        results = _run_table(tmp_path, fake_model)
    finally:
        holder.release()
    table = []
    for name, _, must_name in TABLE:
        res = results[name]
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        table.append({"case": name, "rc": res.returncode, "lines": len(lines),
                      "error": lines[-1] if lines else ""})
        assert "Traceback" not in res.stderr + res.stdout, (name, res.stderr[-2000:])
        assert res.returncode == 2, (name, res.returncode, res.stderr[-2000:])
        assert len(lines) == 1, (name, lines)
        assert must_name in lines[0], (name, lines[0])
    assert not (tmp_path / "yaml-python-tag" / "pwned").exists()
    print(json.dumps(table, indent=1, ensure_ascii=False))
