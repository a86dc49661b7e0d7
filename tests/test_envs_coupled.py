"""The aggregate ΔD_O study of ``pdm_coupled`` (envs/coupled_audit.py) and the toy trainer's hook."""
import json
import math

import pytest

from pdm_lab.config import MaskConfig
from pdm_lab.envs.audit import AuditConfig
from pdm_lab.envs.bandit import BanditConfig
from pdm_lab.envs.coupled_audit import CoupledAuditConfig, run_coupled_audit
from pdm_lab.envs.problems import ProblemConfig
from pdm_lab.envs.train import TrainConfig, train

BANDIT = ProblemConfig(bandit=BanditConfig(vocab_size=200, num_prompts=32))


def _cfg(policy: str, one: bool, seeds: int = 2) -> CoupledAuditConfig:
    audit = AuditConfig(problem=BANDIT, policy=policy, seeds=seeds, sequences=128, group_size=8,
                        single_token=False, k_sweep=(), n_boot=200, delta=0.15)
    return CoupledAuditConfig(audit=audit, step_scales=(0.01, 1.0, 10.0), one_token_per_state=one)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    out = tmp_path_factory.mktemp("coupled_audit")
    return out, run_coupled_audit(_cfg("neural", False), out)


def test_document_and_first_order(shared):
    out, doc = shared
    s = doc["summary"]
    assert set(s["rules"]) == {"dppo_topk_kl", "pdm_topk", "pdm_uniform", "pdm_coupled"}
    assert set(s["vs_coupled"]) == {"dppo_topk_kl", "pdm_topk", "pdm_uniform"}
    for seed in doc["per_seed"]:
        assert seed["outside"] > 0 and seed["tokens_per_state"] > 1
        for rule, entry in seed["rules"].items():
            # at a small step the realised ΔD_O is its first-order prediction (η/N) Σ M c
            real, pred = entry["delta_d_outside"]["0.01"], entry["predicted"]["0.01"]
            assert abs(real - pred) <= 0.02 * abs(pred) + 1e-12, (rule, real, pred)
            assert math.isclose(entry["predicted_from_outside"] + entry["predicted_from_inside"],
                                entry["predicted"]["1"], rel_tol=1e-9, abs_tol=1e-15)
        # pdm_coupled keeps no out-of-region token whose c > 0: O's own first-order part is ≤ 0
        assert seed["rules"]["pdm_coupled"]["kept_outside_positive_c"] == 0
        assert seed["rules"]["pdm_coupled"]["predicted_from_outside"] <= 0
        assert seed["rules"]["pdm_coupled"]["predicted_from_outside"] <= min(
            seed["rules"][r]["predicted_from_outside"] for r in seed["rules"])
    comp = s["vs_coupled"]["pdm_topk"]["1"]
    assert comp["ci_low"] <= comp["mean_diff"] <= comp["ci_high"] and 0 <= comp["sign_test_p"] <= 1
    assert json.loads((out / "coupled_audit.json").read_text())["summary"]["seeds"] == 2


def test_resume_reads_finished_seeds(shared):
    out, doc = shared
    again = run_coupled_audit(_cfg("neural", False), out)
    assert json.dumps(again["per_seed"]) == json.dumps(doc["per_seed"])  # NaN rates compare as text
    assert len((out / "per_seed.jsonl").read_text().splitlines()) == 2


def test_tabular_one_token_per_state_coupled_is_topk():
    doc = run_coupled_audit(_cfg("tabular", True, seeds=1))
    seed = doc["per_seed"][0]
    assert seed["active_tokens"] <= seed["distinct_states"] and seed["outside"] > 0
    assert seed["rules"]["pdm_coupled"]["delta_d_outside"] == seed["rules"]["pdm_topk"]["delta_d_outside"]
    assert seed["rules"]["pdm_coupled"]["vs_ref"]["disagreement"] == seed["rules"]["pdm_topk"]["vs_ref"]["disagreement"]


def test_toy_training_with_pdm_coupled_and_adam():
    cfg = TrainConfig(problem=BANDIT, policy="neural", mismatch="noise:1", steps=3, groups_per_step=4,
                      group_size=8, mask=MaskConfig(rule="pdm_coupled"), optimizer="adam", minibatches=2)
    out = train(cfg)
    assert math.isfinite(out["final_reward"]) and out["steps_done"] == 3
    assert 0 < out["mask_fraction"] < 1
