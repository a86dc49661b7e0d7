"""Commands and benchmarks are entry-point plugins: a third-party package adds one the same way
the stages do (a real ``*.dist-info/entry_points.txt`` on ``sys.path``, found by
``importlib.metadata``), and a broken or missing plugin is a one-line error naming it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PLUGIN = '''
def register(subparsers):
    p = subparsers.add_parser("hello", help="a third-party command")
    p.add_argument("--name", default="world")
    p.set_defaults(func=lambda args: print(f"hello {args.name}") or 0)


def register_wrong_name(subparsers):
    subparsers.add_parser("something-else")


def run_bench(args):
    return [{"name": "hello bench", "value": 2.0, "unit": "x", "reference": 1.0, "ratio": 2.0,
             "target": "-"}]
'''


def install_plugin(site: Path, commands: dict[str, str], benchmarks: dict[str, str] | None = None) -> Path:
    """A minimal installed distribution: a module and its dist-info with entry points."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "hello_plugin.py").write_text(PLUGIN)
    info = site / "hello_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hello-plugin\nVersion: 0.1\n")
    lines = ["[pdm_lab.commands]"] + [f"{k} = {v}" for k, v in commands.items()]
    if benchmarks:
        lines += ["", "[pdm_lab.benchmarks]"] + [f"{k} = {v}" for k, v in benchmarks.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return site


def pdm_lab(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pdm_lab", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_a_third_party_command_as_a_user_runs_it(tmp_path):
    site = install_plugin(tmp_path / "site", {"hello": "hello_plugin:register"})
    res = pdm_lab(site, "hello", "--name", "pdm")
    assert res.returncode == 0 and res.stdout.strip() == "hello pdm", res.stderr


def test_a_third_party_benchmark_and_help(tmp_path, monkeypatch, capsys):
    from pdm_lab.cli.main import main

    site = install_plugin(tmp_path / "site", {"hello": "hello_plugin:register"}, {"hello": "hello_plugin:run_bench"})
    monkeypatch.syspath_prepend(str(site))  # importlib.metadata scans sys.path: a real install
    try:
        main(["--help"])
    except SystemExit as stop:
        assert stop.code == 0
    out = capsys.readouterr().out
    assert "a third-party command" in out and "train" in out and "prove" in out
    assert main(["bench", "--only", "hello", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"name": "hello bench", "value": 2.0, "unit": "x",
                                                    "reference": 1.0, "ratio": 2.0, "target": "-"}]


def test_broken_and_missing_plugins_are_one_line_errors_naming_them(tmp_path, monkeypatch, capsys):
    from pdm_lab.cli.main import main

    site = install_plugin(tmp_path / "site", {"broken": "no_such_module_for_pdm_lab:register",
                                              "noattr": "hello_plugin:no_such_function",
                                              "misnamed": "hello_plugin:register_wrong_name"})
    monkeypatch.syspath_prepend(str(site))
    for name, target in (("broken", "no_such_module_for_pdm_lab:register"),
                         ("noattr", "hello_plugin:no_such_function"),
                         ("misnamed", "hello_plugin:register_wrong_name")):
        assert main([name]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and f"'{name}'" in lines[0] and target in lines[0], lines
    # the other commands still load; --help lists them and warns once per broken plugin
    try:
        main(["--help"])
    except SystemExit as stop:
        assert stop.code == 0
    captured = capsys.readouterr()
    assert "promote" in captured.out
    assert sum("warning" in line for line in captured.err.splitlines()) == 3
