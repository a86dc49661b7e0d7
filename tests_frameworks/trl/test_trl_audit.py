"""The direction audit inside ``PDMGRPOTrainer`` (SPEC §6c), HF-generate mode on the tiny Qwen3.

* two TRL steps with ``audit=LiveAuditConfig(every=1, …)`` write ``output_dir/audit.jsonl`` in the
  scaling loop's keys and put the per-rule rates into TRL's logs;
* the audit leaves training untouched: the final weights equal a run without the audit bit for
  bit; a planted bug (the optimiser state not restored) changes them.
"""
from __future__ import annotations

import json

import pytest
import torch

from pdm_lab import MaskConfig
from pdm_lab.audit.live import LiveAuditConfig

from test_trl_trainer import K, _dataset, _reward, build_tiny

RULES = ("dppo_topk_kl", "pdm_topk", "none")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny-qwen3-audit"))


def _train(tiny_dir, out, audit: LiveAuditConfig | None):
    # μ is the generating model itself, so D > 0 only where sampling cut μ: top-k 4 renormalises μ
    # on 4 tokens (the rest −inf, a legal zero), D = −log π(top 4) there — with the sampling mask
    # off (keep_sampling_mask=False), so that the cut stays a mismatch for the audit to find
    from trl import GRPOConfig

    from pdm_lab.integrations.trl import PDMGRPOTrainer

    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=4, num_generations=4, max_completion_length=10,
                      max_steps=2, learning_rate=5e-2, beta=0.0, temperature=1.0, top_k=4, top_p=1.0, logging_steps=1,
                      report_to=[], use_cpu=True, seed=0, save_strategy="no", bf16=False)
    trainer = PDMGRPOTrainer(model=str(tiny_dir), reward_funcs=_reward, args=args, train_dataset=_dataset(),
                             mask=MaskConfig(rule="pdm_topk", delta=0.02, k=K), audit=audit,
                             keep_sampling_mask=False)
    trainer.train()
    return trainer


def test_audit_writes_audit_jsonl_and_logs_rates_without_changing_training(tiny_dir, tmp_path, monkeypatch):
    # the probe is tested by test_trl_audit_probe.py; here a small one keeps the bit-exact restore test quick
    audit = LiveAuditConfig(every=1, rules=RULES, delta=0.02, probe_tokens=4, step_scales=(1.0,))
    plain = _train(tiny_dir, tmp_path / "plain", None)
    audited = _train(tiny_dir, tmp_path / "audited", audit)

    lines = [json.loads(x) for x in (tmp_path / "audited" / "audit.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        assert r["rules"] == list(RULES) and r["delta"] == 0.02 and r["k"] == K
        assert set(r["pairs"]) == {"dppo_topk_kl|pdm_topk", "dppo_topk_kl|none"}
        assert 0 < r["outside"] <= r["tokens"]
        for rule in ("dppo_topk_kl", "pdm_topk"):
            rates = r["pairs"]["dppo_topk_kl|pdm_topk"][rule]["topk_kl"]
            assert rates["count"] == rates["grew"] + rates["shrank"] + rates["flat_count"]
        assert r["regime"]["outside_tokens"] == r["outside"]
    logged = {k for entry in audited.state.log_history for k in entry}
    assert "pdm/audit/outside" in logged and "pdm/time/audit_s" in logged
    assert any(k.startswith("pdm/audit/dppo_topk_kl|pdm_topk/") and k.endswith("/kept") for k in logged)

    # the audit restored parameters, AdamW's state and the RNG: training went on as without it
    for (name, p), q in zip(plain.model.named_parameters(), audited.model.parameters()):
        assert torch.equal(p, q), name

    # the planted bug: AdamW's state not restored after the audited steps
    import importlib

    for name in ("pdm_lab.audit.live", "pdm_lab.audit.snapshot"):  # wherever the snapshot's restore lives
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "restore_optimizer"):
            monkeypatch.setattr(module, "restore_optimizer", lambda *args: None)
    broken = _train(tiny_dir, tmp_path / "broken", audit)
    assert not all(torch.equal(p, q) for p, q in zip(plain.model.parameters(), broken.model.parameters()))


def test_idle_audited_step_writes_an_idle_line_and_takes_no_snapshot(tiny_dir, tmp_path, monkeypatch):
    # no cut, HF generate: μ is the trainer's own model (D ≈ 1e-7 ≪ δ): the audit's idle path, one
    # forward, no snapshot and no audited step (both planted to raise)
    from trl import GRPOConfig

    from pdm_lab.audit import live
    from pdm_lab.integrations.trl import PDMGRPOTrainer
    from pdm_lab.integrations.trl_audit_stage import TRLAuditStage

    def refuse(*args, **kwargs):
        raise AssertionError("an idle audit took a snapshot or a step")

    monkeypatch.setattr(live.HostSnapshot, "take", refuse)
    monkeypatch.setattr(TRLAuditStage, "step", refuse)
    args = GRPOConfig(output_dir=str(tmp_path / "idle"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=10, max_steps=1, learning_rate=5e-2, beta=0.0, temperature=1.0, top_k=0,
                      top_p=1.0, logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="no", bf16=False)
    trainer = PDMGRPOTrainer(model=str(tiny_dir), reward_funcs=_reward, args=args, train_dataset=_dataset(),
                             mask=MaskConfig(rule="pdm_topk", delta=0.02, k=K),
                             audit=LiveAuditConfig(every=1, rules=RULES, probe_tokens=4))
    trainer.train()
    lines = [json.loads(x) for x in (tmp_path / "idle" / "audit.jsonl").read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["step"] == 1, lines
    r = lines[0]
    assert r["idle"] is True and r["outside"] == 0 and r["host_snapshot_bytes"] == 0 and r["probe"] is None
    assert 0 < r["tokens"] and r["peak_d"] <= 0.99 * 0.02
    assert all(p["disagreement"] == 0 for p in r["pairs"].values())
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert "pdm/time/audit_s" in logged and "pdm/audit/outside" in logged
