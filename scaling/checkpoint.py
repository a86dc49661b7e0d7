"""Checkpoints with ``torch.distributed.checkpoint`` and exact resume.

A checkpoint ``run_dir/checkpoints/step_00000012`` holds the sharded model and optimiser state
(DCP: every rank writes its shards; a different world size can load them), one
``extra_rank<r>.pt`` per rank (step, data-sampler position, Python/NumPy/torch RNG states) and a
``COMPLETE`` marker written last, holding the SHA-256 of every file. Writes go to ``<name>.tmp``
and are renamed after every rank has finished, so a run killed while saving leaves the previous
checkpoint as the latest complete one. On resume the checksums are verified: a damaged
checkpoint (bytes changed, truncated or emptied shards) is skipped with a warning naming it, and
the newest intact one is used; an explicitly named damaged checkpoint is a one-line error naming
the file, and so is a run whose every checkpoint is damaged (they stay in place: no restart from
step 1 whose saves would rotate them away). Everything is loaded with ``weights_only=True`` (no
pickled code runs on resume).

What makes resume exact: the model, the optimiser moments and step counts, the learning-rate
schedule (a function of the step), the prompt order (``PromptSampler`` state), and sampling seeds
derived from (run seed, step, prompt) rather than from a running RNG. Multi-node runs need a
``run_dir`` on a shared filesystem.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .distributed import broadcast_object

COMPLETE = "COMPLETE"
STEP_NAME = re.compile(r"step_\d{8}")


class CheckpointError(OSError):
    """A checkpoint that cannot be used (the user's files: exit status 2); the message names the
    path and the damaged file."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    """Every RNG this process uses, as plain types and tensors (loadable with weights_only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_py = random.getstate()
    return {"python": [version, list(internal), gauss_py],
            "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss),
                      float(gauss)],
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    version, internal, gauss_py = state["python"]
    random.setstate((version, tuple(internal), gauss_py))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])


def file_digests(path: Path) -> dict[str, str]:
    """SHA-256 of every file under ``path`` (relative names), the marker excluded."""
    out = {}
    for f in sorted(Path(path).rglob("*")):
        if f.is_file() and f.name != COMPLETE:
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
            out[str(f.relative_to(path))] = h.hexdigest()
    return out


def verify_checkpoint(path: Path) -> str | None:
    """None if ``path`` is complete and every file matches its checksum, else what is wrong
    (naming the file). Checkpoints written before checksums existed are only checked complete."""
    path = Path(path)
    try:
        marker = json.loads((path / COMPLETE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"{path}: not a complete checkpoint (no {COMPLETE} marker)"
    except (OSError, ValueError) as err:
        return f"{path / COMPLETE}: unreadable marker ({err})"
    want = marker.get("sha256")
    if want is None:
        return None
    have = file_digests(path)
    for name, digest in want.items():
        if name not in have:
            return f"{path / name}: missing"
        if have[name] != digest:
            size = (path / name).stat().st_size
            return f"{path / name}: checksum mismatch ({size} bytes; damaged, truncated or emptied)"
    return None


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_path(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step_{step:08d}"


def list_complete(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.exists():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir() and STEP_NAME.fullmatch(p.name)
                  and (p / COMPLETE).exists())


def step_of(path: Path) -> int:
    """The step a checkpoint directory ``step_<8 digits>`` holds."""
    return int(Path(path).name.split("_", 1)[1])


def _newest_intact(run_dir: Path, warn) -> tuple[str | None, str | None]:
    """(the newest complete checkpoint whose checksums verify, or None; the error when there are
    complete checkpoints and every one is damaged, else None). Damaged newer ones are warned about
    when an intact one is found; all of them are left in place."""
    damaged = []
    for path in reversed(list_complete(run_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            for bad, why in damaged:
                warn(f"[checkpoint] warning: skipping damaged checkpoint {bad}: {why}")
            return str(path), None
        damaged.append((path, problem))
    if not damaged:
        return None, None
    names = "; ".join(f"{path.name} ({why.replace(str(path) + '/', '')})" for path, why in damaged)
    return None, (f"cannot resume {run_dir}: every checkpoint is damaged, all left in place (restore or move them, "
                  f"or set checkpoint.resume=never to start over and replace them): {names}")


def intact_checkpoint(run_dir: Path, warn=None) -> Path | None:
    """The newest complete checkpoint whose checksums verify; each damaged newer one is reported
    through ``warn`` (default: stderr) by name and skipped. None: no complete checkpoint. When
    every complete checkpoint is damaged, a ``CheckpointError`` naming each (on every rank):
    resuming from step 1 would lose the run and its saves would rotate the only copies away.
    Rank 0 verifies, the others follow."""
    warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
    chosen, error = broadcast_object(_newest_intact(run_dir, warn) if _rank() == 0 else (None, None))
    if error is not None:
        raise CheckpointError(error)
    return Path(chosen) if chosen else None


def resolve_resume(cfg, warn=None):
    """``cfg`` with ``checkpoint.resume: auto`` replaced by the checkpoint it resolves to (a
    path, or ``never`` when the run has none), so the launcher verifies once, stops in one line
    when every checkpoint is damaged, and the ranks load the named one."""
    import dataclasses

    if cfg.checkpoint.resume != "auto":
        return cfg
    path = intact_checkpoint(cfg.resolved_run_dir, warn)
    resume = str(path) if path is not None else "never"
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=resume))


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
        marker = {"step": step, "world_size": world, "sha256": file_digests(tmp)}
        with open(tmp / COMPLETE, "w", encoding="utf-8") as fh:  # last, and durable, before the rename
            json.dump(marker, fh)
            fh.flush()
            os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        # rotate among steps up to this one: a later step left by an earlier attempt (damaged,
        # or the resume would have started there) is kept, and this save always survives
        for old in [p for p in list_complete(run_dir) if step_of(p) <= step][:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: Path, policy, optimizer) -> dict:
    """Load model and optimiser in place (collective); return this rank's extra state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    path = Path(path)
    problem = broadcast_object(verify_checkpoint(path) if _rank() == 0 else None)
    if problem is not None:
        raise CheckpointError(f"cannot resume: {problem}")
    states = _states(policy, optimizer)
    try:
        dcp.load(states, checkpoint_id=str(path))
    except Exception as err:  # noqa: BLE001 - DCP raises many types; the path is what the user needs
        raise CheckpointError(f"{path}: cannot load the sharded state ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})") from err
    set_model_state_dict(policy, states["model"])
    set_optimizer_state_dict(policy, optimizer, states["optim"])
    mine = path / f"extra_rank{_rank()}.pt"
    if not mine.exists():  # resumed with more ranks than saved: the global parts are the same
        mine = path / "extra_rank0.pt"
    try:
        return torch.load(mine, weights_only=True)
    except Exception as err:  # noqa: BLE001 - EOFError, zip errors, unpickling refusals
        raise CheckpointError(f"{mine}: cannot load ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else 'empty or truncated'})") from err
