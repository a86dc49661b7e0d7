"""Hardening of the core: every numeric config field range-checked where it is defined,
the directory lock, workers dying with their launcher, corrupt sweep results recomputed."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import typing

import pytest

from pdm_lab.config import ConfigError, check_fields
from pdm_lab.mask_config import MaskConfig
from pdm_lab.lab.lifetime import alive
from pdm_lab.lab.locking import DirLock, LockHeldError

# ---------------------------------------------------------------------------- config fields


def _config_instances() -> list:
    """A default instance of every config dataclass of every stage."""
    from pdm_lab.envs.audit.study import AuditConfig
    from pdm_lab.envs.problems.bandit import BanditConfig
    from pdm_lab.envs.problems.mismatch import MismatchSource
    from pdm_lab.envs.problems.problem import TokenMDPConfig
    from pdm_lab.envs.sweep.grid import SweepConfig
    from pdm_lab.envs.train.grpo import TrainConfig as ToyTrainConfig
    from pdm_lab.scaling import config as sc

    syn = sc.SyntheticTaskConfig()
    return [MaskConfig(), BanditConfig(), TokenMDPConfig(), MismatchSource("noise", 1.0), ToyTrainConfig(),
            SweepConfig(), AuditConfig(), sc.TinyModelConfig(), syn, sc.DataConfig(synthetic=syn),
            sc.RolloutConfig(), sc.TrainerConfig(), sc.AlgoConfig(), sc.EvalConfig(), sc.CheckpointConfig(),
            sc.LogConfig(), sc.LaunchConfig()]


def _numeric_fields(instance) -> list[tuple[str, type]]:
    hints = typing.get_type_hints(type(instance))
    out = []
    for f in dataclasses.fields(instance):
        tp = hints[f.name]
        args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, __import__("types").UnionType) else (tp,)
        for base in (float, int):
            if base in args:
                out.append((f.name, base))
    return out


def test_every_numeric_field_of_every_config_rejects_nan_inf_and_fractions():
    checked = 0
    for inst in _config_instances():
        for name, base in _numeric_fields(inst):
            bad_values = (math.nan, math.inf, -math.inf) if base is float else (2.5, math.nan)
            for bad in bad_values:
                with pytest.raises(ConfigError, match=rf"\b{name}\b"):
                    dataclasses.replace(inst, **{name: bad})
            checked += 1
    assert checked >= 60  # every stage's numbers, not a handful


@pytest.mark.parametrize("field,value,message", [
    ("delta", -0.1, "≥ 0"), ("delta_neg", math.nan, "finite"), ("k", 0, "≥ 1"), ("clip_ratio_c", 0.0, "> 0"),
    ("horizon", 0, "≥ 1"), ("icepop_high", math.inf, "finite"),
])
def test_mask_ranges_name_the_field(field, value, message):
    with pytest.raises(ConfigError, match=f"mask.{field}: must.*{message}"):
        MaskConfig(**{field: value})


def test_scaling_ranges_refuse_the_edges_their_fields_exclude():
    from pdm_lab.scaling import config as sc

    syn = sc.SyntheticTaskConfig()
    with pytest.raises(ConfigError, match="data.max_prompt_tokens"):
        sc.DataConfig(synthetic=syn, max_prompt_tokens=0)
    with pytest.raises(ConfigError, match="rollout.top_p"):
        sc.RolloutConfig(top_p=0.0)
    with pytest.raises(ConfigError, match=r"trainer.betas\[1\]"):
        sc.TrainerConfig(betas=(0.9, 1.0))
    check_fields(sc.RolloutConfig(top_p=1.0))  # the upper end is allowed


def test_sampled_logp_contradicting_its_topk_entry_is_refused():
    import torch

    from pdm_lab.errors import PDMInputError
    from pdm_lab.support import support_from_topk

    ids = torch.tensor([[3, 1, 0], [2, 0, 1]])
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.1], [0.6, 0.2, 0.1]]))
    sampled = torch.tensor([1, 4])
    good = torch.tensor([float(logp[0, 1]), math.log(0.05)])
    support_from_topk(ids, logp, sampled, good, vocab_size=8)
    bad = torch.tensor([math.log(0.01), math.log(0.05)])
    with pytest.raises(PDMInputError, match=r"sampled_logp: contradicts .* position \[0\]"):
        support_from_topk(ids, logp, sampled, bad, vocab_size=8)


# ---------------------------------------------------------------------------- lock and lifetime

HOLD = textwrap.dedent("""
    import sys, time
    from pdm_lab.lab.locking import DirLock
    DirLock(sys.argv[1], what="run directory").acquire()
    print("held", flush=True)
    time.sleep(120)
""")


def _holder(directory) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_lock_is_exclusive_names_the_holder_and_dies_with_it(tmp_path):
    proc = _holder(tmp_path / "run")
    try:
        with pytest.raises(LockHeldError, match=rf"in use by pid {proc.pid} on .* since "):
            DirLock(tmp_path / "run").acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with DirLock(tmp_path / "run") as lock:  # the kernel dropped the dead holder's lock
        with DirLock(tmp_path / "run"):  # re-entrant in one process
            pass
        assert json.loads((tmp_path / "run" / ".pdm_lab.lock").read_text())["pid"] == os.getpid()
    del lock


def test_sweep_refuses_an_out_directory_in_use(tmp_path):
    from pdm_lab.envs.sweep.grid import SweepConfig, run_sweep

    proc = _holder(tmp_path / "out")
    try:
        with pytest.raises(LockHeldError, match="sweep output is in use"):
            run_sweep(SweepConfig(seeds=1), tmp_path / "out", progress=False)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


WORKER = textwrap.dedent("""
    import os, sys, time
    from pdm_lab.lab.lifetime import die_with_parent, watch_launcher
    if sys.argv[1] == "pdeathsig":
        die_with_parent()
    else:
        watch_launcher(int(sys.argv[2]), poll_s=0.05)
    print(os.getpid(), flush=True)
    time.sleep(120)
""")

LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    worker = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1], str(os.getpid())],
                              stdout=subprocess.PIPE, text=True,
                              start_new_session=True)  # its own session, as torchrun's workers
    print(worker.stdout.readline().strip(), flush=True)
    time.sleep(120)
""")


@pytest.mark.parametrize("mode", ["pdeathsig", "watchdog"])
def test_worker_dies_when_its_launcher_is_sigkilled(mode):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, mode, WORKER], stdout=subprocess.PIPE, text=True)
    worker = int(launcher.stdout.readline())
    assert alive(worker)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    for _ in range(200):  # bounded wait: 20 s; typically gone in milliseconds
        if not alive(worker):
            break
        time.sleep(0.1)
    assert not alive(worker), f"worker {worker} outlived its launcher ({mode})"


# ---------------------------------------------------------------------------- sweep records

def test_corrupt_seed_file_is_named_moved_aside_and_recomputed(tmp_path, capsys):
    from pdm_lab.envs.problems.problem import ProblemConfig
    from pdm_lab.envs.sweep.grid import SweepConfig, cell_id, run_path, run_sweep
    from pdm_lab.envs.train.grpo import TrainConfig

    cfg = SweepConfig(base=TrainConfig(problem=ProblemConfig(kind="bandit"), steps=2, groups_per_step=4,
                                       group_size=4), rules=("pdm_uniform",), mismatches=("none",), seeds=2)
    out = tmp_path / "sweep"
    run_sweep(cfg, out, progress=False)
    path = run_path(out, cell_id(cfg.cells()[0]), 1)
    before = json.loads(path.read_text())
    path.write_text('{"row": {"cell_id": "tr')  # torn by a crash or a disk error
    status = run_sweep(cfg, out, progress=False)
    assert status["ran"] == 1 and status["skipped"] == 1
    assert str(path) in capsys.readouterr().err
    assert (path.parent / (path.name + ".corrupt")).exists()
    after = json.loads(path.read_text())["row"]
    assert {k: v for k, v in after.items() if k != "wall_s"} == {k: v for k, v in before["row"].items()
                                                                  if k != "wall_s"}
    assert not list(out.rglob("*.tmp"))
