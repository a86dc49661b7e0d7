"""The output-path policy (``pdm_lab.lab.outputs``): inputs and other commands' files are never
overwritten without force, a folder holding another result is refused while the same result
resumes, and run names cannot walk out of ``runs/``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdm_lab.lab.outputs import (OutputPathError, check_name, check_not_input, check_overwritable,
                                     claim_output_dir, inside)

REPO = Path(__file__).resolve().parents[1]


def test_an_input_is_refused_by_any_spelling_of_its_path(tmp_path):
    data = tmp_path / "results.json"
    data.write_text("{}")
    (tmp_path / "link.json").symlink_to(data)
    for spelling in (data, tmp_path / "sub" / ".." / "results.json", tmp_path / "link.json"):
        with pytest.raises(OutputPathError, match="is the table .an input of this command.") as err:
            check_not_input(spelling, {"the table": data})
        assert "\n" not in str(err.value)
    check_not_input(tmp_path / "other.json", {"the table": data, "unset": None})
    check_not_input(data, {"the table": data}, force=True)


def test_only_the_commands_own_files_are_overwritten(tmp_path):
    mine, theirs = tmp_path / "mine.yaml", tmp_path / "theirs.md"
    mine.write_text("# promoted from toy sweep s\nmask: {}\n")
    theirs.write_text("notes\n")
    check_overwritable(mine, ["# promoted from toy sweep"])
    check_overwritable(tmp_path / "new.yaml", ["# promoted from toy sweep"])
    with pytest.raises(OutputPathError, match="was not written by this command"):
        check_overwritable(theirs, ["# promoted from toy sweep"])
    with pytest.raises(OutputPathError, match="is a directory"):
        check_overwritable(tmp_path, ["x"])
    check_overwritable(theirs, ["# promoted from toy sweep"], force=True)


def test_a_folder_belongs_to_one_result(tmp_path):
    ident = {"rules": ["a"], "seeds": 2}
    claim_output_dir(tmp_path / "missing", marker="m.json", identity=ident, products=["r.json"], what="sweep")
    claim_output_dir(tmp_path, marker="m.json", identity=ident, products=["r.json"], what="sweep")  # empty
    (tmp_path / "r.json").write_text("{}")
    with pytest.raises(OutputPathError, match="holds r.json but no m.json"):
        claim_output_dir(tmp_path, marker="m.json", identity=ident, products=["r.json"], what="sweep")
    (tmp_path / "m.json").write_text(json.dumps(ident))
    claim_output_dir(tmp_path, marker="m.json", identity=ident, products=["r.json"], what="sweep")  # resume
    grown = {"rules": ["a"], "seeds": 5}
    claim_output_dir(tmp_path, marker="m.json", identity=grown, products=["r.json"], what="sweep", ignore=["seeds"])
    with pytest.raises(OutputPathError, match="of a different sweep"):
        claim_output_dir(tmp_path, marker="m.json", identity=grown, products=["r.json"], what="sweep")
    (tmp_path / "m.json").write_text("{trunc")
    with pytest.raises(OutputPathError, match="m.json is unreadable"):
        claim_output_dir(tmp_path, marker="m.json", identity=ident, products=["r.json"], what="sweep")


@pytest.mark.parametrize("name", ["../../../../elsewhere", "..", ".", "a/b", "/abs", "a\\b", "", " ", "x\0y"])
def test_names_that_leave_their_folder_are_refused(name):
    with pytest.raises(OutputPathError, match="name: .* is not a plain name"):
        check_name(name, "name")


def test_inside(tmp_path):
    assert inside(tmp_path, "a/b", "x") == (tmp_path / "a" / "b").resolve()
    with pytest.raises(OutputPathError, match="outside"):
        inside(tmp_path, "../elsewhere", "x")


def test_train_refuses_a_run_name_that_escapes_runs(tmp_path, capsys):
    """As a user runs it: ``pdm-lab train --dry-run name=../../../../elsewhere`` exits 2 in one line
    and creates nothing; a plain name passes the config check."""
    from pdm_lab.cli.main import main

    cfg = str(REPO / "scaling" / "configs" / "tiny-cpu.yaml")
    assert main(["train", "--config", cfg, "--dry-run", "name=../../../../elsewhere"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "name: '../../../../elsewhere' is not a plain name" in err
    from pdm_lab.scaling.config import load_config

    assert load_config(cfg, ["name=tiny-2"]).resolved_run_dir == Path("runs") / "tiny-2"
