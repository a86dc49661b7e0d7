"""The coupled mask ``pdm_coupled`` (SPEC §3b): the core formula, its reduction to ``pdm_topk``,
c_t against a float64 finite difference of D_O, and the JVP vs central-difference paths."""
import copy

import pytest
import torch

from pdm_lab.mask_config import MaskConfig
from pdm_lab.coupled import CoupledDirection, coupled_contribution, coupled_scores, differentiable_topk_kl
from pdm_lab.envs.problems.bandit import BanditConfig
from pdm_lab.envs.train.coupled_jvp import JVPDirection, preconditioner, toy_coupled_scores
from pdm_lab.envs.problems.mismatch import Mismatch
from pdm_lab.envs.policies.models import make_policy
from pdm_lab.envs.problems.problem import ProblemConfig, make_problem
from pdm_lab.envs.problems.rollout import RolloutRNG
from pdm_lab.envs.train.update import current_stats, masked_loss, token_batch
from pdm_lab.errors import PDMInputError
from pdm_lab.masks import get_mask_rule
from pdm_lab.policy_side import policy_on_support
from pdm_lab.scaling.coupled_fd import central_difference, central_difference_eps

CFG = MaskConfig(rule="pdm_coupled", delta=0.05, k=5)


def _setup(policy_kind: str, group_size: int, *, prompts: int = 24, seed: int = 0, vocab: int = 40):
    """A float64 toy policy and a batch from μ = π + noise; random ±Â (one per sequence)."""
    problem = make_problem(ProblemConfig(bandit=BanditConfig(vocab_size=vocab, num_prompts=prompts, seed=seed)))
    policy = make_policy(policy_kind, problem.encoder, problem.prior, seed=seed, hidden=16).double()
    if policy_kind == "neural":  # move off the prior so the shared layer matters
        with torch.no_grad():
            policy.w2.mul_(50.0)
    rng = RolloutRNG(seed)
    batch = problem.collect(policy, Mismatch.parse("noise:1.5"), prompts, group_size, rng)
    gen = torch.Generator().manual_seed(seed)
    adv = torch.randn(batch.num_sequences, generator=gen)
    adv[::7] = 0.0  # some Â = 0 rows: never in O, c = 0
    return policy, token_batch(batch, adv, CFG)


def _d_outside(policy, tokens, outside) -> float:
    return float(current_stats(policy, tokens, full=False).topk_kl[outside].sum())


def test_rule_is_registered_and_needs_c():
    rule = get_mask_rule("pdm_coupled")
    assert rule.needs == ("coupled",) and rule.divergence == "topk_kl" and rule.uses_delta
    policy, tokens = _setup("tabular", 1)
    stats = current_stats(policy, tokens, full=False)
    with pytest.raises(PDMInputError, match="lack c_t"):
        rule(stats, tokens.advantages.reshape(-1).double(), CFG)


def test_formula_and_bad_input():
    adv = torch.tensor([1.0, -2.0, 0.0, 0.5], dtype=torch.float64)
    r = torch.tensor([1.5, 0.5, 2.0, 1.0], dtype=torch.float64)
    g = torch.tensor([0.2, 0.3, 7.0, -1.0], dtype=torch.float64)
    want = torch.tensor([0.3, -0.3, 0.0, -0.5], dtype=torch.float64)
    assert torch.allclose(coupled_contribution(adv, r, g), want, rtol=1e-15)
    with pytest.raises(PDMInputError, match="g: non-finite"):
        coupled_contribution(adv, r, torch.tensor([0.0, float("nan"), 0.0, 0.0], dtype=torch.float64))
    with pytest.raises(PDMInputError, match="shape"):
        coupled_contribution(adv, r, g[:3])


def test_differentiable_divergence_has_the_stats_value_and_exact_gradient():
    policy, tokens = _setup("tabular", 2)
    logits = policy(tokens.obs).detach().requires_grad_(True)
    d = differentiable_topk_kl(tokens.support, policy_on_support(logits, tokens.support.ids))
    stats = current_stats(policy, tokens, full=False)
    assert torch.allclose(d.detach(), stats.topk_kl, rtol=1e-12, atol=1e-15)
    (grad,) = torch.autograd.grad(d.sum(), logits)
    # reference: D recomputed from a full log_softmax with the tail as a log-sum-exp, by autograd
    lp = torch.log_softmax(logits, -1)
    ids = tokens.support.ids
    real = ids >= 0
    safe = torch.where(real, ids, ids[:, :1])  # a pad must not alias token 0
    on = lp.gather(1, safe)
    tail_mask = torch.ones_like(lp, dtype=torch.bool).scatter(1, safe, False)
    tail = torch.logsumexp(lp.masked_fill(~tail_mask, float("-inf")), -1)
    mu = torch.exp(tokens.support.mu_logp.double()).where(real, torch.zeros(()).double())
    mu_t = torch.exp(tokens.support.mu_tail_logp.double())
    ref = -(mu * on.where(real, torch.zeros(()).double())).sum(-1) - mu_t * tail
    (want,) = torch.autograd.grad(ref.sum(), logits)
    assert torch.allclose(grad, want, rtol=1e-10, atol=1e-12)


def test_tabular_one_token_per_state_identity_equals_pdm_topk():
    policy, tokens = _setup("tabular", 1, prompts=64)
    stats = current_stats(policy, tokens, full=False)
    adv = tokens.advantages.reshape(-1).double()
    scores = toy_coupled_scores(policy, tokens, CFG)
    assert scores.outside.sum() >= 5
    # c_t = Â_t r_t Ḋ_topk,t on O (and 0 off O: no other out-of-region token shares the state)
    want = torch.where(scores.outside, adv * stats.ratio * stats.ddot["topk"], torch.zeros_like(adv))
    assert torch.allclose(scores.c, want, rtol=1e-9, atol=1e-14)
    coupled = masked_loss(policy, tokens, CFG).keep
    topk = masked_loss(policy, tokens, MaskConfig(rule="pdm_topk", delta=CFG.delta, k=CFG.k)).keep
    assert torch.equal(coupled, topk)
    assert (coupled == 0).sum() > 0  # the rule does drop something here


def _token_grad(policy, tokens, t: int) -> list[torch.Tensor]:
    k_id = tokens.support.ids[t, tokens.support.k_index[t]]
    logp = torch.log_softmax(policy(tokens.obs[t:t + 1]), -1)[0, k_id]
    return list(torch.autograd.grad(logp, list(policy.parameters()), allow_unused=True))


@pytest.mark.parametrize("kind", ["tabular", "neural"])
@pytest.mark.parametrize("adam", [False, True])
def test_c_is_the_first_order_change_of_d_outside(kind, adam):
    policy, tokens = _setup(kind, 4, seed=1)
    opt = None
    if adam:  # a few Adam steps so that P = 1/(√v̂ + ε) is far from the identity
        opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
        for _ in range(3):
            out = masked_loss(policy, tokens, MaskConfig(rule="none", k=CFG.k))
            opt.zero_grad()
            out.loss.backward()
            opt.step()
        assert preconditioner(opt, policy) is not None
    scores = toy_coupled_scores(policy, tokens, CFG, opt)
    outside = scores.outside
    assert outside.sum() >= 3
    stats = current_stats(policy, tokens, full=False)
    adv = tokens.advantages.reshape(-1).double()
    precond = preconditioner(opt, policy)
    names = [n for n, _ in policy.named_parameters()]
    checked = 0
    for t in torch.nonzero(adv != 0)[:, 0][:12].tolist():
        grads = _token_grad(policy, tokens, t)
        step = [adv[t] * stats.ratio[t] * (torch.zeros_like(p) if gr is None else gr)
                * (1.0 if precond is None else precond[n]) for n, p, gr in zip(names, policy.parameters(), grads)]
        h = 1e-5 / float(torch.sqrt(sum((x ** 2).sum() for x in step)))  # a 1e-5 move of θ
        vals = []
        for sign in (1.0, -1.0):
            moved = copy.deepcopy(policy)
            with torch.no_grad():
                for p, s in zip(moved.parameters(), step):
                    p.add_(s, alpha=sign * h)
            vals.append(_d_outside(moved, tokens, outside))
        fd = (vals[0] - vals[1]) / (2 * h)
        assert abs(fd - float(scores.c[t])) <= 1e-6 * max(1.0, abs(fd)), (t, fd, float(scores.c[t]))
        checked += 1
    assert checked >= 8


@pytest.mark.parametrize("kind", ["tabular", "neural"])
def test_jvp_and_central_difference_agree(kind):
    policy, tokens = _setup(kind, 4, seed=2)
    stats = current_stats(policy, tokens, full=False)
    adv = tokens.advantages.reshape(-1).double()
    direction = JVPDirection(policy, tokens)
    assert isinstance(direction, CoupledDirection)
    outside = (stats.topk_kl > CFG.delta) & (adv != 0)
    u = direction.grad_of_outside_divergence(outside)
    g_jvp = direction.directional_logp(u)
    params = list(policy.parameters())
    ulist = [u[n] for n, _ in policy.named_parameters()]
    k_ids = tokens.support.ids.gather(1, tokens.support.k_index[:, None])

    def logp_k():
        return torch.log_softmax(policy(tokens.obs), -1).gather(1, k_ids)[:, 0]

    before = [p.detach().clone() for p in params]
    theta = float(torch.sqrt(sum((p.detach() ** 2).sum() for p in params)))
    unorm = float(torch.sqrt(sum((x ** 2).sum() for x in ulist)))
    g_cd = central_difference(params, ulist, logp_k, central_difference_eps(theta, unorm, torch.float64))
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # θ restored exactly
    assert torch.allclose(g_cd, g_jvp, rtol=1e-6, atol=1e-8 * float(g_jvp.abs().max()))
    c = coupled_scores(direction, stats.topk_kl, adv, stats.ratio, CFG).c
    assert torch.allclose(c, coupled_contribution(adv, stats.ratio, g_jvp).where(outside.any(), c))


def test_empty_outside_set_skips_the_stage():
    class Raises:
        def grad_of_outside_divergence(self, outside):
            raise AssertionError("called")

        def directional_logp(self, u):
            raise AssertionError("called")

    d = torch.zeros(5, dtype=torch.float64)
    out = coupled_scores(Raises(), d, torch.ones(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64), CFG)
    assert not out.outside.any() and torch.equal(out.c, torch.zeros(5, dtype=torch.float64))
