"""The `pdm-lab` command line as a user runs it (a subprocess, the installed entry point)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).with_name("pdm-lab")


def run(*args, cwd=None, timeout=600):
    cmd = [str(BIN)] if BIN.exists() else [sys.executable, "-m", "pdm_lab"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_help_lists_subcommands():
    res = run("--help")
    assert res.returncode == 0, res.stderr
    for cmd in ("demo", "bench", "prove", "audit", "sweep", "train", "promote"):
        assert cmd in res.stdout


@pytest.mark.parametrize("cmd", ["demo", "bench"])
def test_subcommand_help(cmd):
    res = run(cmd, "--help")
    assert res.returncode == 0 and "usage: pdm-lab " + cmd in res.stdout


def test_demo_writes_json(tmp_path):
    out = tmp_path / "demo.json"
    res = run("demo", "--tokens", "128", "--vocab", "2000", "--out", str(out))
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())
    assert [r["noise"] for r in rows] == [0.2, 0.5, 1.0]
    assert rows[-1]["outside"] > rows[0]["outside"]


def test_bench_json_small():
    res = run("bench", "--only", "core", "--tokens", "2000", "--gather-tokens", "4", "--vocab", "5000",
              "--repeat", "1", "--import-repeat", "1", "--eager-only", "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert all({"name", "value", "unit", "reference", "ratio", "target"} <= set(r) for r in rows)
    # the import cost over torch's (import pdm_lab, the loss path), eager only: 2 pipeline rows, the
    # same 2 against the reference without fresh memory, then memory + time for forward and fwd+bwd
    # of the chunked gather
    assert [r["unit"] for r in rows] == ["s", "s"] + ["Mtok/s"] * 4 + ["MB", "ms", "MB", "ms"]
    assert "import cost over torch's" in rows[0]["name"] and rows[0]["reference"] > 0
    assert rows[4]["value"] == rows[2]["value"] and "without fresh memory" in rows[4]["name"]
    for r in rows:  # the ratio is ours ÷ the reference in time or memory (throughput: inverted)
        expected = r["reference"] / r["value"] if r["unit"] == "Mtok/s" else r["value"] / max(r["reference"], 1e-9)
        assert r["ratio"] == pytest.approx(expected, rel=1e-6), r["name"]


def test_unknown_subcommand_fails():
    res = run("frobnicate")
    assert res.returncode != 0 and "invalid choice" in res.stderr


def _demo_argv(tmp_path):
    return ["demo", "--tokens", "8", "--vocab", "50", "--out", str(tmp_path / "d.json")]


def test_internal_error_is_its_own_status_with_the_traceback_in_a_file(tmp_path, monkeypatch, capsys):
    """A bug inside pdm_lab (here a KeyError planted in the demo) is not "bad input": exit status
    ``INTERNAL_ERROR``, one line saying so, naming a file that holds the traceback."""
    from pdm_lab.errors import INTERNAL_ERROR
    from pdm_lab.cli.main import main
    from pdm_lab.tools import demo

    def planted_bug(**_):
        raise KeyError("stats/none_such")

    monkeypatch.setattr(demo, "run_demo", planted_bug)
    assert main(_demo_argv(tmp_path)) == INTERNAL_ERROR != 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "internal error (a pdm_lab bug" in lines[0] and "KeyError" in lines[0], lines
    saved = Path(lines[0].split("traceback saved to ")[1].split(" (please report it)")[0])
    text = saved.read_text()
    assert "Traceback" in text and "planted_bug" in text and "stats/none_such" in text
    saved.unlink()


def test_bad_input_keeps_status_2_and_debug_anywhere_shows_the_traceback(tmp_path, monkeypatch, capsys):
    from pdm_lab.config import ConfigError
    from pdm_lab.cli.main import main
    from pdm_lab.tools import demo

    def refuses(**_):
        raise ConfigError("--k 100: must be ≤ --vocab")

    monkeypatch.setattr(demo, "run_demo", refuses)
    assert main(_demo_argv(tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error: --k 100" in err[0] and "internal" not in err[0]
    with pytest.raises(ConfigError):  # --debug after the command's options, too
        main([*_demo_argv(tmp_path), "--debug"])


def _child_raises(queue, message):
    raise ValueError(message)


def _child_dies(queue, status):
    os._exit(status)


def _child_reports(queue, value):
    queue.put({"value": value})


def _in_fresh_process_in_thread(*args, **kwargs):
    """``in_fresh_process`` on a thread, joined with a generous guard: a parent that waits on a
    dead child shows as a thread still alive, not as a stuck test run."""
    import threading

    from pdm_lab.tools.benchtools import in_fresh_process

    box = {}

    def run():
        try:
            box["result"] = in_fresh_process(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - handed to the test
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the parent still waits on a child that is gone"
    return box


def test_fresh_process_failure_reaches_the_parent_at_once():
    """A measurement child that raises or dies makes the parent fail with the child's one-line
    error (and its traceback as the cause), well before the parent's own 900 s timeout."""
    from pdm_lab.tools.benchtools import ChildFailed

    box = _in_fresh_process_in_thread(_child_raises, "min() arg is an empty sequence")
    err = box["error"]
    assert isinstance(err, ChildFailed) and "_child_raises" in str(err)
    assert "ValueError: min() arg is an empty sequence" in str(err) and "Traceback" in str(err.__cause__)
    box = _in_fresh_process_in_thread(_child_dies, 7)
    assert isinstance(box["error"], ChildFailed) and "exited with status 7" in str(box["error"])
    assert _in_fresh_process_in_thread(_child_reports, 3)["result"] == {"value": 3}


def test_fresh_process_timeout_is_honoured():
    from pdm_lab.tools.benchtools import ChildFailed

    box = _in_fresh_process_in_thread(_sleep_child, 60, timeout=1)
    assert isinstance(box["error"], ChildFailed) and "within 1 s" in str(box["error"])


def _sleep_child(queue, seconds):
    import time

    time.sleep(seconds)
