"""Start the ranks of a run: in this process, or under ``torchrun`` on this machine.

``pdm-lab train`` resolves the config (file + overrides) once, writes it to
``run_dir/launch.yaml`` and, for ``launch.nproc_per_node > 1``, starts

    python -m torch.distributed.run --standalone --nproc_per_node N \\
        -m pdm_lab.scaling.loop --config run_dir/launch.yaml

Already inside torchrun (RANK is set, e.g. a multi-node launch, see ``scaling/README.md``), it
runs the loop directly. torchrun stays in this process's group: Ctrl-C (or a signal to the
group) reaches it and every rank together. The ranks die with the launcher, even by SIGKILL
(``lifetime``), and the run directory is locked for the launcher's lifetime: a second
``pdm-lab train`` on it fails at once, naming the holder (``pdm_lab.lab.locking``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from pdm_lab.config import ConfigError
from pdm_lab.lab.lifetime import LAUNCHER_ENV, die_with_parent
from pdm_lab.lab.locking import DirLock

from .config import TrainConfig, save_config


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_command(config_path: Path, nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", "-m", "pdm_lab.scaling.loop", "--config", str(config_path)]


def preflight(cfg: TrainConfig) -> None:
    """Fail fast, in one process, on what every rank would fail on: a missing model directory,
    a missing, empty or broken prompt file (read with the run's own reader and tokenizer, so the
    error is one line here rather than a traceback from every rank). Builds the tiny model and
    synthetic data once, before the ranks start."""
    from .assets import check_model_config, data_files, load_data, load_tokenizer, model_dir
    from .data import DataError

    path = model_dir(cfg)
    check_model_config(path)
    data_files(cfg)
    train, _, _ = load_data(cfg, load_tokenizer(path), log=lambda *_: None)
    if len(train) < cfg.rollout.prompts_per_step:
        raise DataError(f"{len(train)} usable training prompts in {', '.join(map(str, cfg.data.train_files))}"
                        f", fewer than rollout.prompts_per_step={cfg.rollout.prompts_per_step}")


def launch(cfg: TrainConfig, nproc: int | None = None) -> int:
    """Run training with ``nproc`` local ranks (default ``launch.nproc_per_node``). Exit code."""
    from .loop import run_training

    from .distributed import default_ranks

    if nproc is not None and nproc < 0:
        raise ConfigError(f"--nproc: must be ≥ 0 (0: the default), got {nproc}")
    nproc = nproc or cfg.launch.nproc_per_node or default_ranks()
    if under_torchrun():
        if os.environ.get("RANK") != "0":
            run_training(cfg)
            return 0
        with DirLock(cfg.resolved_run_dir, what="run directory"):
            run_training(cfg)
        return 0
    run_dir = Path(cfg.resolved_run_dir)
    fresh = not run_dir.exists()
    try:
        with DirLock(run_dir, what="run directory"):
            return _launch_locked(cfg, nproc)
    except BaseException:
        if fresh:  # a start that failed before writing anything leaves no empty run directory
            _remove_if_only_lock(run_dir)
        raise


def _remove_if_only_lock(run_dir: Path) -> None:
    from pdm_lab.lab.locking import LOCK_NAME

    try:
        if [p.name for p in run_dir.iterdir()] == [LOCK_NAME]:
            (run_dir / LOCK_NAME).unlink()
            run_dir.rmdir()
    except OSError:  # someone else's files or lock appeared meanwhile: leave it
        pass


def _launch_locked(cfg: TrainConfig, nproc: int) -> int:
    from .checkpoint import resolve_resume
    from .loop import run_training

    cfg = resolve_resume(cfg)  # verified once here; every checkpoint damaged: one line, none touched
    preflight(cfg)
    if nproc == 1:
        run_training(cfg)
        return 0
    run_dir = cfg.resolved_run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = run_dir / "launch.yaml"
    save_config(cfg, resolved, header="# config as launched (file + overrides), read by every rank")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env[LAUNCHER_ENV] = str(os.getpid())  # each rank watches this pid and dies with it
    proc = subprocess.Popen(torchrun_command(resolved, nproc), env=env, preexec_fn=die_with_parent)
    try:
        code = proc.wait()
    except KeyboardInterrupt:  # the terminal sent SIGINT to torchrun too; let it stop its ranks
        proc.send_signal(signal.SIGINT)
        return proc.wait()
    from .loop import nonfinite_status

    return code or nonfinite_status(run_dir)  # ranks return 0 on a non-finite run: summary.json says so
