"""The aggregate ΔD_O study of ``pdm_coupled`` (envs/audit/coupled.py) and the toy trainer's hook."""
import json
import math

import pytest

from pdm_lab.mask_config import MaskConfig
from pdm_lab.envs.audit.config import AuditConfig
from pdm_lab.envs.problems.bandit import BanditConfig
from pdm_lab.envs.audit.coupled import CoupledAuditConfig, run_coupled_audit
from pdm_lab.envs.problems.problem import ProblemConfig
from pdm_lab.envs.train.grpo import TrainConfig, train

BANDIT = ProblemConfig(bandit=BanditConfig(vocab_size=200, num_prompts=32))


def _cfg(policy: str, seeds: int = 2) -> CoupledAuditConfig:
    audit = AuditConfig(problem=BANDIT, policy=policy, seeds=seeds, sequences=128, group_size=8, k_sweep=(),
                        n_boot=200, delta=0.15, mismatch="noise:1")
    return CoupledAuditConfig(audit=audit, step_scales=(0.1, 1.0, 100.0))


@pytest.fixture(scope="module")
def neural(tmp_path_factory):
    out = tmp_path_factory.mktemp("coupled_audit")
    return out, run_coupled_audit(_cfg("neural"), out)


def test_document_and_first_order(neural):
    out, doc = neural
    s = doc["summary"]["shared"]
    assert set(s["rules"]) == {"dppo_topk_kl", "pdm_topk", "pdm_uniform", "pdm_coupled"}
    assert set(s["delta_d_vs_coupled"]) == {"dppo_topk_kl", "pdm_topk", "pdm_uniform"}
    for seed in doc["per_seed"]:
        assert seed["outside"] > 0 and seed["tokens_per_state"] > 1
        rec = seed["contexts"]["shared"]
        for rule, entry in rec["rules"].items():
            # at a small step the realised ΔD_O is its first-order prediction η Σ M c
            real, pred = entry["delta_d_outside"]["0.1"], entry["predicted"]["0.1"]
            assert abs(real - pred) <= 0.02 * abs(pred) + 1e-12, (rule, real, pred)
            assert math.isclose(entry["predicted_from_outside"] + entry["predicted_from_inside"],
                                entry["predicted"]["1"], rel_tol=1e-9, abs_tol=1e-15)
        # pdm_coupled keeps no out-of-region token whose c > 0: O's own first-order part is ≤ 0
        coupled = rec["rules"]["pdm_coupled"]
        assert coupled["kept_outside_positive_c"] == 0 and coupled["predicted_from_outside"] <= 0
        assert coupled["predicted_from_outside"] <= min(r["predicted_from_outside"] for r in rec["rules"].values())
    comp = s["delta_d_vs_coupled"]["pdm_topk"]["1"]
    assert comp["ci_low"] <= comp["mean_diff"] <= comp["ci_high"] and 0 <= comp["sign_test_p"] <= 1
    assert json.loads((out / "coupled_audit.json").read_text())["summary"]["shared"]["seeds"] == 2
    report = (out / "report.md").read_text()
    for text in ("## Contexts: shared", "## Contexts: distinct", "`pdm_coupled`", "precision float64", "η = 0.001"):
        assert text in report, text
    # the realised ΔD_O of each rule appears as measured
    assert f"{s['rules']['pdm_topk']['1']['delta_d_outside_mean']:.3g}" in report


def test_distinct_contexts_coupled_is_topk(neural):
    # one token per state (a per-token table), P = I: c_t = Â r Ḋ_topk, the same mask as pdm_topk
    for seed in neural[1]["per_seed"]:
        rec = seed["contexts"]["distinct"]["rules"]
        assert rec["pdm_coupled"]["delta_d_outside"] == rec["pdm_topk"]["delta_d_outside"]
        assert rec["pdm_coupled"]["vs_ref"]["disagreement"] == rec["pdm_topk"]["vs_ref"]["disagreement"]


def test_resume_reads_finished_seeds(neural):
    out, doc = neural
    again = run_coupled_audit(_cfg("neural"), out)
    assert json.dumps(again["per_seed"]) == json.dumps(doc["per_seed"])  # NaN rates compare as text
    assert len((out / "per_seed.jsonl").read_text().splitlines()) == 2


def test_toy_training_with_pdm_coupled_and_adam():
    cfg = TrainConfig(problem=BANDIT, policy="neural", mismatch="noise:1", steps=3, groups_per_step=4,
                      group_size=8, mask=MaskConfig(rule="pdm_coupled"), optimizer="adam", minibatches=2)
    out = train(cfg)
    assert math.isfinite(out["final_reward"]) and out["steps_done"] == 3
    assert 0 < out["mask_fraction"] < 1


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_scaled_steps_equal_separate_steps(optimizer):
    # rule_steps takes η·s as s times the step at η (both first steps are linear in η): the same
    # ΔD as a separate optimiser step at η·s, to float64 rounding
    import copy
    import dataclasses

    import torch

    from pdm_lab.envs.audit.batch import audit_batch, float64_tokens
    from pdm_lab.envs.audit.step import measure, rule_step, rule_steps
    from pdm_lab.envs.train.update import current_stats
    from pdm_lab.masks import outside_region

    audit = dataclasses.replace(_cfg("neural", seeds=1).audit, optimizer=optimizer)
    _, policy, batch, adv = audit_batch(audit, 0)
    mask = audit.mask("pdm_topk")
    tokens = float64_tokens(batch, adv, mask)
    model = copy.deepcopy(policy).to(torch.float64)
    with torch.no_grad():
        stats = current_stats(model, tokens, full=False)
    focus = torch.nonzero(outside_region(stats.topk_kl, tokens.advantages.reshape(-1), mask) & tokens.response_mask.reshape(-1))[:, 0]
    assert focus.numel() > 0
    before = measure(model, tokens.rows(focus))
    scaled = rule_steps(model, tokens, mask, audit, focus, before, (0.1, 1.0, 10.0))
    for scale, step in scaled.items():
        alone = rule_step(model, tokens, mask, dataclasses.replace(audit, lr=audit.lr * scale), focus, before)
        assert torch.equal(step.keep, alone.keep)
        for name in ("topk_kl", "full_kl"):
            torch.testing.assert_close(step.delta[name][focus], alone.delta[name][focus], rtol=1e-9, atol=1e-13)
