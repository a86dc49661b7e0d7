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


def _idle_run(tiny_dir, out, **extra):
    # no cut, HF generate: μ is the trainer's own model (D ≈ 1e-7 ≪ δ): every audited batch is idle
    from trl import GRPOConfig

    from pdm_lab.integrations.trl import PDMGRPOTrainer

    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=10, max_steps=1, learning_rate=5e-2, beta=0.0, temperature=1.0, top_k=0,
                      top_p=1.0, logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="no", bf16=False,
                      **extra)
    trainer = PDMGRPOTrainer(model=str(tiny_dir), reward_funcs=_reward, args=args, train_dataset=_dataset(),
                             mask=MaskConfig(rule="pdm_topk", delta=0.02, k=K),
                             audit=LiveAuditConfig(every=1, rules=RULES, probe_tokens=4))
    trainer.train()
    return trainer, [json.loads(x) for x in (out / "audit.jsonl").read_text().splitlines()]


def test_idle_audited_step_writes_an_idle_line_without_a_forward_a_snapshot_or_a_step(tiny_dir, tmp_path,
                                                                                     monkeypatch):
    # the idle check reads the loss's own D at θ₀ (the step's forward saw every row): no forward of
    # its own, no snapshot, no audited step (all three planted to raise)
    from pdm_lab.audit import live
    from pdm_lab.integrations.trl_audit_stage import TRLAuditStage

    def refuse(*args, **kwargs):
        raise AssertionError("an idle audit ran a forward, took a snapshot or a step")

    monkeypatch.setattr(live.HostSnapshot, "take", refuse)
    monkeypatch.setattr(TRLAuditStage, "step", refuse)
    monkeypatch.setattr(TRLAuditStage, "measure", refuse)
    trainer, lines = _idle_run(tiny_dir, tmp_path / "idle")
    assert len(lines) == 1 and lines[0]["step"] == 1, lines
    r = lines[0]
    assert r["idle"] is True and r["idle_check"] == "loss" and r["outside"] == 0
    assert r["host_snapshot_bytes"] == 0 and r["probe"] is None
    assert 0 < r["tokens"] and r["peak_d"] <= 0.99 * 0.02
    assert all(p["disagreement"] == 0 for p in r["pairs"].values())
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert "pdm/time/audit_s" in logged and "pdm/audit/outside" in logged


def test_the_losss_divergence_is_the_float64_forwards_to_float32_rounding(tiny_dir, tmp_path, monkeypatch):
    """The values the idle check reads are D at θ₀ of the audited tokens, in the stage's order:
    against the stage's own float64 forward on the same batch, token by token (the top-k 4 cut
    makes D −log π(top 4) ≈ 0.1–1, far above float32 rounding; δ 50 keeps both batches idle)."""
    from pdm_lab.audit import live
    from pdm_lab.integrations import trl_audit

    seen = []
    run = live.run_live_audit

    def compare(stage, **kwargs):
        seen.append((kwargs["at_start"], stage.measure()))
        return run(stage, **kwargs)

    monkeypatch.setattr(trl_audit, "run_live_audit", compare)
    _train(tiny_dir, tmp_path / "compare", LiveAuditConfig(every=1, rules=RULES, delta=50.0, probe_tokens=0))
    assert len(seen) == 2
    for at_start, forward in seen:
        assert at_start is not None and at_start.topk_kl.shape == forward.shape and float(forward.min()) > 1e-3
        torch.testing.assert_close(at_start.topk_kl.double(), forward, rtol=1e-4, atol=1e-6)
        # a planted misorder (the loss's D put back in the wrong token order) is caught
        assert not torch.allclose(at_start.topk_kl.double().flip(0), forward, rtol=1e-4, atol=1e-6)
    lines = [json.loads(x) for x in (tmp_path / "compare" / "audit.jsonl").read_text().splitlines()]
    assert [(r["idle"], r["idle_check"]) for r in lines] == [(True, "loss")] * 2


def test_a_batch_the_step_saw_only_in_part_is_checked_by_its_own_forward(tiny_dir, tmp_path):
    # steps_per_generation 2 > gradient_accumulation_steps 1: the first step sees half the batch, so
    # the loss's D at θ₀ does not cover it and the idle check measures the batch itself
    _, lines = _idle_run(tiny_dir, tmp_path / "part", steps_per_generation=2)
    assert [r["idle_check"] for r in lines] == ["forward"] and lines[0]["idle"] is True


def test_the_audit_is_refused_by_name_under_deepspeed():
    # DeepSpeed steps inside backward, before the audit's pre-step hook: the audit would read the
    # stepped state as θ₀, so it is refused (the check PDMGRPOTrainer runs after TRL's __init__)
    from pdm_lab.config import ConfigError
    from pdm_lab.integrations.trl import _refuse_audit_under_deepspeed

    with pytest.raises(ConfigError, match="audit.every: .*DeepSpeed"):
        _refuse_audit_under_deepspeed(LiveAuditConfig(every=1), deepspeed=True)
    _refuse_audit_under_deepspeed(LiveAuditConfig(every=0), deepspeed=True)  # no audit: nothing to refuse
    _refuse_audit_under_deepspeed(LiveAuditConfig(every=1), deepspeed=False)
