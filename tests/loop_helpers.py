"""The tiny vLLM + FSDP loop as the end-to-end tests run it: one command line, one environment."""
import os
import sys
from pathlib import Path

TINY = Path(__file__).resolve().parents[1] / "scaling" / "configs" / "tiny-cpu.yaml"

#: the smallest run with a real mismatch (FP8 rollout, so μ ≠ π) and mixed rewards in every group
#: (a parity verifier, so Â ≠ 0 and the outside set is not empty); overrides come after and win
SMALL_FP8_RUN = ("total_steps=2", "model.tiny.sft_steps=60", "rollout.max_tokens=6", "rollout.precision=fp8",
                 "rollout.fp8_block=32", "eval.every=0", "checkpoint.every=0", "log.sync_check_every=0",
                 "data.synthetic.n_train=400")


def tiny_loop(tmp_path: Path, *overrides: str) -> tuple[list[str], dict]:
    """(argv, env) of ``pdm-lab train`` on the tiny config into ``tmp_path/run``, with its own cache."""
    (tmp_path / "plugin.py").write_text("def parity(response, answer):\n    return float(len(response) % 2)\n")
    cmd = [sys.executable, "-m", "pdm_lab", "train", "--config", str(TINY), *SMALL_FP8_RUN, *overrides,
           f"run_dir={tmp_path / 'run'}", f"plugins=[{tmp_path / 'plugin.py'}]",
           "reward.verifier=pdm_lab_plugin_plugin:parity"]
    return cmd, dict(os.environ, PDM_LAB_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")


def run_ranks(worker, *args, world: int = 2, timeout: float = 300.0) -> list:
    """Spawn ``worker(rank, world, *args, queue)`` on `world` processes; their results sorted by rank
    (each worker puts a tuple whose first item is its rank)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, world, *args, queue)) for rank in range(world)]
    for p in procs:
        p.start()
    results = sorted(_results(procs, queue, timeout), key=lambda x: x[0])
    for p in procs:
        p.join(timeout=60)
    return results


def _results(procs, queue, timeout: float) -> list:
    """One result per process from ``queue``; fails at once when a process died without one (a
    segfault) instead of waiting out ``timeout``."""
    import queue as queue_mod
    import time

    import pytest

    out, deadline = [], time.monotonic() + timeout
    while len(out) < len(procs):
        try:
            out.append(queue.get(timeout=1.0))
            continue
        except queue_mod.Empty:
            pass
        dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if dead and queue.empty():
            time.sleep(1.0)  # a result put just before the exit
            if queue.empty():
                pytest.fail(f"a rank died without a result: exit codes {[p.exitcode for p in procs]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no result from every rank in {timeout:.0f}s")
    return out
