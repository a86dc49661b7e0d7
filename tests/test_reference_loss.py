"""The fast path (``pdm_policy_loss``: chunked π, fused support and stats, eager row blocks or
compiled graphs) equals ``pdm_policy_loss_reference`` (SPEC §2–§5 in plain eager torch) in
float64: loss, gradient, keep mask, for every rule the reference covers."""
from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from pdm_lab import MaskConfig, PDMInputError, pdm_policy_loss_reference
from pdm_lab.masks import get_mask_rule
from pdm_lab.testing.call_site_batch import call_site_batch

RULES = ("none", "ppo_clip", "icepop", "dppo_binary_tv", "dppo_binary_kl", "dppo_topk_tv", "dppo_topk_kl",
         "pdm_agg", "pdm_uniform", "pdm_topk")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _reference(batch, cfg):
    return pdm_policy_loss_reference(batch.logits, *batch.topk.rows(), batch.advantages, batch.response_mask, cfg)


def _margin(out, cfg) -> float:
    """How far the batch's decisions sit from their thresholds (the two paths round differently
    there): the divergence from δ, the direction from 0, r from the ratio bounds."""
    rule, stats = get_mask_rule(cfg.rule), out.stats
    gaps = [stats.log_ratio.abs()]
    gaps += [(stats.ratio - b).abs() for b in (1 + cfg.eps_high, 1 - cfg.eps_low, cfg.icepop_low, cfg.icepop_high)]
    if rule.divergence:
        gaps.append((getattr(stats, rule.divergence) - cfg.delta).abs())
    if rule.estimator:
        gaps.append(stats.ddot[rule.estimator].abs())
    return float(torch.stack(gaps).min())


def _mismatch(batch, cfg, out, ref_loss, ref_keep, compiled=False) -> str | None:
    """Why the fast path's loss, gradient or keep mask differs from the reference's (None: equal)."""
    (grad,) = torch.autograd.grad(out.loss, batch.logits)  # once: a compiled backward keeps no graph
    (ref_grad,) = torch.autograd.grad(ref_loss, batch.logits, retain_graph=True)
    if not torch.equal(out.keep.bool(), ref_keep):
        return f"keep differs at {(out.keep.bool() != ref_keep).nonzero().tolist()}"
    if not torch.allclose(out.loss, ref_loss, rtol=1e-10, atol=1e-13):
        return f"loss {float(out.loss)} vs {float(ref_loss)}"
    if not torch.allclose(grad, ref_grad, rtol=1e-8, atol=1e-13):
        return f"gradient differs by {float((grad - ref_grad).abs().max())}"
    return None


CASES = dict(seed=st.integers(0, 10_000), b=st.integers(2, 4), t=st.integers(1, 5), n=st.integers(8, 40),
             k=st.integers(1, 6), mismatch=st.sampled_from([0.1, 0.6, 1.5]), rule=st.sampled_from(RULES),
             convention=st.sampled_from(["union", "kslot"]), aggregation=st.sampled_from(AGGREGATIONS),
             cap=st.sampled_from([None, 1.2, 4.0]), delta=st.sampled_from([0.01, 0.05, 0.15]))


def _check(seed, b, t, n, k, mismatch, rule, convention, aggregation, cap, delta, compiled):
    batch = call_site_batch(seed, b=b, t=t, n=n, k=min(k, n - 1), mismatch=mismatch)
    cfg = MaskConfig(rule=rule, k=batch.k, delta=delta, convention=convention, aggregation=aggregation,
                     clip_ratio_c=cap, horizon=7 if aggregation.endswith("norm") and seed % 2 else None)
    out = batch.core_loss(cfg, compiled=compiled)
    assume(_margin(out, cfg) > 1e-9)
    ref_loss, ref_keep = _reference(batch, cfg)
    assert _mismatch(batch, cfg, out, ref_loss, ref_keep) is None


@given(**CASES)
def test_fast_eager_path_equals_the_reference(seed, b, t, n, k, mismatch, rule, convention, aggregation, cap, delta):
    _check(seed, b, t, n, k, mismatch, rule, convention, aggregation, cap, delta, compiled=False)


@pytest.mark.slow
@pytest.mark.extended
@settings(max_examples=4)
@given(**CASES)
def test_fast_compiled_path_equals_the_reference(seed, b, t, n, k, mismatch, rule, convention, aggregation, cap,
                                                 delta):
    _check(seed, b, t, n, k, mismatch, rule, convention, aggregation, cap, delta, compiled=True)


def test_the_comparison_catches_a_wrong_estimator_a_wrong_convention_and_a_wrong_aggregation():
    """Planted bugs: a fast path whose rule reads another Ḋ estimator, another support convention
    or another aggregation than the reference's is reported, so the equality above can fail."""
    batch = call_site_batch(seed=3, b=4, t=5, n=24, k=2, mismatch=1.5)  # where pdm_agg, kslot decide otherwise
    cfg = MaskConfig(rule="pdm_topk", k=batch.k, delta=0.01)
    ref_loss, ref_keep = _reference(batch, cfg)
    assert _mismatch(batch, cfg, batch.core_loss(cfg), ref_loss, ref_keep) is None
    for wrong in (dict(rule="pdm_agg"), dict(convention="kslot"), dict(aggregation="seq-mean-token-sum")):
        planted = MaskConfig(**{**dict(rule="pdm_topk", k=batch.k, delta=0.01), **wrong})
        assert _mismatch(batch, cfg, batch.core_loss(planted), ref_loss, ref_keep) is not None, wrong


def test_the_reference_refuses_a_rule_it_does_not_cover_by_its_record():
    batch = call_site_batch(seed=1)
    for rule in ("pdm_exact", "pdm_coupled", "pdm_kernel", "seq_geo_mean", "token_k1"):
        with pytest.raises(PDMInputError, match=f"rule '{rule}' is not covered"):
            _reference(batch, MaskConfig(rule=rule, k=batch.k))
