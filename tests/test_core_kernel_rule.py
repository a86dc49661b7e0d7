"""The kernel-aware mask ``pdm_kernel`` (SPEC §6d): h_t = ⟨Wᵀg, Wᵀv⟩ against autograd in float64
(planted formulas fail), ⟨g, v⟩ = Ḋ_topk, the rule's drops on crafted rows (λ = 0 is pdm_topk,
a large λ follows the sign of Â·c), its config, the toys end to end and the loop's config."""
import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdm_lab.config import ConfigError
from pdm_lab.errors import PDMInputError
from pdm_lab.kernel_direction import kernel_scores, own_direction, topk_kl_logit_grad
from pdm_lab.loss import pdm_policy_loss
from pdm_lab.mask_config import MaskConfig
from pdm_lab.masks import compute_mask, get_mask_rule
from pdm_lab.policy_side import policy_on_support
from pdm_lab.audit.probe import divergence_grads
from pdm_lab.tokenwise import token_stats
from pdm_lab.support import support_from_full

REPO = Path(__file__).resolve().parents[1]


def _case(seed: int, n: int = 9, vocab: int = 13, d: int = 4, k: int = 3, convention: str = "union",
          scale: float = 2.0):
    gen = torch.Generator().manual_seed(seed)
    mu = torch.log_softmax(torch.randn(n, vocab, generator=gen, dtype=torch.float64) * scale, -1)
    z = mu + torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 0.7
    w = torch.randn(vocab, d, generator=gen, dtype=torch.float64)
    sampled = torch.randint(0, vocab, (n,), generator=gen)
    return z, w, support_from_full(mu, sampled, k=k, convention=convention, compiled=False)


def _autograd_c(z, w, support):
    """⟨∇_z D_topk, W Wᵀ v⟩ with ∇_z D by autograd of the core's differentiable D (the probe's)."""
    g = divergence_grads(support, z, None)[0]["topk_kl"]
    v = own_direction(z, support.sampled)
    return (g * (v @ w @ w.T)).sum(-1)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 13), convention=st.sampled_from(("union", "kslot")),
       scale=st.sampled_from((0.3, 2.0, 6.0)))
def test_kernel_scores_equal_autograd_in_float64(seed, k, convention, scale):
    z, w, support = _case(seed, k=k, convention=convention, scale=scale)
    c = kernel_scores(z, w, support)
    ref = _autograd_c(z, w, support)
    assert c.dtype == torch.float64
    torch.testing.assert_close(c, ref, rtol=1e-10, atol=1e-12)


def _closed_form_grad(z, support):
    """g = π − μ̃ (kernel_direction's docstring): μ̃ = μ on S, μ_T·π_i/π_T on the tail."""
    pi = torch.softmax(z, -1)
    real = support.ids >= 0
    idx = support.ids.clamp(min=0).long()
    in_s = torch.zeros_like(z).scatter_add(1, idx, real.double()) > 0  # a padded slot (id −1) adds 0 at id 0
    mu_head = torch.zeros_like(z).scatter_add(1, idx, torch.where(real, support.mu_logp.exp(), 0.0))
    pi_tail = torch.where(in_s, 0.0, pi).sum(-1, keepdim=True)
    mu_tail = support.mu_tail_logp.exp()[:, None]
    return pi - torch.where(in_s, mu_head, mu_tail * pi / pi_tail)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 12), convention=st.sampled_from(("union", "kslot")),
       scale=st.sampled_from((0.3, 2.0, 6.0)))
def test_logit_grad_equals_its_closed_form(seed, k, convention, scale):
    """The autograd g of the core's differentiable top-K KL is π − μ̃ in float64."""
    z, _, support = _case(seed, k=k, convention=convention, scale=scale)
    g = topk_kl_logit_grad(z, support)
    assert g.dtype == torch.float64
    torch.testing.assert_close(g, _closed_form_grad(z, support), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("convention", ("union", "kslot"))
def test_g_dot_v_is_pdm_topk_estimator(convention):
    """⟨g, v⟩ (g = ∇_z D_topk) is the stats' Ḋ_topk: the K = I case."""
    for seed in range(4):
        z, _, support = _case(seed, k=2 + seed, convention=convention)
        g = topk_kl_logit_grad(z, support)
        torch.testing.assert_close(g, _closed_form_grad(z, support), rtol=1e-9, atol=1e-12)
        stats = token_stats(support, policy_on_support(z, support.ids), compiled=False)
        ddot = (g * own_direction(z, support.sampled)).sum(-1)
        torch.testing.assert_close(ddot, stats.ddot["topk"], rtol=1e-10, atol=1e-13)


def test_planted_formulas_fail_the_autograd_check():
    z, w, support = _case(3, k=3)
    ref = _autograd_c(z, w, support)
    g = topk_kl_logit_grad(z, support)
    v = own_direction(z, support.sampled)
    pi = torch.softmax(z, -1)
    in_s = torch.zeros_like(z).scatter_add(1, support.ids.clamp(min=0).long(), (support.ids >= 0).double()) > 0
    mu_head = torch.zeros_like(z).scatter_add(1, support.ids.clamp(min=0).long(),
                                              torch.where(support.ids >= 0, support.mu_logp.exp(), 0.0))
    planted = {
        "π instead of μ̃ on the tail": torch.where(in_s, pi - mu_head, 0.0),
        "full μ̃ = 0 on the tail": torch.where(in_s, pi - mu_head, pi),
    }
    for name, bad_g in planted.items():
        bad = ((bad_g @ w) * (v @ w)).sum(-1)
        assert not torch.allclose(bad, ref, rtol=1e-6, atol=1e-9), name
        assert not torch.allclose(bad_g, g, rtol=1e-6, atol=1e-9), name  # nor passes as the gradient
    no_w = (g * v).sum(-1)  # v instead of Wᵀv: Ḋ_topk itself
    assert not torch.allclose(no_w, ref, rtol=1e-6, atol=1e-9)
    ek_only = ((g @ w) * w[support.sampled.long()]).sum(-1)  # Wᵀv without the −Wᵀπ part
    assert not torch.allclose(ek_only, ref, rtol=1e-6, atol=1e-9)


def test_kernel_scores_refuse_a_mismatched_unembedding():
    z, w, support = _case(0)
    with pytest.raises(PDMInputError, match="unembedding"):
        kernel_scores(z, w[:-1], support)


# ---------------------------------------------------------------------------- the rule


def _stats_with(kernel, seed=1, k=3):
    z, _, support = _case(seed, n=kernel.numel(), k=k)
    stats = token_stats(support, policy_on_support(z, support.ids), compiled=False)
    return dataclasses.replace(stats, kernel=torch.as_tensor(kernel, dtype=torch.float64))


def test_record_declares_kernel():
    rec = get_mask_rule("pdm_kernel")
    assert rec.record() == {"divergence": "topk_kl", "estimator": "topk", "support": "topk", "uses_delta": True,
                            "uses_k": True, "level": "token", "needs": ("kernel",), "binary_stats": False}


@pytest.mark.parametrize("delta", (0.0, 0.05, 10.0))
def test_drops_follow_the_definition_on_crafted_rows(delta):
    kernel = torch.tensor([0.3, -0.3, 0.0, 2.0, -2.0, 1e-3, -1e-3, 0.7, -0.7])
    stats = _stats_with(kernel)
    adv = torch.tensor([1.0, -1.0, 0.0, -0.5, 2.0, 1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    for lam in (0.0, 0.5, 1.0, 1e6):
        cfg = MaskConfig(rule="pdm_kernel", delta=delta, k=3, kernel_ratio=lam)
        keep = compute_mask(cfg, stats, adv)
        score = adv * (stats.ddot["topk"] + lam * stats.kernel)
        expected_drop = (stats.topk_kl > delta) & (adv != 0) & (score > 0)
        assert torch.equal(keep == 0, expected_drop), lam
        assert bool(keep[adv == 0].all())  # Â = 0 keeps
        if lam == 0.0:  # λ = 0: pdm_topk's decisions
            topk = compute_mask(dataclasses.replace(cfg, rule="pdm_topk"), stats, adv)
            assert torch.equal(keep, topk)
        if lam == 1e6:  # a large λ: the sign of Â·c decides every outside token with c ≠ 0
            outside = (stats.topk_kl > delta) & (adv != 0) & (kernel != 0)
            assert torch.equal((keep == 0)[outside], (adv * kernel > 0)[outside])


def test_loss_passes_kernel_and_refuses_without_it():
    z, w, support = _case(2, n=8, k=3)
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5], [2.0, -2.0, 1.0, 0.0]], dtype=torch.float64)
    resp = torch.ones_like(adv, dtype=torch.bool)
    cfg = MaskConfig(rule="pdm_kernel", delta=0.0, k=3, kernel_ratio=0.7)
    pi = policy_on_support(z, support.ids)
    c = kernel_scores(z, w, support)
    out = pdm_policy_loss(pi, support, adv, resp, cfg, kernel=c, compiled=False)
    assert torch.equal(out.stats.kernel, c)
    flat = adv.reshape(-1)
    drop = (out.stats.topk_kl > 0.0) & (flat != 0) & (flat * (out.stats.ddot["topk"] + 0.7 * c) > 0)
    assert torch.equal(out.keep.reshape(-1) == 0, drop)
    with pytest.raises(PDMInputError, match="kernel_scores"):
        pdm_policy_loss(pi, support, adv, resp, cfg, compiled=False)
    with pytest.raises(PDMInputError, match="kernel"):
        pdm_policy_loss(pi, support, adv, resp, cfg, kernel=torch.full_like(c, float("inf")), compiled=False)
    with pytest.raises(PDMInputError, match="kernel"):
        pdm_policy_loss(pi, support, adv, resp, cfg, kernel=c[:-1], compiled=False)


@pytest.mark.parametrize("bad", (-0.1, float("inf"), float("nan")))
def test_kernel_ratio_is_validated(bad):
    with pytest.raises(ConfigError, match="mask.kernel_ratio"):
        MaskConfig(rule="pdm_kernel", kernel_ratio=bad)


# ---------------------------------------------------------------------------- the toys and the loop


def test_toy_training_with_pdm_kernel_runs_and_tabular_is_refused():
    from pdm_lab.envs.problems.problem import ProblemConfig, TokenMDPConfig
    from pdm_lab.envs.train.grpo import TrainConfig, train

    mask = MaskConfig(rule="pdm_kernel", delta=0.01, k=4)
    small = dict(steps=2, groups_per_step=4, group_size=4, eval_sequences=16, mismatch="noise:1", mask=mask)
    problem = ProblemConfig(kind="token_mdp", token_mdp=TokenMDPConfig(vocab_size=16, max_len=4))
    for policy in ("neural", "transformer"):
        out = train(TrainConfig(problem=problem, policy=policy, hidden=8, **small))
        assert not out["nonfinite"]
    with pytest.raises(ConfigError, match="mask.rule.*tabular"):
        TrainConfig(policy="tabular", **small)


def test_masked_loss_uses_the_policys_unembedding():
    from pdm_lab.envs.policies.models import make_policy
    from pdm_lab.envs.problems.mismatch import Mismatch
    from pdm_lab.envs.problems.problem import ProblemConfig, TokenMDPConfig, make_problem
    from pdm_lab.envs.problems.rollout import RolloutRNG
    from pdm_lab.envs.train.update import masked_loss, policy_unembedding, token_batch

    problem = make_problem(ProblemConfig(kind="token_mdp", token_mdp=TokenMDPConfig(vocab_size=16, max_len=4)))
    cfg = MaskConfig(rule="pdm_kernel", delta=0.0, k=4)
    for kind in ("neural", "transformer"):
        policy = make_policy(kind, problem.encoder, problem.prior, hidden=8).double()
        batch = problem.collect(policy, Mismatch.parse("noise:1"), 2, 4, RolloutRNG(0))
        adv = torch.linspace(-1, 1, batch.num_sequences)
        tokens = token_batch(batch, adv, cfg)
        out = masked_loss(policy, tokens, cfg)
        with torch.no_grad():
            logits = policy(tokens.obs)
        w = policy.unembedding() if kind == "transformer" else policy.w2.T
        torch.testing.assert_close(policy_unembedding(policy), w.detach())
        torch.testing.assert_close(out.stats.kernel, kernel_scores(logits, w, tokens.support).to(out.stats.ratio.dtype))
        tabular = make_policy("tabular", problem.encoder, problem.prior)
    with pytest.raises(ConfigError, match="mask.rule"):
        policy_unembedding(tabular)


def test_toy_audit_with_pdm_kernel_runs_end_to_end():
    from pdm_lab.envs.audit.config import AuditConfig
    from pdm_lab.envs.audit.study import run_audit
    from pdm_lab.envs.problems.problem import ProblemConfig, TokenMDPConfig

    tiny = ProblemConfig(kind="token_mdp", token_mdp=TokenMDPConfig(vocab_size=16, max_len=4))
    cfg = AuditConfig(problem=tiny, policy="neural", hidden=8, seeds=2, sequences=32, group_size=8, n_boot=50,
                      rules=("dppo_topk_kl", "pdm_kernel"), extra_rules=("pdm_topk",), contexts=("shared",),
                      mismatch="noise:1", delta=0.01, k=4, audit_at=(0,), flip_tokens=0, probe_tokens=6)
    doc = run_audit(cfg)
    assert "pdm_kernel" in doc["per_rule"]
    probe = doc["probe"]  # the own-update probe scores pdm_kernel's own sign (Â·(Ḋ_topk + λ·c))
    assert probe["probe/agree/pdm_kernel/outside/topk_kl"]["n"] > 0
    with pytest.raises(ConfigError, match="pdm_kernel"):
        AuditConfig(policy="tabular", rules=("dppo_topk_kl", "pdm_kernel"))


def test_the_loop_and_the_live_audit_take_pdm_kernel():
    """The loop supplies c_t (``scaling/train_step.py``; its tests: ``test_scaling_kernel.py``), so
    its config and the live audit's section take the rule; only a sampling cut is refused."""
    from pdm_lab.audit.live import LiveAuditConfig
    from pdm_lab.scaling.config import load_config

    tiny = REPO / "scaling" / "configs" / "tiny-cpu.yaml"
    assert load_config(tiny, ["mask.rule=pdm_kernel"]).mask.rule == "pdm_kernel"
    assert LiveAuditConfig(every=1, rules=("dppo_topk_kl", "pdm_kernel")).rules[1] == "pdm_kernel"
    with pytest.raises(ConfigError, match=r"^rollout\.keep_sampling_mask: mask\.rule 'pdm_kernel'"):
        load_config(tiny, ["mask.rule=pdm_kernel", "rollout.top_p=0.9"])
