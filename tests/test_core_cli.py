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
              "--repeat", "1", "--eager-only", "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert all({"name", "value", "unit", "reference", "ratio", "target"} <= set(r) for r in rows)
    # eager only: 2 pipeline rows, the same 2 against the reference without fresh memory, then
    # memory + time for forward and fwd+bwd of the chunked gather
    assert [r["unit"] for r in rows] == ["Mtok/s"] * 4 + ["MB", "ms", "MB", "ms"]
    assert rows[2]["value"] == rows[0]["value"] and "without fresh memory" in rows[2]["name"]
    for r in rows:  # the ratio is ours ÷ the reference in time or memory (throughput: inverted)
        expected = r["reference"] / r["value"] if r["unit"] == "Mtok/s" else r["value"] / max(r["reference"], 1e-9)
        assert r["ratio"] == pytest.approx(expected, rel=1e-6), r["name"]


def test_unknown_subcommand_fails():
    res = run("frobnicate")
    assert res.returncode != 0 and "invalid choice" in res.stderr
