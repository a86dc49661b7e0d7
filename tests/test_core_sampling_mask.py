"""The engine's sampling mask (SPEC §1): vLLM's cut reproduced, π renormalised over it, and the
mismatch the cut alone creates gone (float64, same logits on both sides)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from pdm_lab import MaskConfig, pdm_policy_loss
from pdm_lab.errors import PDMInputError
from pdm_lab.policy_side import policy_on_support, policy_on_support_reference
from pdm_lab.sampling_mask import SamplingMask, engine_kept, on_sampling_set, sampling_keep
from pdm_lab.tokenwise import token_stats
from pdm_lab.support import support_from_topk, topk_lower_id_ties

NEG_INF = float("-inf")


def _vllm_cut(z: torch.Tensor, mask: SamplingMask) -> torch.Tensor:
    """vLLM's own functions (min-p processor, then ``apply_top_k_top_p_pytorch``) → kept set."""
    sampler = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    builtin = pytest.importorskip("vllm.v1.sample.logits_processor.builtin")
    n, vocab = z.shape
    z = z.clone()
    if mask.min_p > 0:
        proc = builtin.MinPLogitsProcessor.__new__(builtin.MinPLogitsProcessor)
        proc.min_p_count, proc.min_p = n, torch.full((n, 1), mask.min_p, dtype=z.dtype)
        z = proc.apply(z)
    k = torch.full((n,), mask.top_k, dtype=torch.int32) if 0 < mask.top_k < vocab else None
    p = torch.full((n,), mask.top_p, dtype=z.dtype) if mask.top_p < 1 else None
    return sampler.apply_top_k_top_p_pytorch(z, k, p, allow_cpu_sync=True) > NEG_INF


MASKS = [SamplingMask(top_p=0.9), SamplingMask(top_k=50), SamplingMask(top_k=7, top_p=0.8),
         SamplingMask(min_p=0.05), SamplingMask(min_p=0.02, top_k=30, top_p=0.95)]


@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_cut_equals_vllms_own(mask):
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(64, 500, generator=gen) * 3  # float32, as vLLM's sampler
    torch.testing.assert_close(sampling_keep(z, mask), _vllm_cut(z, mask), rtol=0, atol=0)
    # exact ties: vLLM's unstable sort picks which tied tokens go; how many go is fixed
    tied = (z * 2).round() / 2
    assert torch.equal(sampling_keep(tied, mask).sum(1), _vllm_cut(tied, mask).sum(1))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 12), vocab=st.integers(2, 400), m=st.integers(1, 8), chunk=st.integers(1, 5),
       top_k=st.integers(0, 60), top_p=st.sampled_from([0.5, 0.9, 1.0]), min_p=st.sampled_from([0.0, 0.03]),
       temperature=st.sampled_from([0.7, 1.0]), seed=st.integers(0, 10**6))
def test_chunked_equals_reference_over_the_sampling_set(n, vocab, m, chunk, top_k, top_p, min_p, temperature, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    m = min(m, vocab)
    ids = torch.argsort(torch.rand(n, vocab, generator=gen), dim=1)[:, :m]
    if m > 1:
        ids[:, -1] = torch.where(torch.rand(n, generator=gen) < 0.3, -1, ids[:, -1])
    keep_s = torch.rand(n, m, generator=gen) < 0.7
    keep_s[:, 0] = True  # slot 0 plays k: the engine always kept it
    mask = SamplingMask(top_k=top_k, top_p=top_p, min_p=min_p)
    weights = torch.randn(n, m, generator=gen, dtype=torch.float64)
    outs = []
    for fn, kw in ((policy_on_support, {"chunk_size": chunk}), (policy_on_support_reference, {})):
        pol = fn(logits, ids, temperature=temperature, sampling=mask, keep_on_support=keep_s, **kw)
        (grad,) = torch.autograd.grad((torch.where(torch.isfinite(pol.logp), pol.logp, 0) * weights).sum(), logits)
        outs.append((pol, grad))
    (fast, g_fast), (ref, g_ref) = outs
    for name in ("logp", "tail_logp", "tail_log_sumsq", "tail_count"):
        torch.testing.assert_close(getattr(fast, name), getattr(ref, name), msg=name)
    torch.testing.assert_close(g_fast, g_ref)
    if mask.active:  # π sums to 1 over C: the support's kept mass plus the tail
        valid = ids >= 0
        head = torch.logsumexp(fast.logp.masked_fill(~valid, NEG_INF), dim=1)
        total = torch.logaddexp(head, fast.tail_logp)
        torch.testing.assert_close(total, torch.zeros_like(total), atol=1e-12, rtol=0)
        assert bool((fast.logp[valid & ~keep_s] == NEG_INF).all())  # the engine's cut on S wins
    else:
        assert fast.tail_count is None


def _engine_rollout(logits: torch.Tensor, mask: SamplingMask, k: int, gen: torch.Generator, temperature: float):
    """An fp64 "engine" without noise: μ = the cut softmax of the same logits, k ~ μ, top-K as vLLM
    returns it (processed log-probs, −inf where cut)."""
    z = logits / temperature
    keep = sampling_keep(z, mask)
    mu = torch.log_softmax(z.masked_fill(~keep, NEG_INF), dim=-1)
    sampled = torch.multinomial(mu.exp(), 1, generator=gen)[:, 0]
    top_ids, top_logp = topk_lower_id_ties(mu, k)
    return top_ids, top_logp, sampled, mu.gather(1, sampled[:, None])[:, 0]


def _divergence(logits, rollout, mask: SamplingMask | None, k: int, temperature: float, convention="union"):
    support = support_from_topk(*rollout, vocab_size=logits.shape[1], k=k, convention=convention)
    pi = policy_on_support(logits, support.ids, temperature=temperature, sampling=mask,
                           keep_on_support=engine_kept(support))
    return token_stats(on_sampling_set(support, pi.tail_count), pi), support, pi


@pytest.mark.parametrize("convention", ["union", "kslot"])
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_the_cut_alone_is_no_mismatch_with_the_mask(mask, convention):
    """Same logits on both sides: D ≈ 0 with the sampling mask, D > 0 without (the cut is all)."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(400, 300, generator=gen, dtype=torch.float64) * 2.5
    k, temperature = 20, 0.9
    rollout = _engine_rollout(logits, mask, k, gen, temperature)
    with_mask, _, _ = _divergence(logits, rollout, mask, k, temperature, convention)
    without, _, _ = _divergence(logits, rollout, None, k, temperature, convention)
    for stats in (with_mask, without):
        assert bool(torch.isfinite(stats.topk_kl).all())
    assert float(with_mask.topk_kl.abs().max()) < 1e-12
    assert float(with_mask.log_ratio.abs().max()) < 1e-12
    for name, ddot in with_mask.ddot.items():  # π = μ: every Ḋ estimator is 0 too
        assert float(ddot.abs().max()) < 1e-12, name
    assert float(without.topk_kl.mean()) > 1e-3
    assert float((without.log_ratio < -1e-6).float().mean()) > 0.9  # π_k < μ_k: μ renormalised


def test_a_wrong_cut_is_caught():
    """Planted bug: the trainer reproduces top_p 0.95 for an engine at 0.9 — D is clearly > 0."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(400, 300, generator=gen, dtype=torch.float64) * 2.5
    rollout = _engine_rollout(logits, SamplingMask(top_p=0.9), 20, gen, 1.0)
    wrong, _, _ = _divergence(logits, rollout, SamplingMask(top_p=0.95), 20, 1.0)
    assert float(wrong.topk_kl.mean()) > 1e-3


def test_a_sampling_set_inside_the_support_has_an_empty_tail():
    """C ⊆ S (top_k 5 < K 20): t = 0, μ_T = π_T = 0, D = 0 exactly; without the support's new tail
    count the engine's rounding residue in μ_T against π_T = 0 would be an infinite D."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(50, 100, generator=gen, dtype=torch.float64) * 2
    mask = SamplingMask(top_k=5)
    rollout = _engine_rollout(logits, mask, 20, gen, 1.0)
    stats, support, pi = _divergence(logits, rollout, mask, 20, 1.0)
    assert bool((pi.tail_count == 0).all())
    assert bool((on_sampling_set(support, pi.tail_count).mu_tail_logp == NEG_INF).all())
    assert float(stats.topk_kl.abs().max()) < 1e-12 and bool((stats.pi_tail == 0).all())


def test_the_sampled_token_is_never_cut():
    """The trainer's logits put k outside its own top-1 cut; the engine sampled it, so it stays."""
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0]], dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[1, 0]])  # S = {k = 1, 0}; the engine kept k only
    pol = policy_on_support(logits, ids, sampling=SamplingMask(top_k=1),
                            keep_on_support=torch.tensor([[True, False]]))
    assert pol.logp[0, 0].item() == 0.0 and pol.logp[0, 1].item() == NEG_INF  # π = e_k over C = {k}
    assert pol.tail_count.tolist() == [0]
    pol.logp[0, 0].backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))  # log π_k = 0 on C = {k}: no gradient


def test_the_loss_with_the_mask_equals_the_loss_on_pi_renormalised():
    """The core loss on the masked π equals the loss with π's cut applied by hand (full softmax
    over C), and the rule's mask sees zero divergence where the cut was the only difference."""
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(6 * 5, 80, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    mask = SamplingMask(top_p=0.85)
    rollout = _engine_rollout(logits.detach(), mask, 8, gen, 1.0)
    support = support_from_topk(*rollout, vocab_size=80, k=8)
    pi = policy_on_support(logits, support.ids, sampling=mask, keep_on_support=engine_kept(support))
    adv = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    cfg = MaskConfig(rule="pdm_topk", k=8, delta=1e-9)
    out = pdm_policy_loss(pi, on_sampling_set(support, pi.tail_count), adv, torch.ones(6, 5, dtype=torch.bool), cfg)
    assert float(out.metrics["mask/frac_dropped"]) == 0.0
    keep = sampling_keep(logits.detach(), mask)
    logp_k = torch.log_softmax(logits.masked_fill(~keep, NEG_INF), dim=-1).gather(1, rollout[2][:, None])[:, 0]
    by_hand = -(adv.reshape(-1) * torch.exp(logp_k - rollout[3])).mean()
    torch.testing.assert_close(out.loss, by_hand)


def test_bad_parameters_and_shapes_name_what_is_wrong():
    for kwargs, word in (({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"min_p": -0.1}, "min_p"),
                         ({"top_k": -2}, "top_k"), ({"top_p": math.nan}, "top_p")):
        with pytest.raises(PDMInputError, match=word):
            SamplingMask(**kwargs)
    with pytest.raises(PDMInputError, match="keep_on_support"):
        policy_on_support(torch.randn(3, 10), torch.zeros(3, 2, dtype=torch.long) + torch.arange(2),
                          sampling=SamplingMask(top_p=0.5), keep_on_support=torch.ones(3, 1, dtype=torch.bool))
    with pytest.raises(PDMInputError, match="keep_on_support.*keeps no token"):
        policy_on_support(torch.randn(1, 2), torch.tensor([[0, 1]]), sampling=SamplingMask(top_p=0.5),
                          keep_on_support=torch.tensor([[False, False]]))
    assert SamplingMask.from_mapping({"top_k": None, "top_p": 0.9}) == SamplingMask(top_p=0.9)
    assert not SamplingMask(top_k=-1).active and SamplingMask(min_p=0.1).active
