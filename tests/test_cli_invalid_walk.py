"""Every command, every config field it reads, an invalid value: exit status 2 and one line that
names the field, never an internal error (70), a traceback, or a run that starts.

The cases are generated, not listed: the fields of each command's config dataclass (with their
``Range``/``Length`` metadata and types) and the options of each command's parser. Each case is
the real ``pdm_lab.cli.main.main(argv)`` called in this process (the walk takes seconds); the
functions that would start work (the sweep, the audit, the calibration, the dry run, a demo's
batch, a benchmark) are tripwires that fail the case if a value got through. A few cases run as
real subprocesses at the end, and ``test_refused_commands_leave_nothing`` checks that a refused
command creates no folder, lock file or partial result."""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from pdm_lab.config import Length, Range
from pdm_lab.cli import main as cli

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "scaling" / "configs" / "tiny-cpu.yaml"


class Accepted(BaseException):
    """A tripwire fired: the command got past its checks with an invalid value (a BaseException,
    so the command line's own handler of internal errors does not catch it)."""


def _trip(*_a, **_k):
    raise Accepted("the command started work")


# ---- invalid values for a config field, from its type and metadata

def _unwrap(tp):
    """(base type, metadata) of a field type: Annotated unwrapped, Optional reduced to its type."""
    meta = ()
    if typing.get_origin(tp) is typing.Annotated:
        tp, *meta = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            inner, inner_meta = _unwrap(args[0])
            return inner, (*meta, *inner_meta)
    return tp, tuple(meta)


def invalid_values(tp) -> list[str]:
    """YAML texts no field of this type and metadata may accept."""
    base, meta = _unwrap(tp)
    rng = next((m for m in meta if isinstance(m, Range)), None)
    if typing.get_origin(base) in (tuple, list):
        elem = typing.get_args(base)[0]
        out = [f"[{v}]" for v in invalid_values(typing.Annotated[elem, rng] if rng else elem)[:1]]
        if any(isinstance(m, Length) for m in meta):
            out.append("[]")
        return out or ["3"]
    if base is bool:
        return ["maybe"]
    if base in (int, float):
        if rng is not None and rng.low > -float("inf"):
            return [f"{rng.low - 1:g}" if not rng.low_open else f"{rng.low:g}"]
        if rng is not None and rng.high < float("inf"):
            return [f"{rng.high * 10 + 1:g}"]
        return ["2.5"] if base is int else [".nan"]
    if base is str:
        return ["[1, 2]"]
    return []


def config_fields(cls, prefix: str = "") -> list[tuple[str, typing.Any]]:
    """(dotted key, field type) of every leaf field of a config dataclass, recursively."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        base, _ = _unwrap(tp)
        if dataclasses.is_dataclass(base):
            out += config_fields(base, f"{prefix}{f.name}.")
        elif typing.get_origin(base) is not dict and base is not typing.Any:
            out.append((f"{prefix}{f.name}", tp))
    return out


#: Names checked against a registry or a list of choices: an unknown one must be refused by name.
UNKNOWN_NAMES = {
    "sweep": ["rules", "mismatches", "base_mismatch", "conventions", "base.policy", "base.optimizer",
              "base.mismatch", "base.problem.kind", "base.problem.token_mdp.task", "base.problem.bandit.reward",
              "base.mask.rule", "base.mask.aggregation", "base.mask.direction_estimator"],
    "audit": ["policy", "optimizer", "mismatch", "problem.kind", "problem.token_mdp.task", "rules"],
    "train": ["data.synthetic.name", "reward.verifier", "reward.on_error", "mask.rule", "rollout.precision",
              "trainer.param_dtype", "launch.backend", "data.on_bad_row"],
}
#: Free-form strings (a name, a path, a seed label) where any string is a valid value.
FREE = {"name", "run_dir", "model.path", "checkpoint.resume", "data.prompt_key", "data.answer_key",
        "data.eval_prompt_key", "data.eval_answer_key", "provenance.sweep_dir", "provenance.cell_id",
        "provenance.criterion", "provenance.code_version", "provenance.base_config", "provenance.created"}


def _config_cases(command: str, cls, head: list[str], tail: list[str]) -> list[tuple[str, list[str], str]]:
    cases = []
    for key, tp in config_fields(cls):
        if key in FREE:
            continue
        for value in invalid_values(tp):
            cases.append((f"{command} {key}={value}", [*head, f"{key}={value}", *tail], key.split(".")[-1]))
    for key in UNKNOWN_NAMES.get(command, []):
        value = "[no_such_name_xyz]" if key in ("rules", "mismatches", "conventions") else "no_such_name_xyz"
        cases.append((f"{command} {key}={value}", [*head, f"{key}={value}", *tail], key.split(".")[-1]))
    return cases


def option_cases(command: str, head: list[str]) -> list[tuple[str, list[str], str]]:
    """An invalid value for each typed or choice option of `command`'s parser."""
    parser = cli.build_parser([command])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    cases = []
    for action in sub._actions:
        if not action.option_strings or action.nargs == 0:
            continue
        flag = action.option_strings[0]
        if action.choices:
            value = "no_such_choice_xyz"
        elif getattr(action.type, "__name__", "") == "integer":
            value = "2.5"
        elif getattr(action.type, "__name__", "") == "number":
            value = "nan"
        else:
            continue
        cases.append((f"{command} {flag} {value}", [command, *head, flag, value], flag))
    return cases


def all_cases(tmp: Path) -> list[tuple[str, list[str], str]]:
    from pdm_lab.envs.audit.study import AuditConfig
    from pdm_lab.envs.sweep.grid import SweepConfig
    from pdm_lab.scaling.config import TrainConfig

    out = str(tmp / "out")
    cases = _config_cases("sweep", SweepConfig, ["sweep", "--quiet"], ["--out", out])
    cases += _config_cases("audit", AuditConfig, ["audit", "--preset", "quick", "--quiet"], ["--out", out])
    cases += _config_cases("train", TrainConfig, ["train", "--config", str(TINY)], ["--dry-run"])
    sweep_dir = tmp / "sweep"
    for command, head in [("sweep", ["--out", out]), ("audit", ["--out", out]), ("calibrate", ["--out", out]),
                          ("demo", ["--out", str(tmp / "d.json")]), ("bench", ["--only", "core"]),
                          ("prove", ["--list"]), ("transfer", ["--out", out]),
                          ("promote", [str(sweep_dir), "--base", str(TINY), "--out", str(tmp / "p.yaml")]),
                          ("train", ["--config", str(TINY), "--dry-run"])]:
        cases += option_cases(command, head)
    return cases


def _tripwires(monkeypatch) -> None:
    # The command modules are imported before the patch: one first imported under it would bind
    # the tripwire for the rest of the session if it took a function by name.
    import pdm_lab.envs.commands, pdm_lab.envs.study_commands, pdm_lab.scaling.commands  # noqa: E401,F401
    from pdm_lab.envs import pipeline
    from pdm_lab.envs.transfer import calibrate, compare
    from pdm_lab.scaling import dryrun, launch
    from pdm_lab.tools import bench, demo

    for module, name in [(pipeline, "sweep_to_dir"), (pipeline, "audit_to_dir"), (calibrate, "toy_table"),
                         (calibrate, "search_strength"), (calibrate, "run_table"), (dryrun, "dry_run"),
                         (launch, "launch"), (demo, "run_demo"), (bench, "run_benchmarks")]:
        if hasattr(module, name):
            monkeypatch.setattr(module, name, _trip)
    for name in ("compare_runs", "run_transfer", "transfer"):
        if hasattr(compare, name):
            monkeypatch.setattr(compare, name, _trip)


def run_case(argv: list[str], capsys) -> tuple[int | str, str]:
    """(exit status or ``"accepted"``, stderr) of ``pdm-lab argv`` in this process."""
    try:
        code = cli.main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 2
    except Accepted:
        code = "accepted"
    return code, capsys.readouterr().err


def test_every_invalid_field_value_is_exit_2_naming_the_field(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PDM_LAB_DEBUG", raising=False)
    monkeypatch.setenv("PDM_LAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    _tripwires(monkeypatch)
    cases = all_cases(tmp_path)
    commands = {argv[0] for _, argv, _ in cases}
    assert commands >= {"sweep", "audit", "calibrate", "demo", "bench", "prove", "transfer", "promote", "train"}
    assert len(cases) > 200
    bad = []
    for name, argv, must in cases:
        code, err = run_case(argv, capsys)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if code != 2 or len(lines) != 1 or must not in lines[0] or "Traceback" in err:
            bad.append(f"{name}: status {code}, {lines[-1:] if lines else 'no message'}")
    assert not bad, f"{len(bad)} of {len(cases)} cases:\n" + "\n".join(bad)
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()  # refused: nothing written


def test_walk_catches_an_unchecked_field(tmp_path, monkeypatch, capsys):
    # planted bug: a field whose range check is gone lets the invalid value through to the work
    from pdm_lab.envs.train import grpo

    _tripwires(monkeypatch)
    hints = typing.get_type_hints(grpo.TrainConfig, include_extras=True)
    assert invalid_values(hints["lr"]) and invalid_values(hints["group_size"]) == ["1"]
    monkeypatch.setattr(grpo.TrainConfig, "__post_init__", lambda self: None)
    code, _ = run_case(["sweep", "base.group_size=1", "--out", str(tmp_path / "o")], capsys)
    assert code == "accepted"


# ---- a few as real subprocesses: the exit status and stderr as a user sees them

SUBPROCESS = [
    (["train", "--config", "/dev/zero", "--dry-run"], "/dev/zero"),
    (["train", "--config", str(TINY), "data.synthetic.name=foo", "--dry-run"], "data.synthetic.name"),
    (["sweep", "base.groups_per_step=1e12", "--out", "{tmp}/s"], "groups_per_step"),
    (["demo", "--tokens", "1e11", "--out", "{tmp}/d.json"], "--tokens"),
    (["demo", "--tokens", "64", "--vocab", "100", "--out", "/dev/full"], "/dev/full"),
]


@pytest.mark.parametrize("argv,must", SUBPROCESS, ids=[" ".join(a[:2]) + " " + m for a, m in SUBPROCESS])
def test_as_a_user_runs_it(argv, must, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PDM_LAB_CACHE=str(tmp_path / "cache"))
    env.pop("PDM_LAB_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "pdm_lab", *[a.format(tmp=tmp_path) for a in argv]],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and must in lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "s").exists()


# ---- refused commands leave nothing; the run's own folder holds an internal error's traceback

REFUSED = [
    ["sweep", "base.group_size=1", "--out", "{out}"],
    ["audit", "--preset", "quick", "group_size=1", "--out", "{out}"],
    ["calibrate", "--delta", "-1", "--out", "{out}"],
    ["calibrate", "--mismatch", "noise:nan", "--out", "{out}"],
    ["demo", "--tokens", "1e11", "--out", "{out}/d.json"],
    ["transfer", "--search-iters", "0", "--out", "{out}"],
    ["promote", "{tmp}/nowhere", "--base", str(TINY), "--out", "{out}/p.yaml"],
    ["train", "--config", str(TINY), "rollout.group_size=1", "run_dir={out}"],
    ["prove", "--seed", "-1", "--out", "{out}/proofs.md"],
]


@pytest.mark.parametrize("argv", REFUSED, ids=[a[0] + " " + a[-3 if a[0] != "train" else -1] for a in REFUSED])
def test_refused_commands_leave_nothing(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _tripwires(monkeypatch)
    out = tmp_path / "out"
    code, err = run_case([a.format(out=out, tmp=tmp_path) for a in argv], capsys)
    assert code == 2, err
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_a_refused_sweep_leaves_no_lock_file_in_another_grids_folder(tmp_path, monkeypatch, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "results.json").write_text("[]")
    (other / "sweep.json").write_text('{"rules": ["none"]}')
    before = sorted(p.name for p in other.iterdir())
    code, err = run_case(["sweep", "--out", str(other)], capsys)
    assert code == 2 and "different sweep" in err
    assert sorted(p.name for p in other.iterdir()) == before  # no .pdm_lab.lock, nothing else


def test_an_internal_error_s_traceback_goes_into_the_run_folder(tmp_path, monkeypatch, capsys):
    import tempfile

    from pdm_lab.tools import demo

    def planted_bug(**_kwargs):
        raise KeyError("stats/none_such")

    monkeypatch.setattr(demo, "run_demo", planted_bug)
    monkeypatch.delenv("PDM_LAB_DEBUG", raising=False)
    before = set(Path(tempfile.gettempdir()).glob("pdm-lab-traceback-*"))
    (tmp_path / "run").mkdir()
    code, err = run_case(["demo", "--tokens", "64", "--vocab", "100", "--out", str(tmp_path / "run" / "d.json")],
                         capsys)
    assert code == 70 and f"traceback saved to {tmp_path / 'run' / 'pdm-lab-traceback.txt'}" in err
    assert "planted_bug" in (tmp_path / "run" / "pdm-lab-traceback.txt").read_text()
    assert set(Path(tempfile.gettempdir()).glob("pdm-lab-traceback-*")) == before
    # no run folder: nothing is written anywhere, the line says how to see the traceback
    code, err = run_case(["demo", "--tokens", "64", "--vocab", "100", "--out", str(tmp_path / "no" / "d.json")],
                         capsys)
    assert code == 70 and "rerun with --debug" in err and not (tmp_path / "no").exists()


def test_no_tripwire_outlives_the_walk():
    """After the walk's patches are undone, no loaded pdm_lab module still holds a tripwire (a
    name imported from a patched module while the patch was on would keep it, and every later
    test calling that name would hit the tripwire)."""
    left = [f"{name}.{attr}" for name, module in list(sys.modules.items())
            if name.startswith("pdm_lab") and module is not None
            for attr, value in list(vars(module).items()) if value is _trip]
    assert not left, f"tripwires left bound: {left}"
