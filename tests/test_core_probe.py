"""The own-update probe and the step decomposition (SPEC §6d), float64, tiny models.

K v is checked against the logit change of actual tiny steps (a planted probe that uses v instead
fails); with K = I (a tabular softmax) every exact direction rule agrees with ΔD_own; the sign
convention is pinned by real surrogate steps; the decomposition's shares add up."""
import math

import pytest
import torch

from pdm_lab.audit.intervals import median_ci, paired_rate_diff_ci, wilson_ci
from pdm_lab.errors import PDMInputError
from pdm_lab.masks import get_mask_rule, predictive_outward, ratio_outward
from pdm_lab.policy_side import PolicyOnSupport, policy_on_support
from pdm_lab.divergence import full_kl, topk_kl
from pdm_lab.audit.probe import (FunctionalKernel, LogitKernel, fit_kernel_ab, own_direction, own_update_probe,
                           pool_decomposition, pool_probe, probe_rows, probe_with_kernel, step_decomposition)
from pdm_lab.tokenwise import token_stats
from pdm_lab.support import support_from_full



@pytest.fixture(autouse=True)
def _float64_default():
    """This module's tensors are float64 (the probe is checked in float64); other modules keep theirs."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)
RULES = ("dppo_topk_kl", "pdm_topk", "pdm_exact")


def _mlp(seed=0, n=6, vocab=9, d=5, temperature=0.7):
    gen = torch.Generator().manual_seed(seed)
    params = {"emb": torch.randn(4, d, generator=gen), "w1": torch.randn(d, d, generator=gen) / d ** 0.5,
              "W": torch.randn(vocab, d, generator=gen)}
    x = torch.randint(0, 4, (n,), generator=gen)

    def logits_fn(p):
        h = torch.tanh(p["emb"][x] @ p["w1"])
        return h @ p["W"].t() / temperature
    return logits_fn, params


def _actual_step_change(logits_fn, params, t, v_t, eps, scale=None):
    """(z_t(θ + εu) − z_t(θ − εu))/2ε for u = P ∇_θ ⟨z_t, v_t⟩, by an independent autograd pass."""
    ps = {k: p.clone().requires_grad_(True) for k, p in params.items()}
    (logits_fn(ps)[t] * v_t).sum().backward()
    u = {k: p.grad * (1.0 if scale is None else scale[k]) for k, p in ps.items()}
    plus = logits_fn({k: params[k] + eps * u[k] for k in params})[t]
    minus = logits_fn({k: params[k] - eps * u[k] for k in params})[t]
    return (plus - minus) / (2 * eps)


class PlantedKernel:
    """A probe that forgets the network: returns v as if K = I."""

    def kernel_v(self, rows, v, *, precondition=False):
        return v.clone()

    def head_kernel_v(self, rows, v):
        return None

    def unembedding(self):
        return None


def _kv_error(kernel, logits_fn, params, precondition=False, scale=None):
    z = logits_fn(params)
    rows = torch.tensor([0, 3, 5])
    v = own_direction(z[rows], torch.tensor([1, 4, 8]))
    kv = kernel.kernel_v(rows, v, precondition=precondition)
    worst = 0.0
    for i, t in enumerate(rows.tolist()):
        want = _actual_step_change(logits_fn, params, t, v[i], 1e-5, scale)
        worst = max(worst, float((kv[i] - want).norm() / want.norm()))
    return worst


@pytest.mark.parametrize("method", ["jvp", "central"])
def test_kv_matches_an_actual_tiny_step(method):
    logits_fn, params = _mlp()
    assert _kv_error(FunctionalKernel(logits_fn, params, method=method), logits_fn, params) <= 1e-6


def test_planted_probe_using_v_fails_the_step_check():
    logits_fn, params = _mlp()
    assert isinstance(PlantedKernel(), LogitKernel)
    assert _kv_error(PlantedKernel(), logits_fn, params) > 1e-2


def test_preconditioned_kv_matches_a_preconditioned_step():
    logits_fn, params = _mlp(seed=1)
    gen = torch.Generator().manual_seed(5)
    precond = {k: torch.rand(p.shape, generator=gen) + 0.1 for k, p in params.items()}
    kernel = FunctionalKernel(logits_fn, params, preconditioner=precond)
    assert _kv_error(kernel, logits_fn, params, precondition=True, scale=precond) <= 1e-6
    # P matters: the preconditioned K v is not the plain step's change
    assert _kv_error(kernel, logits_fn, params, precondition=True) > 1e-3


def test_head_part_is_norm_h_squared_times_v():
    """A bias-free output layer's own gradient gives K_head = ‖h‖²/T²·I (SPEC §6d)."""
    logits_fn, params = _mlp(temperature=0.7)
    kernel = FunctionalKernel(logits_fn, params, head_names=("W",), unembedding_name="W")
    rows = torch.tensor([1, 2])
    v = own_direction(logits_fn(params)[rows], torch.tensor([0, 2]))
    head = kernel.head_kernel_v(rows, v)
    z = logits_fn(params)
    h = z[rows] @ torch.linalg.pinv(params["W"].t() / 0.7)  # recover h from the logits
    want = (h.norm(dim=-1) ** 2 / 0.7 ** 2)[:, None] * v
    torch.testing.assert_close(head, want, rtol=1e-8, atol=1e-10)
    assert torch.equal(kernel.unembedding(), params["W"])


def _tabular_batch(seed=0, m=300, vocab=12, k=4, spread=1.5):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(m, vocab, generator=gen) * 2.0
    mu_full = torch.log_softmax(z + spread * torch.randn(m, vocab, generator=gen), -1)
    sampled = torch.multinomial(mu_full.exp(), 1, generator=gen)[:, 0]
    adv = torch.where(torch.rand(m, generator=gen) < 0.5, -1.0, 1.0)
    support = support_from_full(mu_full, sampled, k=k)
    return z, mu_full, sampled, adv, support


def _stats(z, support, mu_full):
    pi = policy_on_support(z, support.ids)
    return token_stats(support, PolicyOnSupport(pi.logp.detach(), pi.tail_logp, pi.tail_log_sumsq),
                       mu_full=mu_full, pi_full=torch.log_softmax(z, -1))


def test_tabular_softmax_exact_rules_agree_everywhere():
    """K = I: ΔD_own is Â·r·Ḋ, so pdm_exact (full KL) and pdm_topk (top-K KL) agree on 100%."""
    z, mu_full, sampled, adv, support = _tabular_batch()
    stats = _stats(z, support, mu_full)
    dis = ratio_outward(stats, adv) != predictive_outward(stats, adv, "topk")
    kernel = FunctionalKernel(lambda p: p["z"], {"z": z})
    out = probe_with_kernel(kernel, torch.arange(z.shape[0]), support, z, adv, stats.ratio, rules=RULES,
                            disagreement=dis, mu_full_logp=mu_full)
    assert out["probe/tokens"] == z.shape[0] and out["probe/disagreement_tokens"] == int(dis.sum()) > 10
    for subset in ("outside", "disagreement"):
        assert out[f"probe/agree/pdm_exact/{subset}/full_kl"]["rate"] == 1.0
        assert out[f"probe/agree/pdm_topk/{subset}/topk_kl"]["rate"] == 1.0
    # on disagreement tokens the ratio test is wrong wherever pdm_topk is right (K = I)
    assert out["probe/agree/dppo_topk_kl/disagreement/topk_kl"]["rate"] == 0.0
    assert out["probe/cos_kv_v"]["median"] == pytest.approx(1.0)
    entry = out["probe/agree/pdm_topk/outside/topk_kl"]
    assert entry["lo"] < 1.0 and entry["hi"] == pytest.approx(1.0) and entry["n"] == z.shape[0]


def test_sign_convention_pinned_by_real_surrogate_steps():
    """A real ascent step on Σ_t Â_t·r_t (tabular: rows independent) moves each D with the sign the
    probe calls ΔD_own; flipping Â in the probe flips every sign."""
    z, mu_full, sampled, adv, support = _tabular_batch(seed=3, m=120)
    stats = _stats(z, support, mu_full)
    eta = 1e-6
    zz = z.clone().requires_grad_(True)
    logp_k = torch.log_softmax(zz, -1).gather(1, sampled[:, None])[:, 0]
    ratio = torch.exp(logp_k - mu_full.gather(1, sampled[:, None])[:, 0])
    (adv * ratio).sum().backward()
    stepped = (z + eta * zz.grad).detach()

    def d_topk(logits):
        pi = policy_on_support(logits, support.ids)
        return topk_kl(support.mu_logp, pi.logp.detach(), support.mu_tail_logp, pi.tail_logp)
    real = {"topk_kl": d_topk(stepped) - d_topk(z),
            "full_kl": full_kl(mu_full, torch.log_softmax(stepped, -1)) - full_kl(mu_full, torch.log_softmax(z, -1))}
    kernel = FunctionalKernel(lambda p: p["z"], {"z": z})
    rows = torch.arange(z.shape[0])
    for sign in (1.0, -1.0):
        out = probe_with_kernel(kernel, rows, support, z, sign * adv, stats.ratio, rules=RULES,
                                disagreement=torch.zeros_like(adv, dtype=torch.bool), mu_full_logp=mu_full)
        for div, delta in real.items():
            clear = delta.abs() > 1e-12
            grows = torch.tensor(out["probe/data"]["grows"][div])
            assert bool(clear.sum() > 100)
            assert torch.equal(grows[clear], (delta[clear] > 0) if sign > 0 else (delta[clear] <= 0))


def test_kernel_aware_test_recovers_a_and_b():
    """z = W h with h a free unit-norm embedding row: K v = ‖h‖²v + W Wᵀ v = v + W Wᵀ v."""
    gen = torch.Generator().manual_seed(2)
    emb = torch.nn.functional.normalize(torch.randn(5, 4, generator=gen), dim=-1)
    W = torch.randn(10, 4, generator=gen)
    x = torch.randint(0, 5, (40,), generator=gen)
    logits_fn = lambda p: p["emb"][x] @ p["W"].t()  # noqa: E731
    params = {"emb": emb, "W": W}
    z = logits_fn(params)
    mu_full = torch.log_softmax(z + torch.randn(z.shape, generator=gen), -1)
    sampled = torch.multinomial(mu_full.exp(), 1, generator=gen)[:, 0]
    support = support_from_full(mu_full, sampled, k=3)
    kernel = FunctionalKernel(logits_fn, params, unembedding_name="W", head_names=("W",))
    rows = torch.arange(z.shape[0])
    v = own_direction(z, sampled)
    a, b = fit_kernel_ab(kernel.kernel_v(rows, v), v, W)
    assert a == pytest.approx(1.0, rel=1e-9) and b == pytest.approx(1.0, rel=1e-9)
    adv = torch.where(torch.rand(40, generator=gen) < 0.5, -1.0, 1.0)
    dis = torch.arange(40) % 3 == 0
    out = probe_with_kernel(kernel, rows, support, z, adv, torch.ones(40), rules=RULES, disagreement=dis,
                            mu_full_logp=mu_full)
    for div in ("topk_kl", "full_kl"):
        assert out[f"probe/kernel_test/outside/{div}"]["rate"] == 1.0  # the exact kernel: always right
    assert out["probe/kernel_fit"]["n"] == int((~dis).sum())
    assert out["probe/head_share"]["median"] < 1.0  # the hidden (embedding) part carries the rest
    pooled = pool_probe([out, out])
    assert pooled["probe/tokens"] == 80
    assert pooled["probe/agree/pdm_topk/outside/topk_kl"]["agree"] == 2 * out["probe/agree/pdm_topk/outside/topk_kl"]["agree"]
    # a probe with the preconditioner pooled with one without (a run's first audited step, before
    # AdamW has a P): the preconditioned keys pool over the probes that have them
    pre = {k: torch.full_like(p, 2.0) for k, p in params.items()}
    with_p = probe_with_kernel(FunctionalKernel(logits_fn, params, preconditioner=pre, unembedding_name="W"), rows,
                               support, z, adv, torch.ones(40), precondition=True, rules=RULES, disagreement=dis,
                               mu_full_logp=mu_full)
    key = "probe/agree_precond/pdm_topk/outside/topk_kl"
    mixed = pool_probe([out, with_p, with_p])
    assert mixed["probe/tokens"] == 120 and mixed[key]["n"] == 80 and mixed[key]["agree"] == 2 * with_p[key]["agree"]


def test_step_decomposition_shares_add_up():
    gen = torch.Generator().manual_seed(0)
    d = torch.rand(50, generator=gen) + 0.1
    own, rest, memory = (torch.randn(50, generator=gen) for _ in range(3))
    realised = own + rest + memory + 0.1 * torch.randn(50, generator=gen)
    out = step_decomposition(d, realised, own, rest, memory)
    total = sum(out[f"decomp/share/{p}"]["mean"] for p in ("own", "rest", "memory", "remainder"))
    assert total == pytest.approx(1.0, abs=1e-12)
    assert out["decomp/tokens"] == 50
    assert out["decomp/median_abs_dd_over_d"]["value"] == pytest.approx(float((realised.abs() / d).median()), rel=0.1)
    # only memory: its share is 1
    only = step_decomposition(d, memory, torch.zeros(50), torch.zeros(50), memory)
    assert only["decomp/share/memory"]["mean"] == pytest.approx(1.0)
    assert only["decomp/share/remainder"]["mean"] == pytest.approx(0.0)
    assert pool_decomposition([out, only])["decomp/tokens"] == 100


def test_wilson_median_and_paired_intervals():
    assert wilson_ci(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    lo, hi = wilson_ci(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    assert all(math.isnan(x) for x in wilson_ci(0, 0))
    with pytest.raises(PDMInputError, match="successes"):
        wilson_ci(11, 10)
    med, lo, hi = median_ci(list(range(101)))
    assert med == 50 and lo < 50 < hi
    diff = paired_rate_diff_ci(torch.tensor([True] * 60 + [False] * 40), torch.tensor([True] * 30 + [False] * 70))
    assert diff["diff"] == pytest.approx(0.3) and diff["lo"] > 0


def test_probe_rows_puts_disagreement_first_and_caps():
    outside = torch.tensor([True, True, False, True, True, True])
    dis = torch.tensor([False, False, False, True, False, True])
    rows = probe_rows(outside, dis, 3)
    assert rows[:2].tolist() == [3, 5] and rows.numel() == 3 and bool(outside[rows].all())


def test_bad_input_names_the_argument():
    z, mu_full, sampled, adv, support = _tabular_batch(m=8)
    with pytest.raises(PDMInputError, match="kv"):
        own_update_probe(support, z, {}, adv, torch.ones(8), rules=RULES, disagreement=adv > 0)
    kernel = FunctionalKernel(lambda p: p["z"], {"z": z})
    with pytest.raises(PDMInputError, match="rows: position 0"):
        kernel.kernel_v(torch.tensor([99]), own_direction(z[:1], sampled[:1]))
    with pytest.raises(PDMInputError, match="preconditioner"):
        kernel.kernel_v(torch.tensor([0]), own_direction(z[:1], sampled[:1]), precondition=True)
    assert get_mask_rule("pdm_topk").estimator == "topk"
