"""The paper's batch split in the loop (SPEC §6b staleness, §6c the audit at a mini-batch).

* unit level (no engine): with ``trainer.mini_batches = 4`` and the audit at ``last`` run as
  ``update_policy``'s ``before_step`` hook, the update ends with the same parameters, AdamW state
  and metrics as without the audit; the record's ``state_fingerprint`` is that of the run's
  parameters just before mini-batch 3's real step; a planted audit that snapshots at the step's
  start while claiming mini-batch 3 is caught by that check. The regime is logged per mini-batch
  and pooled, D = 0 at j = 0 (μ is the model's own distribution) and > 0 after;
* ``calibrate --from-run`` on a sample with mini-batch indices prints a row per j and the pooled
  row; a sample without ``mini_batch`` is read as j = 0;
* the tiny vLLM loop (fp32 engine, no noise, ``trainer.mini_batches=4``): D ≈ 0 at j = 0, > 0 at
  j ≥ 1, mean larger at j = 3 than at j = 1; ``calibrate --from-run`` prints every j; the same run
  with ``audit.every=1 audit.mini_batch=last`` ends with identical weights and training metrics.
"""
from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdm_lab.audit.live import state_fingerprint
from pdm_lab.mask_config import MaskConfig
from pdm_lab.scaling import audit_step, train_step
from pdm_lab.scaling.config import AuditConfig, TrainerConfig
from pdm_lab.scaling.policy_model import PolicyModel

from test_scaling_audit import ADV, Cfg, _identical, _lm, _state_copy  # the audit tests' run-config stand-in
from test_scaling_units import VOCAB, fake_batch


def _cfg(mini_batch="last") -> Cfg:
    return Cfg(mask=MaskConfig(rule="pdm_topk", k=5, delta=0.02),
               trainer=TrainerConfig(mini_batches=4, micro_batch_size=2, grad_clip=1.0),
               audit=AuditConfig(every=1, rules=("dppo_topk_kl", "pdm_topk"), delta=0.002, probe_tokens=2,
                                 step_scales=(1.0,), mini_batch=mini_batch))


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    lm = _lm(tied=False)
    return lm, fake_batch(lm, n_prompts=2, g=4, seed=4, temperature=1.0)


def _fresh(lm, batch, cfg):
    """A policy and its AdamW with state from one real update (4 optimiser steps)."""
    policy = PolicyModel(copy.deepcopy(lm))
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    train_step.update_policy(policy, opt, batch, ADV, cfg=cfg, vocab_size=VOCAB, pad_id=0, lr=1e-2)
    return policy, opt


def _update(policy, opt, batch, cfg, hook=None):
    """One update; returns (metrics, the parameters' fingerprint at the start of each mini-batch)."""
    seen = {}

    def before(j, rows):
        seen[j] = state_fingerprint([p for g in opt.param_groups for p in g["params"]])
        if hook is not None:
            hook(j, rows)

    upd = train_step.update_policy(policy, opt, batch, ADV, cfg=cfg, vocab_size=VOCAB, pad_id=0, lr=1e-2,
                                   before_step=before)
    return upd.metrics, seen


def _audit(policy, opt, batch, cfg):
    return audit_step.MiniBatchAudit(policy, opt, batch, ADV, cfg=cfg, vocab_size=VOCAB, pad_id=0, lr=1e-2)


def audited_state_matches(record: dict, fingerprints: dict[int, str]) -> bool:
    """The check: the state the record says it snapshotted is the run's at its mini-batch."""
    return record["state_fingerprint"] == [fingerprints[record["mini_batch"]]]


def test_audit_at_last_mini_batch_leaves_the_update_identical_and_audits_its_state(setup):
    lm, batch = setup
    cfg = _cfg("last")
    ref_policy, ref_opt = _fresh(lm, batch, cfg)
    ref_metrics, ref_seen = _update(ref_policy, ref_opt, batch, cfg)
    policy, opt = _fresh(lm, batch, cfg)
    audit = _audit(policy, opt, batch, cfg)
    metrics, seen = _update(policy, opt, batch, cfg, audit)
    assert seen == ref_seen  # every mini-batch started from the same state as without the audit
    assert _identical(_state_copy(ref_policy, ref_opt), _state_copy(policy, opt)) == {"params": True, "state": True}
    assert metrics.keys() == ref_metrics.keys()
    assert all(metrics[k] == ref_metrics[k] or (math.isnan(metrics[k]) and math.isnan(ref_metrics[k]))
               for k in metrics)
    (record,) = audit.records
    assert record["mini_batch"] == 3 and record["mini_batches"] == 4
    assert record["tokens"] == int(batch.select([6, 7]).response_mask.sum())  # mini-batch 3's rows only
    assert record["outside"] > 0
    assert audited_state_matches(record, seen)
    # ``all``: one record per mini-batch, each at its own state
    policy, opt = _fresh(lm, batch, cfg)
    audit = _audit(policy, opt, batch, _cfg("all"))
    _, seen = _update(policy, opt, batch, cfg, audit)
    assert [r["mini_batch"] for r in audit.records] == [0, 1, 2, 3]
    assert all(audited_state_matches(r, seen) for r in audit.records)
    assert len({r["state_fingerprint"][0] for r in audit.records}) == 4


def test_a_planted_audit_that_snapshots_at_the_step_start_is_caught(setup):
    lm, batch = setup
    cfg = _cfg("last")
    policy, opt = _fresh(lm, batch, cfg)
    rows = train_step.split(len(batch), cfg.trainer.mini_batches)
    planted = []

    def at_step_start(j, _rows):  # the old placement: before the update, on mini-batch 3's rows
        if j == 0:
            planted.append(audit_step.audit_live_batch(policy, opt, batch.select(rows[3]), ADV[rows[3]], cfg=cfg,
                                                       vocab_size=VOCAB, pad_id=0, lr=1e-2, mini_batch=3))

    _, seen = _update(policy, opt, batch, cfg, at_step_start)
    (record,) = planted
    assert record["mini_batch"] == 3 and not audited_state_matches(record, seen)
    assert record["state_fingerprint"] == [seen[0]]


def test_regime_is_logged_per_mini_batch_and_pooled(setup):
    lm, batch = setup
    cfg = _cfg()
    policy = PolicyModel(copy.deepcopy(lm))
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    rows = []
    upd = train_step.update_policy(policy, opt, batch, ADV, cfg=cfg, vocab_size=VOCAB, pad_id=0, lr=1e-2,
                                   mismatch_sample=lambda s, a, r, mini_batch: rows.append(mini_batch))
    m = upd.metrics
    assert sorted(set(rows)) == [0, 1, 2, 3]  # the sample is taken at every mini-batch
    assert m["mismatch/mb0/topk_kl_mean"] == m["mismatch/topk_kl_mean"]  # the plain keys: j = 0
    assert m["mismatch/mb0/topk_kl_mean"] < 1e-6 and m["mismatch/mb0/d_max"] < 1e-5  # μ = π before any step
    for j in (1, 2, 3):
        assert m[f"mismatch/mb{j}/topk_kl_mean"] > 1e-4 and m[f"mismatch/mb{j}/d_p50"] > 0
    tokens = [m[f"mismatch/mb{j}/tokens"] for j in range(4)]
    assert m["mismatch/pooled/tokens"] == sum(tokens) == int(batch.response_mask.sum())
    mean = sum(m[f"mismatch/mb{j}/topk_kl_mean"] * t for j, t in enumerate(tokens)) / sum(tokens)
    assert m["mismatch/pooled/topk_kl_mean"] == pytest.approx(mean, rel=1e-5)
    for key in ("d_p50", "d_p99", "d_max", "outside_frac", "outside_frac@0.01", "tail_ratio", "topk_mass_ge_099"):
        assert f"mismatch/mb3/{key}" in m and f"mismatch/pooled/{key}" in m
    assert "mismatch/mb0/outside_frac@0.15" not in m  # the ladder lists δ below the mask's (0.02)


def test_calibrate_from_run_prints_every_mini_batch_and_the_pooled_row(tmp_path, capsys):
    from pdm_lab.cli.main import main

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 1, "mini_batch": j, "d": (j + 1) * 1e-3 * (1 + i % 5), "mu_tail": 0.001, "pi_tail": 0.001,
             "r": 1.0, "adv": 1.0} for j in range(3) for i in range(40)]
    rows += [{"step": 0, "d": 0.2, "mu_tail": 0.001, "pi_tail": 0.001, "r": 1.0, "adv": 1.0}]  # old row: j = 0
    (run / "mismatch_sample.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["calibrate", "--from-run", str(run), "--delta", "0.01", "--out", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    for name in ("j = 0", "j = 1", "j = 2", "pooled"):
        assert name in out, out
    assert "compared with the pooled row" in out
    doc = json.loads((tmp_path / "c" / "calibration.json").read_text())
    assert doc["compared"] == "pooled" and sorted(doc["mini_batches"]) == ["0", "1", "2"]
    assert doc["mini_batches"]["0"]["tokens"] == 41 and doc["tokens"] == 121


# ------------------------------------------------------------------ the tiny vLLM loop
STALE_RUN = ("total_steps=2", "rollout.precision=fp32", "rollout.prompts_per_step=8", "rollout.group_size=4",
             "trainer.mini_batches=4", "trainer.micro_batch_size=8", "trainer.warmup_steps=0", "trainer.lr=0.001",
             "log.tensorboard=false")


def _train(tmp_path: Path, name: str, cache: Path, *extra: str) -> Path:
    from loop_helpers import tiny_loop

    cmd, env = tiny_loop(tmp_path / name, *STALE_RUN, *extra)
    env["PDM_LAB_CACHE"] = str(cache)  # one model build for both runs
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return tmp_path / name / "run"


AUDIT_LAST = ("audit.every=1", "audit.mini_batch=last", "audit.delta=1e-6", "audit.probe_tokens=2",
              "audit.step_scales=[1.0]")


def _off_and_on(tmp_path_factory, name: str, *extra: str) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp(name)
    (tmp / "off").mkdir()
    (tmp / "on").mkdir()
    return _train(tmp, "off", tmp / "cache", *extra), _train(tmp, "on", tmp / "cache", *extra, *AUDIT_LAST)


@pytest.fixture(scope="module")
def stale_runs(tmp_path_factory):
    return _off_and_on(tmp_path_factory, "stale")


@pytest.fixture(scope="module")
def stale_runs_two_ranks(tmp_path_factory):
    """The same pair on two FSDP2 ranks (gloo): each rank audits its rows of mini-batch j."""
    return _off_and_on(tmp_path_factory, "stale2", "launch.nproc_per_node=2")


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.vllm
def test_fp32_engine_regime_grows_with_the_mini_batch_and_calibrate_prints_it(stale_runs, tmp_path):
    off, _ = stale_runs
    for m in (r for r in _lines(off / "metrics.jsonl") if r["step"] > 0):
        d = [m[f"mismatch/mb{j}/topk_kl_mean"] for j in range(4)]
        assert d[0] < 1e-5, d  # fp32 engine, no noise: the numerics alone
        assert min(d[1:]) > 10 * d[0] and d[3] > d[1], d  # j steps of staleness
        assert m["mismatch/mb3/d_max"] > m["mismatch/mb0/d_max"]
        assert m["mismatch/pooled/tokens"] == sum(m[f"mismatch/mb{j}/tokens"] for j in range(4))
    sample = _lines(off / "mismatch_sample.jsonl")
    assert {r["mini_batch"] for r in sample} == {0, 1, 2, 3}
    proc = subprocess.run([sys.executable, "-m", "pdm_lab", "calibrate", "--from-run", str(off), "--delta", "1e-4",
                           "--out", str(tmp_path / "c")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("j = 0", "j = 1", "j = 2", "j = 3", "pooled", "compared with the pooled row"):
        assert name in proc.stdout, proc.stdout


def _weights(run: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    (ckpt,) = sorted(p for p in (run / "checkpoints").iterdir() if p.is_dir())
    out = run.parent / "weights.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    state = torch.load(out, weights_only=False)
    return state


def _flatten(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flatten(v, f"{prefix}{k}/")
    elif torch.is_tensor(obj):
        yield prefix, obj
    else:
        yield prefix, obj


@pytest.mark.slow
@pytest.mark.vllm
def test_audit_at_the_last_mini_batch_leaves_the_run_identical(stale_runs):
    _assert_identical(*stale_runs, ranks=1)


@pytest.mark.slow
@pytest.mark.vllm
def test_audit_at_the_last_mini_batch_leaves_a_two_rank_fsdp2_run_identical(stale_runs_two_ranks):
    _assert_identical(*stale_runs_two_ranks, ranks=2)


def _assert_identical(off: Path, on: Path, ranks: int) -> None:
    audit = _lines(on / "audit.jsonl")
    assert [(r["step"], r["mini_batch"]) for r in audit] == [(1, 3), (2, 3)]
    assert all(r["outside"] > 0 and len(r["state_fingerprint"]) == ranks for r in audit)
    assert all(len(r["outside_tokens"]) == ranks for r in audit)
    a, b = _lines(off / "metrics.jsonl"), _lines(on / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b]
    skip = ("time/", "mem/", "audit/")
    for ra, rb in zip(a, b):
        train = {k: v for k, v in ra.items() if not k.startswith(skip)}
        assert train == {k: v for k, v in rb.items() if not k.startswith(skip)}
        assert rb.get("audit/mini_batch", 3.0) == 3.0
    wa, wb = dict(_flatten(_weights(off))), dict(_flatten(_weights(on)))
    assert wa.keys() == wb.keys()
    for key, va in wa.items():
        vb = wb[key]
        assert (torch.equal(va, vb) if torch.is_tensor(va) else va == vb), key
