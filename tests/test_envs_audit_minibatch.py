"""The toy audit at a stated mini-batch j (SPEC §6b, §6c): one rollout batch trained over M
mini-batches, mini-batch j audited after j real optimiser steps on the same rollouts; and the
transfer/mechanism comparisons like with like (the run's j against the toy's j)."""
from __future__ import annotations

import json

import pytest
import torch

from pdm_lab.audit.probe_record import step_scale_record
from pdm_lab.config import ConfigError, from_dict, to_dict

from pdm_lab.envs.audit import batch as batch_mod
from pdm_lab.envs.audit.batch import audit_batch
from pdm_lab.envs.audit.config import AuditConfig
from pdm_lab.envs.audit.points import TrainedPolicies
from pdm_lab.envs.audit.seed import audit_seed
from pdm_lab.envs.audit.study import run_audit
from pdm_lab.envs.problems.problem import make_problem
from pdm_lab.envs.transfer import compare as transfer
from pdm_lab.envs.transfer.mechanism import mechanism_doc, mechanism_markdown

# a neural bandit (its head is shared by every prompt, so steps on other groups move mini-batch j's
# π), 16 groups of 8: four mini-batches of four whole groups
NET = dict(policy="neural", sequences=128, group_size=8, extra_rules=(), contexts=("shared",), flip_tokens=0)


def staleness_failures(cfg: AuditConfig, seed: int = 0) -> list[str]:
    """Why the audited π at mini-batch j is not the audit point's after j steps on the batch's
    other mini-batches, if it is not."""
    j = cfg.audited_mini_batch
    problem = make_problem(cfg.problem)
    policies = TrainedPolicies(cfg, problem)
    point = policies.at(seed % cfg.train_runs, cfg.main_step)
    _, policy, batch, adv = audit_batch(cfg, seed, policies=policies)
    failures = []
    steps = getattr(policy, "audit_mini_batch", {}).get("optimizer_steps")
    if steps != j:
        failures.append(f"optimizer steps before mini-batch {j}: {steps}")
    moved = any(not torch.equal(a, b) for a, b in zip(point.parameters(), policy.parameters()))
    if moved != (j > 0):
        failures.append(f"parameters {'moved' if moved else 'did not move'} with j = {j}")
    if batch.num_sequences != cfg.sequences // cfg.mini_batches or adv.shape[0] != batch.num_sequences:
        failures.append(f"audited {batch.num_sequences} sequences, not one mini-batch")
    return failures


def test_mini_batch_3_of_4_is_audited_after_three_optimiser_steps():
    cfg = AuditConfig(**NET, mismatch="none", mini_batches=4, mini_batch=3)
    assert staleness_failures(cfg) == []
    assert staleness_failures(AuditConfig(**NET, mismatch="none", mini_batches=4, mini_batch="first")) == []
    record = audit_seed(cfg, 0)
    assert (record["mini_batch"], record["mini_batches"], record["optimizer_steps_before"]) == (3, 4, 3)
    assert record["tokens"] == cfg.sequences // 4  # the bandit: one token per sequence


def test_planted_bug_no_steps_before_the_audited_mini_batch_is_caught(monkeypatch):
    monkeypatch.setattr(batch_mod, "plain_step", lambda plain, policy, opt, batch: None)
    failures = staleness_failures(AuditConfig(**NET, mismatch="none", mini_batches=4, mini_batch=3))
    assert any("optimizer steps" in f for f in failures) and any("did not move" in f for f in failures)


def test_adamw_steps_carry_the_trained_points_state_into_the_audited_step():
    cfg = AuditConfig(**NET, mismatch="none", optimizer="adamw", audit_at=(2,), train_groups=1,
                      mini_batches=4, mini_batch=3)
    problem = make_problem(cfg.problem)
    policies = TrainedPolicies(cfg, problem)
    trained = policies.at(0, 2).trained_optimizer_state
    _, policy, _, _ = audit_batch(cfg, 0, policies=policies)
    carried = policy.trained_optimizer_state
    assert any(trained) and len(carried) == len(trained)  # the point carries AdamW's state after 2 steps
    assert policy.audit_mini_batch["optimizer"] == "adamw (the trained point's state)"
    assert [int(s["step"]) for s in carried if s] == [int(s["step"]) + 3 for s in trained if s]
    assert any(not torch.equal(a["exp_avg"], b["exp_avg"]) for a, b in zip(carried, trained) if a)


def test_divergence_grows_with_j_without_numeric_mismatch():
    d = {}
    for j in (0, 1, 3):
        cfg = AuditConfig(**{**NET, "sequences": 256}, mismatch="none", mini_batches=4, mini_batch=j, delta=0.0)
        inputs: list = []
        audit_seed(cfg, 0, keep_d=inputs)
        d[j] = float(inputs[0][0].mean())
    assert d[0] <= 1e-12  # a fresh policy and μ = π: the numerics alone, none here
    assert d[3] > d[1] > 1e-9, d


@pytest.mark.parametrize("kw, field", [(dict(mini_batch=4), "mini_batch"), (dict(mini_batch=7), "mini_batch"),
                                       (dict(mini_batch="middle"), "mini_batch"), (dict(mini_batch="all"), "mini_batch"),
                                       (dict(mini_batch=-1), "mini_batch"), (dict(mini_batch=True), "mini_batch"),
                                       (dict(mini_batches=3), "mini_batches"),
                                       (dict(mismatch="stale:2"), "mini_batches")])
def test_an_invalid_mini_batch_is_a_config_error_naming_the_field(kw, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        AuditConfig(**{**NET, "mismatch": "none", "mini_batches": 4, **kw})


def test_mini_batch_choices_resolve_and_round_trip():
    assert AuditConfig().audited_mini_batch == 0  # M = 1: the whole batch, j = 0 whatever the choice
    assert AuditConfig(**NET, mini_batches=4).audited_mini_batch == 3  # default last
    assert AuditConfig(**NET, mini_batches=4, mini_batch="first").audited_mini_batch == 0
    cfg = AuditConfig(**NET, mini_batches=4, mini_batch=2)
    assert from_dict(AuditConfig, to_dict(cfg)) == cfg


def _counts(doc: dict) -> str:
    """Every seed's counts and rates, and the pooled regime, as text (NaN rates compare equal)."""
    return json.dumps([[(s["tokens"], s["outside"], s["zero_advantage"],
                         {p: (e["disagreement"], {r: e[r] for r in p.split("|")})
                          for p, e in s["contexts"]["shared"]["pairs"].items()}) for s in doc["per_seed"]],
                       doc["regime"], doc["pairs"]], sort_keys=True)


def test_one_mini_batch_reproduces_the_whole_batch_audit():
    small = dict(seeds=2, sequences=64, n_boot=50, extra_rules=(), contexts=("shared",), flip_tokens=0)
    before = run_audit(AuditConfig(**small))
    explicit = run_audit(AuditConfig(**small, mini_batches=1, mini_batch="last"))
    assert _counts(before) == _counts(explicit)
    assert (explicit["mini_batches"], explicit["mini_batch"]) == (1, 0)
    assert all(s["optimizer_steps_before"] == 0 for s in explicit["per_seed"])


def test_audit_json_states_the_audited_mini_batch_and_its_regime():
    doc = run_audit(AuditConfig(**NET, seeds=1, mismatch="noise:0.3", n_boot=50, mini_batches=4, mini_batch=2))
    assert (doc["mini_batches"], doc["mini_batch"]) == (4, 2)
    mb = doc["mini_batch_regime"]
    assert (mb["mini_batch"], mb["mini_batches"], mb["optimizer_steps_before"]) == (2, 4, [2])
    assert mb["regime"] == doc["regime"] and doc["regime"]["tokens"] == 32
    assert doc["config"]["mini_batches"] == 4 and doc["config"]["mini_batch"] == 2


# --- transfer and mechanism: like with like ------------------------------------------------------

A, B = "dppo_topk_kl", "pdm_topk"


def _rates(count, grew, shrank):
    return {"unsafe_keep": grew / count if count else None, "shrink": shrank / count if count else None,
            "flat": (count - grew - shrank) / count if count else None, "count": count, "grew": grew,
            "shrank": shrank, "flat_count": count - grew - shrank}


def _loop_line(step, j=None, m=None, seed=0):
    rec = {"step": step, "seed": seed, "rules": [A, B], "delta": 0.15, "k": 20, "tolerance": 1e-9,
           "tokens": 1000, "zero_advantage": 100, "outside": 10,
           "pairs": {f"{A}|{B}": {"disagreement": 7, A: {"topk_kl": _rates(4, 3, 1), "full_kl": None},
                                  B: {"topk_kl": _rates(3, 0, 3), "full_kl": None}}}, "dropped_outside": {}}
    if j is not None:
        rec.update(mini_batch=j, mini_batches=m)
    return rec


def _run(tmp_path, lines, name="run"):
    run = tmp_path / name
    run.mkdir()
    (run / "audit.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    sample = [{"step": 1, "d": 0.3 if i % 200 == 0 else 1e-3 * (1 + i % 7), "mu_tail": 0.001, "pi_tail": 0.001,
               "r": 1.0, "adv": 1.0 if i % 3 else -1.0} for i in range(2000)]
    (run / "mismatch_sample.jsonl").write_text("\n".join(json.dumps(r) for r in sample) + "\n")
    return run


TOY = dict(policy="neural", seeds=1, sequences=128, group_size=8, n_boot=50, extra_rules=(), contexts=("shared",),
           flip_tokens=0, mismatch="noise:0.3")


def test_transfer_refuses_a_toy_audited_at_another_mini_batch(tmp_path):
    run = _run(tmp_path, [_loop_line(s, 3, 4) for s in (1, 2)])
    toy = tmp_path / "audit.json"
    toy.write_text(json.dumps(run_audit(AuditConfig(**TOY, mini_batches=4, mini_batch=1))))
    with pytest.raises(ConfigError, match="^mini_batch:.*mini-batch 1 of 4.*mini-batch 3 of 4"):
        transfer.run_transfer(run, tmp_path / "out", AuditConfig(**TOY), toy_audit=toy, n_boot=50, log=lambda *a: None)
    toy.write_text(json.dumps(run_audit(AuditConfig(**TOY, mini_batches=4, mini_batch=3))))
    doc = transfer.run_transfer(run, tmp_path / "out", AuditConfig(**TOY), toy_audit=toy, n_boot=50, log=lambda *a: None)
    assert doc["mini_batch"] == {"run": 3, "run_mini_batches": 4, "toy": 3, "toy_mini_batches": 4}
    assert "loop j = 3 of M = 4, toy j = 3 of M = 4" in (tmp_path / "out" / "transfer.md").read_text()
    # a toy from before mini-batches (no mini_batch: j = 0 of M = 1) against lines without one: like with like
    old = _run(tmp_path, [_loop_line(s) for s in (1, 2)], "old")
    legacy = json.loads(toy.read_text())
    for key in ("mini_batch", "mini_batches", "mini_batch_regime"):
        legacy.pop(key)
    toy.write_text(json.dumps(legacy))
    with pytest.raises(ConfigError, match="^mini_batch:"):
        transfer.run_transfer(run, tmp_path / "out", AuditConfig(**TOY), toy_audit=toy, n_boot=50, log=lambda *a: None)
    assert transfer.run_transfer(old, tmp_path / "out2", AuditConfig(**TOY), toy_audit=toy, n_boot=50,
                                 log=lambda *a: None)["mini_batch"]["run"] == 0


def test_transfer_runs_the_toy_at_the_runs_mini_batch(tmp_path):
    run = _run(tmp_path, [_loop_line(s, 2, 4) for s in (1, 2)])
    doc = transfer.run_transfer(run, tmp_path / "out", AuditConfig(**TOY), mismatch="noise:0.3", n_boot=50,
                                log=lambda *a: None)
    assert (doc["toy_config"]["mini_batches"], doc["toy_config"]["mini_batch"]) == (4, 2)
    assert doc["mini_batch"]["toy"] == 2 and doc["mini_batch"]["run"] == 2


def test_transfer_of_an_all_run_picks_one_mini_batch_or_refuses(tmp_path):
    run = _run(tmp_path, [_loop_line(s, j, 2) for s in (1, 2) for j in (0, 1)])
    lines = transfer.read_audit_lines(run)
    assert [(r["step"], r["mini_batch"]) for r in lines] == [(1, 0), (1, 1), (2, 0), (2, 1)]  # one line per j
    with pytest.raises(ConfigError, match="^mini_batch:.*all"):
        transfer.run_transfer(run, tmp_path / "out", AuditConfig(**TOY), mismatch="noise:0.3", n_boot=50,
                              log=lambda *a: None)
    chosen, j, m = transfer.select_mini_batch(lines, 1)
    assert (j, m) == (1, 2) and [r["step"] for r in chosen] == [1, 2]


def _mech_line(step, j=None, m=None, seed=0):
    n = 3
    keep = {r: torch.tensor([1, 0, 1]) for r in (A, B)}
    dd = {r: torch.tensor([1e-4, 0.0, -1e-4], dtype=torch.float64) for r in (A, B)}
    scale = step_scale_record([A, B], keep, dd, None, torch.full((n,), 1e-3, dtype=torch.float64),
                              torch.ones(n, dtype=torch.bool), 1e-12, 1.0)
    rec = {"step": step, "seed": seed, "rules": [A, B], "delta": 0.15, "k": 20, "outside": n,
           "step_scales": {"1": scale}}
    if j is not None:
        rec.update(mini_batch=j, mini_batches=m)
    return rec


def test_mechanism_reports_its_mini_batches_and_refuses_mixed_j_outside_an_all_run():
    doc = mechanism_doc([_mech_line(1), _mech_line(2)], ["old"])
    assert doc["mini_batches"]["mini_batch"] == [0] and doc["mini_batches"]["mini_batches"] == [1]
    assert "Audited mini-batch j = 0 of M = 1" in mechanism_markdown(doc)
    with pytest.raises(ConfigError, match="^mini_batch:"):  # a last run and a first run pooled
        mechanism_doc([_mech_line(1, 3, 4), _mech_line(2, 3, 4), _mech_line(1, 0, 4, seed=1)], ["a", "b"])
    every = [_mech_line(s, j, 4, seed) for seed in (0, 1) for s in (1, 2) for j in range(4)]
    doc = mechanism_doc(every, ["a", "b"])
    assert doc["mini_batches"]["all"] and doc["mini_batches"]["pooled_over_all"]
    assert doc["mini_batches"]["mini_batch"] == [0, 1, 2, 3] and doc["audited_steps"] == 16
    assert "pooled (audit.mini_batch: all runs" in mechanism_markdown(doc)
    with pytest.raises(ConfigError, match="^mini_batch:"):  # an all run missing a j at one step is not one
        mechanism_doc(every[:-1], ["a", "b"])
