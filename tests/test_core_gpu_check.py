"""The GPU check runs end to end at toy sizes on the CPU, as `make gpu-check` runs it: from the repo
root on PYTHONPATH, without the installed package."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_tiny_writes_every_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PDM_LAB_COMPILE": "0"}
    # -S: no site-packages .pth hooks, so the editable install cannot stand in for the tree
    site = subprocess.run([sys.executable, "-c", "import torch, transformers, yaml, os; "
                           "print(os.pathsep.join({os.path.dirname(os.path.dirname(m.__file__)) "
                           "for m in (torch, transformers, yaml)}))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), site])
    res = subprocess.run([sys.executable, "-S", "-m", "pdm_lab.tools.gpu_check", "--tiny", "--device", "cpu",
                          "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(out.read_text())
    assert report["copy"]["GB_per_s"] > 0
    assert {r["mode"] for r in report["pipeline"]} == {"eager"}
    assert all(r["ratio_to_limit"] > 1 for r in report["pipeline"])  # nothing beats the copy limit
    assert report["gather"]["chunked"]["seconds"] > 0 and report["gather"]["naive"]["peak_extra_mb"] >= 0
    model = report["model"]
    assert 0 < model["chunked"]["mask_share"] < 1 and model["params"] > 0
    imported = subprocess.run([sys.executable, "-S", "-c", "import pdm_lab.tools.gpu_check, sys; "
                               "print(sorted({m.split('.')[0] for m in sys.modules}))"],
                              cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    # what the device image lacks must not be imported (it has torch, transformers, yaml; no vllm)
    assert "vllm" not in imported and "gymnasium" not in imported and "pdm_lab" in imported
