"""An audit left on costs one forward on a batch with nothing to audit: no snapshot, no step, a
record with the audited batch's keys and zero counts; a batch with one token past δ is audited."""
import pytest
import torch

from pdm_lab import MaskConfig
from pdm_lab.audit import live
from pdm_lab.audit.live import LiveAuditConfig, StepOutcome, run_live_audit


class ToyStage:
    """One parameter vector; D of token i is d0[i] + θ·g[i]; a step moves θ by −lr."""

    def __init__(self, d0):
        self.theta = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        self.params = [self.theta]
        self.optimizer = torch.optim.SGD(self.params, lr=0.1)
        self.d0 = torch.as_tensor(d0, dtype=torch.float64)
        self.g = torch.linspace(-1, 1, self.d0.numel(), dtype=torch.float64)
        self.advantages = torch.ones_like(self.d0)
        self.steps = 0

    def step(self, rule, optimizer, *, lr_scale, zero_advantages):
        self.steps += 1
        optimizer.zero_grad()
        (self.theta.sum() * (0.0 if zero_advantages else 1.0)).backward()
        optimizer.step()
        n = self.d0.numel()
        keep = torch.ones(n, dtype=torch.bool) if rule == "dppo_topk_kl" else self.g < 0
        return StepOutcome(keep=keep, topk_kl=self.d0.clone(), mu_tail=torch.full((n,), 0.01, dtype=torch.float64),
                           advantages=self.advantages, ratio=torch.ones(n, dtype=torch.float64))

    def measure(self):
        return (self.d0 + self.theta.detach() * self.g).detach()


def _audit(stage):
    return run_live_audit(stage, rules=("dppo_topk_kl", "pdm_topk"), cfg=LiveAuditConfig(every=1, probe_tokens=0),
                          mask_cfg=MaskConfig(rule="pdm_topk", delta=0.15), delta=0.15, contexts=4)


def test_a_batch_with_nothing_near_delta_takes_no_snapshot_and_no_step(monkeypatch):
    def no_snapshot(*a, **k):
        raise AssertionError("an idle batch must not be snapshotted")

    monkeypatch.setattr(live.HostSnapshot, "take", no_snapshot)
    stage = ToyStage([1e-4, 2e-3, 0.01, 0.1])
    record = _audit(stage)
    assert stage.steps == 0 and record["idle"] and record["outside"] == 0
    assert record["pairs"]["dppo_topk_kl|pdm_topk"]["disagreement"] == 0
    assert record["tokens"] == 4 and record["zero_advantage"] == 0 and "regime" in record
    assert float(stage.theta.detach()) == 0.0


def test_an_idle_record_has_the_audited_records_keys():
    idle = _audit(ToyStage([1e-4, 2e-3, 0.01, 0.1]))
    busy = _audit(ToyStage([1e-4, 2e-3, 0.01, 0.3]))
    assert not busy.get("idle") and busy["outside"] == 1
    assert set(busy) - set(idle) == set(), set(busy) - set(idle)
    assert set(idle["step_scales"]) == set(busy["step_scales"])


@pytest.mark.parametrize("just_past", [0.15 * 0.995, 0.1500001])
def test_a_token_near_or_past_delta_is_audited(just_past):
    """The idle check is conservative: D within 1% below δ already triggers the full audit (the
    loss-time D deciding "outside" is float32)."""
    stage = ToyStage([1e-4, just_past])
    record = _audit(stage)
    assert not record.get("idle") and stage.steps > 0


def _measure_refused(stage):
    def refuse():
        raise AssertionError("the idle check ran a forward although the loss's D at θ₀ was given")

    stage.measure = refuse
    return stage


def test_the_losss_own_divergence_makes_the_idle_check_free():
    """With ``at_start`` (D at θ₀ from the trainer's own loss) an idle batch costs no forward: the
    record says where its D came from and carries the loss's values in its regime."""
    d = torch.tensor([1e-4, 2e-3, 0.01, 0.1], dtype=torch.float32)
    stage = _measure_refused(ToyStage(d.double()))
    record = run_live_audit(stage, rules=("dppo_topk_kl", "pdm_topk"), cfg=LiveAuditConfig(every=1, probe_tokens=0),
                            mask_cfg=MaskConfig(rule="pdm_topk", delta=0.15), delta=0.15, contexts=4,
                            at_start=live.LossDivergence(topk_kl=d, mu_tail=torch.full((4,), 0.01)))
    assert record["idle"] and record["idle_check"] == "loss" and stage.steps == 0
    assert record["peak_d"] == pytest.approx(0.1) and record["tokens"] == 4
    assert _audit(ToyStage(d.double()))["idle_check"] == "forward"


@pytest.mark.parametrize("near", [0.15 * 0.995, 0.2])
def test_a_busy_batch_by_the_losss_divergence_is_measured_again_and_audited(near):
    """The loss's D decides only "idle": a batch with a token near δ is re-measured in float64 by
    the stage (its ΔD needs D before at full precision) and audited in full."""
    d0 = torch.tensor([1e-4, near], dtype=torch.float64)
    stage = ToyStage(d0)
    calls = []
    measure = stage.measure
    stage.measure = lambda: calls.append(1) or measure()
    record = run_live_audit(stage, rules=("dppo_topk_kl", "pdm_topk"), cfg=LiveAuditConfig(every=1, probe_tokens=0),
                            mask_cfg=MaskConfig(rule="pdm_topk", delta=0.15), delta=0.15, contexts=4,
                            at_start=live.LossDivergence(topk_kl=d0.float(), mu_tail=torch.full((2,), 0.01)))
    assert not record.get("idle") and stage.steps > 0 and len(calls) >= 1
