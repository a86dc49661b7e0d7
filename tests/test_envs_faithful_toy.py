"""The toy faithful to the transformer (SPEC §6d): the causal-transformer policy, its logit kernel, the
AdamW audit step with memory, and the probe, decomposition and step sizes under the loop's keys."""
from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch

from pdm_lab.audit.probe import own_direction
from pdm_lab.audit.probe_record import step_scale_record

from pdm_lab.envs.audit.batch import audit_batch, audit_model, float64_tokens
from pdm_lab.envs.audit.config import AuditConfig
from pdm_lab.envs.audit.own_update import ToyKernel
from pdm_lab.envs.audit.step import audit_optimizer, measure, memory_steps, rule_step
from pdm_lab.envs.audit.study import run_audit
from pdm_lab.envs.policies.models import make_policy
from pdm_lab.envs.policies.transformer import WINDOW
from pdm_lab.envs.problems.mismatch import Mismatch
from pdm_lab.envs.problems.problem import ProblemConfig, TokenMDPConfig, make_problem
from pdm_lab.envs.problems.rollout import RolloutRNG

A, B = "dppo_topk_kl", "pdm_topk"
TINY = ProblemConfig(kind="token_mdp", token_mdp=TokenMDPConfig(vocab_size=32, max_len=14))
AUDIT = AuditConfig(problem=TINY, policy="transformer", hidden=16, init_scale=0.3, seeds=2, sequences=64,
                    group_size=8, n_boot=100, extra_rules=(), contexts=("shared",), mismatch="noise:1", delta=0.05,
                    k=8, optimizer="adamw", lr=1e-3, train_lr=1e-2, audit_at=(3,), flip_tokens=0,
                    step_scales=(0.1, 0.01), probe_tokens=12)


def policy_and_obs(kind="transformer", rows=24, init_scale=0.3):
    problem = make_problem(TINY)
    policy = make_policy(kind, problem.encoder, problem.prior, hidden=16, init_scale=init_scale).double()
    batch = problem.collect(policy, Mismatch(), 2, 8, RolloutRNG(0))
    obs = batch.obs.reshape(-1, batch.obs.shape[-1])
    written = (obs[:, 1:] != 32).sum(1)
    order = torch.argsort(written, descending=True)  # the longest contexts first: some exceed the window
    return policy, obs[order[:rows]]


def test_the_context_is_the_prompt_and_the_last_window_tokens():
    policy, obs = policy_and_obs()
    ids, real = policy.context(obs)
    for row, (i, r) in enumerate(zip(ids, real)):
        written = obs[row, 1:][obs[row, 1:] != 32]
        tail = written[-WINDOW:]
        first = WINDOW - tail.numel()
        assert int(i[first]) == 32 + 1 + int(obs[row, 0]) % 1024  # the prompt's row
        assert torch.equal(i[first + 1:], tail) and bool(r[first:].all()) and not bool(r[:first].any())
    assert int((obs[:, 1:] != 32).sum(1).max()) > WINDOW  # the test saw contexts longer than the window


def test_the_window_alone_decides_the_trainable_logits():
    policy, obs = policy_and_obs()
    long = obs[(obs[:, 1:] != 32).sum(1) > WINDOW][:1]
    assert long.numel()
    edited = long.clone()
    edited[0, 1] = (edited[0, 1] + 1) % 32  # a token before the window
    last = int((long[0, 1:] != 32).sum())
    with torch.no_grad():  # (the frozen prior's row reads the whole context, as an LLM's prior does)
        assert torch.equal(policy.trainable_logits(long), policy.trainable_logits(edited))
        edited[0, last] = (long[0, last] + 1) % 32  # the last written token
        assert not torch.equal(policy.trainable_logits(long), policy.trainable_logits(edited))


def central_difference(policy, obs_row, v_row, eps):
    """(z(θ + εg) − z(θ − εg))/2ε with g = ∇_θ⟨z, v⟩: the logit change of an actual tiny step."""
    policy.zero_grad()
    (policy(obs_row)[0] * v_row).sum().backward()
    grads = [p.grad.clone() for p in policy.parameters()]
    with torch.no_grad():
        for p, g in zip(policy.parameters(), grads):
            p.add_(eps * g)
        plus = policy(obs_row)[0]
        for p, g in zip(policy.parameters(), grads):
            p.sub_(2 * eps * g)
        minus = policy(obs_row)[0]
        for p, g in zip(policy.parameters(), grads):
            p.add_(eps * g)
    return (plus - minus) / (2 * eps)


@pytest.mark.parametrize("kind", ["transformer", "transformer_tied", "neural", "tabular", "qwen3", "qwen3_untied"])
def test_kernel_v_matches_an_actual_tiny_float64_step(kind):
    """K v = d z_t/dη along θ + η·∇_θ⟨z_t, v_t⟩: checked against (z(θ + εg) − z(θ − εg))/2ε. For the
    ``transformers`` Qwen3 this also shows it computes in float64 throughout."""
    if kind.startswith("qwen3"):
        pytest.importorskip("transformers")
    policy, obs = policy_and_obs(kind, rows=4)
    with torch.no_grad():
        z = policy(obs)
    v = own_direction(z, torch.tensor([1, 5, 9, 30]))
    kv = ToyKernel(policy, obs).kernel_v(torch.arange(4), v)
    eps = 1e-6 if kind.startswith("qwen3") else 1e-5  # the Qwen3's ‖g‖ is large: a smaller ε
    for t in range(4):
        actual = central_difference(policy, obs[t:t + 1], v[t], eps)
        assert torch.linalg.norm(kv[t] - actual) <= 1e-6 * torch.linalg.norm(actual)
        planted = v[t]  # a probe that assumes the tabular kernel K = I
        if kind != "tabular":
            assert torch.linalg.norm(planted - actual) > 1e-3 * torch.linalg.norm(actual)


def test_transformers_float32_internals_would_fail_that_check():
    """Planted: the Qwen3 toy with transformers' own RMSNorm (float32 inside) is off by far more than 1e-6."""
    pytest.importorskip("transformers")
    policy, obs = policy_and_obs("qwen3", rows=2)
    for module in policy.model.modules():
        if type(module).__name__.startswith("Wide"):
            module.__class__ = type(module).__mro__[1]
    with torch.no_grad():
        z = policy(obs)
    v = own_direction(z, torch.tensor([1, 5]))
    kv = ToyKernel(policy, obs).kernel_v(torch.arange(2), v)
    actual = central_difference(policy, obs[:1], v[0], eps=1e-6)
    assert torch.linalg.norm(kv[0] - actual) > 1e-4 * torch.linalg.norm(actual)


def test_the_transformers_kernel_is_not_the_tabular_one():
    cos = {}
    for kind in ("tabular", "transformer", "transformer_tied"):
        policy, obs = policy_and_obs(kind, rows=8, init_scale=1.0)
        with torch.no_grad():
            z = policy(obs)
        v = own_direction(z, torch.zeros(8, dtype=torch.long))
        kernel = ToyKernel(policy, obs)
        kv = kernel.kernel_v(torch.arange(8), v)
        cos[kind] = float(((kv * v).sum(-1) / kv.norm(dim=-1) / v.norm(dim=-1)).median())
        if kind == "transformer":  # the head's own part ‖h‖²·I + 1 is a minority of ‖K v‖²
            head = kernel.head_kernel_v(torch.arange(8), v)
            assert float(((head * kv).sum(-1) / kv.norm(dim=-1) ** 2).median()) < 0.5
    assert cos["tabular"] == pytest.approx(1.0, abs=1e-12)
    assert cos["transformer"] < 0.9 and cos["transformer_tied"] < 0.9


def test_the_tied_unembedding_is_the_token_embedding():
    policy, _ = policy_and_obs("transformer_tied")
    assert policy.unembedding().data_ptr() == policy.embed.data_ptr()
    assert policy.head is None and policy.w2.shape == (16, 32)


def test_the_audited_adamw_step_carries_the_trained_state():
    cfg = AUDIT
    _, policy, batch, adv = audit_batch(cfg, 0)
    state = policy.trained_optimizer_state
    assert state and all("exp_avg" in s for s in state) and float(state[0]["step"]) == 3
    tokens = float64_tokens(batch, adv, cfg.mask(A))
    focus = torch.arange(tokens.num_tokens)
    model, tok, foc = audit_model(policy, tokens, "shared", focus)
    before = measure(model, tok.rows(foc))
    with_memory = rule_step(model, tok, cfg.mask(A), cfg, foc, before)
    memory = memory_steps(model, tok, cfg, foc, before, (1.0,))[1.0]["topk_kl"]
    assert float(memory.abs().max()) > 0  # the Â = 0 step moves D: momentum and preconditioner
    fresh = copy.deepcopy(model)
    del fresh.trained_optimizer_state  # planted: the audit forgets the trained state (a fresh AdamW)
    assert audit_optimizer(fresh, cfg).state == {}
    forgetful = rule_step(fresh, tok, cfg.mask(A), cfg, foc, before)
    assert not torch.allclose(forgetful.delta["topk_kl"], with_memory.delta["topk_kl"])
    sgd = memory_steps(model, tok, replace(cfg, optimizer="sgd"), foc, before, (1.0,))[1.0]["topk_kl"]
    assert float(sgd.abs().max()) == 0.0


@pytest.fixture(scope="module")
def doc():
    return run_audit(AUDIT)


def test_the_toy_audit_carries_the_probe_and_decomposition_under_the_loops_keys(doc):
    probe = doc["probe"]
    assert probe["probe/tokens"] == 2 * AUDIT.probe_tokens or probe["probe/tokens"] > 0
    for rule in (A, B):
        assert {"rate", "lo", "hi", "n"} <= set(probe[f"probe/agree/{rule}/outside/topk_kl"])
        assert f"probe/agree/{rule}/outside/full_kl" in probe  # the toys know μ in full
        assert {f"decomp/share/{p}" for p in ("own", "rest", "memory", "remainder")} <= set(doc["decomposition"][rule])
    assert {"median", "lo", "hi"} <= set(probe["probe/cos_kv_v"]) and "probe/kernel_fit" in probe
    assert "probe/agree_precond/dppo_topk_kl/outside/topk_kl" in probe  # AdamW's P
    live = step_scale_record([A, B], {A: torch.ones(3, dtype=torch.bool), B: torch.zeros(3, dtype=torch.bool)},
                             {A: torch.ones(3), B: torch.ones(3)}, torch.ones(3), torch.ones(3),
                             torch.ones(3, dtype=torch.bool), 0.0, 1.0)
    assert list(doc["step_scales"]) == ["1", "0.1", "0.01"]
    assert all(set(rec) == set(live) for rec in doc["step_scales"].values())
    json.dumps(doc, allow_nan=True)  # the per-seed tensors were pooled and dropped


def test_smaller_steps_have_a_smaller_relative_change(doc):
    ratio = [doc["step_scales"][s]["steps/median_abs_dd_over_d"]["value"] for s in ("1", "0.1", "0.01")]
    assert ratio[0] > ratio[1] > ratio[2] > 0
    shares = doc["decomposition"][A]
    total = sum(shares[f"decomp/share/{p}"]["mean"] for p in ("own", "rest", "memory", "remainder"))
    assert total == pytest.approx(1.0, abs=1e-9)
    assert shares["decomp/share/memory"]["mean"] > 0


def test_calibrate_from_run_reports_the_probe_statistics_and_which_match(doc, tmp_path, capsys):
    from pdm_lab.audit.live import json_safe
    from pdm_lab.cli.main import main

    run = tmp_path / "run"
    run.mkdir()
    sample = [{"step": 1, "d": 0.3 if i % 50 == 0 else 1e-3, "mu_tail": 0.001, "pi_tail": 0.001, "r": 1.0,
               "adv": 1.0} for i in range(500)]
    (run / "mismatch_sample.jsonl").write_text("\n".join(json.dumps(r) for r in sample) + "\n")
    line = {"step": 1, "rules": [A, B], "delta": 0.05, "k": 8, "probe": doc["probe"],
            "decomposition": doc["decomposition"]}
    (run / "audit.jsonl").write_text(json.dumps(json_safe(line)) + "\n")
    (tmp_path / "audit.json").write_text(json.dumps(json_safe(doc)))
    assert main(["calibrate", "--from-run", str(run), "--toy-audit", str(tmp_path / "audit.json"),
                 "--out", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "cos_kv_v" in out and "memory_share" in out and "matches" in out and "faithful: True" in out
    report = json.loads((tmp_path / "c" / "calibration.json").read_text())["probe"]
    assert report["faithfulness"]["faithful"] is True
    (run / "audit.jsonl").write_text(json.dumps({"step": 1, "rules": [A, B], "delta": 0.05, "k": 8}) + "\n")
    assert main(["calibrate", "--from-run", str(run), "--out", str(tmp_path / "c")]) == 0
    assert "no probe keys" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["transformer", "qwen3"])
@pytest.mark.parametrize("mismatch", ["bf16_engine:0", "fp8_engine:0", "outlier:0.3:1"])
def test_engine_copies_of_the_transformer_are_a_function_of_the_context(mismatch, kind):
    if kind == "qwen3":
        pytest.importorskip("transformers")
    policy, obs = policy_and_obs(kind, rows=12)
    policy = policy.float()
    engine = Mismatch.parse(mismatch).behaviour_copy(policy)
    with torch.no_grad():
        gap = engine(obs) - policy(obs)
        again = engine(obs) - policy(obs)
    assert torch.equal(gap, again) and float(gap.abs().max()) > 0  # deterministic, and not nothing


def test_the_step_size_figure_is_drawn_in_order_of_the_relative_change(doc, tmp_path):
    from pdm_lab.envs.report.step_sizes import step_size_figure, step_size_rows

    rows = step_size_rows(doc["step_scales"])
    assert [r["scale"] for r in rows] == [0.01, 0.1, 1.0]
    assert {A, B, "kept_by_all", "momentum_only"} <= set(rows[0]["series"])
    assert step_size_figure(doc["step_scales"], tmp_path / "s.png").stat().st_size > 0


def test_the_step_size_figure_takes_a_rate_of_one_whose_wilson_bound_rounds_below_it(tmp_path):
    from pdm_lab.envs.report.step_sizes import step_size_figure

    entry = {"unsafe_keep": 1.0, "lo": 0.9, "hi": 1.0 - 1e-16, "count": 30}
    rec = {"steps/lr_scale": 1.0, "steps/median_abs_dd_over_d": {"value": 2.0}, f"steps/unsafe_keep/{A}": entry,
           f"steps/unsafe_keep/{B}": {**entry, "count": 0}}
    assert step_size_figure({"1": rec}, tmp_path / "one.png").stat().st_size > 0
