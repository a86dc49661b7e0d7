"""Checkpoints with ``torch.distributed.checkpoint`` and exact resume.

A checkpoint ``run_dir/checkpoints/step_00000012`` holds the sharded model and optimiser state
(DCP: every rank writes its shards; a different world size can load them), one
``extra_rank<r>.pt`` per rank (step, data-sampler position, Python/NumPy/torch RNG states) and a
``COMPLETE`` marker written last. Writes go to ``<name>.tmp`` and are renamed after every rank has
finished, so a run killed while saving leaves the previous checkpoint as the latest complete one.

What makes resume exact: the model, the optimiser moments and step counts, the learning-rate
schedule (a function of the step), the prompt order (``PromptSampler`` state), and sampling seeds
derived from (run seed, step, prompt) rather than from a running RNG. Multi-node runs need a
``run_dir`` on a shared filesystem.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

COMPLETE = "COMPLETE"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    """Every RNG this process uses."""
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_path(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step_{step:08d}"


def list_complete(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.exists():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
                  and (p / COMPLETE).exists())


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = list_complete(run_dir)
    return done[-1] if done else None


def _states(policy, optimizer):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(policy), "optim": get_optimizer_state_dict(policy, optimizer)}


def save_checkpoint(run_dir: Path, step: int, policy, optimizer, extra: dict, keep_last: int) -> Path:
    """Save (collective). ``extra``: this rank's resumable state (step, sampler, ...)."""
    import torch.distributed.checkpoint as dcp

    final = step_path(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(_states(policy, optimizer), checkpoint_id=str(tmp))
    torch.save({**extra, "rng": rng_state()}, tmp / f"extra_rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        (tmp / COMPLETE).write_text(json.dumps({"step": step, "world_size": world}))
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        for old in list_complete(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: Path, policy, optimizer) -> dict:
    """Load model and optimiser in place (collective); return this rank's extra state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    path = Path(path)
    if not (path / COMPLETE).exists():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {COMPLETE} marker)")
    states = _states(policy, optimizer)
    dcp.load(states, checkpoint_id=str(path))
    set_model_state_dict(policy, states["model"])
    set_optimizer_state_dict(policy, optimizer, states["optim"])
    mine = path / f"extra_rank{_rank()}.pt"
    if not mine.exists():  # resumed with more ranks than saved: the global parts are the same
        mine = path / "extra_rank0.pt"
    return torch.load(mine, weights_only=False)
