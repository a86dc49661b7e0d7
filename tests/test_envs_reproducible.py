"""The toys' audit points are trained in float64, so an audit's counts do not depend on the CPU:
the same command under the default kernels, under the AVX2 kernels and on one thread gives the
same per-seed counts, and its continuous figures agree to rounding (docs/findings/reproducibility.md)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
#: a trained point (4 GRPO steps) of the paper preset's network, one small audited batch
ARGS = ["audit", "--preset", "quick", "--seeds", "1", "sequences=128", "audit_at=[4]", "trajectory_seeds=0",
        "flip_tokens=0", "train_groups=4", "--quiet"]


def _audit(tmp: Path, name: str, env: dict, *extra: str) -> dict:
    out = tmp / name
    res = subprocess.run([sys.executable, "-m", "pdm_lab", *ARGS, *extra, "--out", str(out)],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads((out / "audit.json").read_text())


def _leaves(doc, path=""):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _leaves(v, f"{path}.{k}")
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, doc


def _compare(a: dict, b: dict) -> tuple[list, list]:
    """(counts that differ, floats that differ beyond 1e-9 relative) over the per-seed tables."""
    lb = dict(_leaves(b["per_seed"]))
    counts, floats = [], []
    for path, x in _leaves(a["per_seed"]):
        y = lb.get(path)
        if isinstance(x, bool) or x is None or isinstance(x, str):
            continue
        if isinstance(x, int):
            counts += [(path, x, y)] if x != y else []
        elif isinstance(x, float) and x == x and abs(x - y) > 1e-9 * max(1.0, abs(x)):
            floats.append((path, x, y))
    return counts, floats


@pytest.mark.extended
def test_float64_audit_points_give_the_same_counts_on_every_cpu_path(tmp_path):
    base = _audit(tmp_path, "default", {})
    for name, env, extra in (("avx2", AVX2, ()), ("one-thread", {"OMP_NUM_THREADS": "1"}, ())):
        other = _audit(tmp_path, name, env, *extra)
        counts, floats = _compare(base, other)
        assert not counts and not floats, (name, counts[:5], floats[:5])
    assert base["config"]["train_precision"] == "float64" and base["outside_mean"] > 0


@pytest.mark.extended
def test_the_comparison_sees_a_different_trained_point(tmp_path):
    """The check above can fail: one more training step is another policy, and its counts differ."""
    base = _audit(tmp_path, "default", {})
    other = _audit(tmp_path, "later", {}, "audit_at=[5]")
    counts, floats = _compare(base, other)
    assert counts or floats
