"""Checkpoints: checksums in the COMPLETE marker, verified on resume; a damaged newest
checkpoint is skipped with a warning naming it; a damaged named one is a one-line error naming
the file; everything loads with ``weights_only=True``. Real ``torch.distributed.checkpoint``."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from pdm_lab.scaling.checkpoint import (COMPLETE, CheckpointError, intact_checkpoint, load_checkpoint,
                                        save_checkpoint, verify_checkpoint)


def _model(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 8)).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture()
def run_dir(tmp_path):
    model, opt = _model(0)
    for step in (2, 4):
        save_checkpoint(tmp_path, step, model, opt, {"step": step, "sampler": {"epoch": 0, "index": step}},
                        keep_last=3)
    return tmp_path


def _shard(ckpt):
    return max((p for p in ckpt.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["random_bytes", "truncate", "empty", "extra_pt"])
def test_damaged_newest_falls_back_with_a_warning_naming_it(run_dir, damage):
    newest = run_dir / "checkpoints" / "step_00000004"
    target = newest / "extra_rank0.pt" if damage == "extra_pt" else _shard(newest)
    data = bytearray(target.read_bytes())
    if damage == "random_bytes":
        data[len(data) // 2: len(data) // 2 + 16] = bytes(random.Random(0).randrange(256) for _ in range(16))
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray()
    target.write_bytes(bytes(data))
    warnings = []
    got = intact_checkpoint(run_dir, warnings.append)
    assert got == run_dir / "checkpoints" / "step_00000002"
    assert len(warnings) == 1 and str(newest) in warnings[0] and target.name in warnings[0]
    model, opt = _model(1)
    with pytest.raises(CheckpointError, match=target.name) as err:  # named explicitly: refuse
        load_checkpoint(newest, model, opt)
    assert "\n" not in str(err.value)


def test_resume_restores_state_exactly_with_weights_only(run_dir):
    saved, saved_opt = _model(0)
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    save_checkpoint(run_dir, 6, saved, saved_opt, {"step": 6}, keep_last=3)
    model, opt = _model(1)
    assert verify_checkpoint(run_dir / "checkpoints" / "step_00000006") is None
    extra = load_checkpoint(run_dir / "checkpoints" / "step_00000006", model, opt)
    from pdm_lab.scaling.checkpoint import set_rng_state

    set_rng_state(extra["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected
    for a, b in zip(saved.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_marker_holds_a_checksum_per_file(run_dir):
    ckpt = run_dir / "checkpoints" / "step_00000004"
    marker = json.loads((ckpt / COMPLETE).read_text())
    files = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != COMPLETE}
    assert set(marker["sha256"]) == files and all(len(h) == 64 for h in marker["sha256"].values())


def test_pickled_code_in_extra_state_is_refused(run_dir, tmp_path):
    ckpt = run_dir / "checkpoints" / "step_00000004"
    marker_file = tmp_path / "ran"
    torch.save({"step": 4, "evil": _Evil(str(marker_file))}, ckpt / "extra_rank0.pt")
    (ckpt / COMPLETE).write_text(json.dumps({"step": 4, "world_size": 1}))  # an old-style marker
    model, opt = _model(1)
    with pytest.raises(CheckpointError, match="extra_rank0.pt"):
        load_checkpoint(ckpt, model, opt)
    assert not marker_file.exists()


class _Evil:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))
