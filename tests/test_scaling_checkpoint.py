"""Checkpoints: checksums in the COMPLETE marker, verified on resume; a damaged newest
checkpoint is skipped with a warning naming it; a damaged named one is a one-line error naming
the file; everything loads with ``weights_only=True``. Real ``torch.distributed.checkpoint``."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pdm_lab.scaling.checkpoint import (COMPLETE, CheckpointError, intact_checkpoint, list_complete,
                                        load_checkpoint, resolve_resume, save_checkpoint, verify_checkpoint)

REPO = Path(__file__).resolve().parents[1]


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


def _truncate(ckpt) -> Path:
    shard = _shard(ckpt)
    shard.write_bytes(shard.read_bytes()[:10])
    return shard


def _snapshot(run_dir):
    return {p: p.read_bytes() for p in sorted((run_dir / "checkpoints").rglob("*")) if p.is_file()}


def test_every_checkpoint_damaged_stops_naming_them_and_leaves_them_in_place(run_dir):
    shards = [_truncate(run_dir / "checkpoints" / f"step_0000000{s}") for s in (2, 4)]
    before = _snapshot(run_dir)
    warnings = []
    with pytest.raises(CheckpointError) as err:
        intact_checkpoint(run_dir, warnings.append)
    text = str(err.value)
    assert "\n" not in text and "every checkpoint is damaged" in text and "checkpoint.resume=never" in text
    assert all(f"{s.parent.name} ({s.name}: checksum mismatch" in text for s in shards)  # each and its file
    assert warnings == []  # one error, not a warning per checkpoint and a restart
    assert _snapshot(run_dir) == before


def test_no_checkpoint_is_a_fresh_start_and_an_intact_one_is_named(run_dir, tmp_path):
    from pdm_lab.scaling.config import load_config

    cfg = load_config(REPO / "scaling" / "configs" / "tiny-cpu.yaml", [f"run_dir={tmp_path / 'fresh'}"])
    assert resolve_resume(cfg).checkpoint.resume == "never"
    cfg = load_config(REPO / "scaling" / "configs" / "tiny-cpu.yaml", [f"run_dir={run_dir}"])
    assert resolve_resume(cfg).checkpoint.resume == str(run_dir / "checkpoints" / "step_00000004")
    _truncate(run_dir / "checkpoints" / "step_00000004")
    assert resolve_resume(cfg).checkpoint.resume == str(run_dir / "checkpoints" / "step_00000002")
    _truncate(run_dir / "checkpoints" / "step_00000002")
    with pytest.raises(CheckpointError, match="every checkpoint is damaged"):
        resolve_resume(cfg)
    named = load_config(REPO / "scaling" / "configs" / "tiny-cpu.yaml", [f"run_dir={run_dir}", "checkpoint.resume=never"])
    assert resolve_resume(named) is named


def test_rotation_after_resuming_behind_a_damaged_newer_checkpoint_keeps_the_new_save(run_dir):
    """Resumed from step 2 behind a damaged step 4, the step-3 save with keep_last=1 survives (the
    old rotation by name kept only the damaged step 4), and step 4 is left for its own step."""
    _truncate(run_dir / "checkpoints" / "step_00000004")
    assert intact_checkpoint(run_dir, lambda _: None) == run_dir / "checkpoints" / "step_00000002"
    model, opt = _model(0)
    save_checkpoint(run_dir, 3, model, opt, {"step": 3}, keep_last=1)
    assert [p.name for p in list_complete(run_dir)] == ["step_00000003", "step_00000004"]
    assert intact_checkpoint(run_dir, lambda _: None) == run_dir / "checkpoints" / "step_00000003"
    save_checkpoint(run_dir, 4, model, opt, {"step": 4}, keep_last=1)  # its own step replaces it
    assert [p.name for p in list_complete(run_dir)] == ["step_00000004"]
    assert verify_checkpoint(run_dir / "checkpoints" / "step_00000004") is None


def test_train_command_with_every_checkpoint_damaged_exits_2_in_one_line(run_dir, capsys):
    """As a user runs it: ``pdm-lab train`` on a run whose checkpoints are all damaged."""
    from pdm_lab.cli.main import main

    for s in (2, 4):
        _truncate(run_dir / "checkpoints" / f"step_0000000{s}")
    before = _snapshot(run_dir)
    code = main(["train", "--config", str(REPO / "scaling" / "configs" / "tiny-cpu.yaml"), f"run_dir={run_dir}",
                 "total_steps=3", "--nproc", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "step_00000002" in err and "step_00000004" in err and "every checkpoint is damaged" in err
    assert _snapshot(run_dir) == before and not (run_dir / "metrics.jsonl").exists()


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
