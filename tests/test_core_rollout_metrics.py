"""verl's rollout-correction metrics (pdm_lab.rollout_corr): each key against a float64 hand
computation written from verl's definitions, exact merges over sequence splits, the rollout-time
view under verl's keys, finite values for extreme ratios, and planted bugs the checks catch."""
from __future__ import annotations

import math

import pytest
import torch

from pdm_lab.loss import pdm_policy_loss
from pdm_lab.mask_config import MaskConfig
from pdm_lab.metrics import as_mismatch, finalize_floats, merge_metrics, rollout_corr_sums
from pdm_lab.policy_side import policy_on_support
from pdm_lab.rollout_corr import ROLLOUT_CORR_KEYS, SAFETY_BOUND
from pdm_lab.support import support_from_full

B, T = 6, 7


def layout_batch(seed=0, scale=0.4):
    """log r [B·T], response [B·T] (row 3 empty, ragged ends), keep [B·T] 1/0."""
    gen = torch.Generator().manual_seed(seed)
    log_r = scale * torch.randn(B * T, generator=gen, dtype=torch.float64)
    resp = torch.ones(B, T, dtype=torch.bool)
    resp[0, 5:] = False
    resp[3] = False  # a sequence with no response token: not a sequence of the per-sequence means
    resp[4, 2:] = False
    log_r = torch.where(resp.reshape(-1), log_r, float("nan"))  # padding may hold anything
    keep = (torch.rand(B * T, generator=gen) > 0.25).double()
    return log_r, resp.reshape(-1), keep


def hand(log_r, resp, keep, cap):
    """verl's formulas (rollout_corr_helper.compute_offpolicy_metrics / compute_is_metrics /
    compute_rollout_rejection_mask), one Python float at a time, over response tokens."""
    rows = [[float(log_r[i * T + t]) for t in range(T) if resp[i * T + t]] for i in range(B)]
    toks = [x for row in rows for x in row]
    kept = [[float(keep[i * T + t]) for t in range(T) if resp[i * T + t]] for i in range(B)]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    clamp = lambda x: min(max(x, -SAFETY_BOUND), SAFETY_BOUND)  # noqa: E731
    raw = [math.exp(clamp(x)) for x in toks]
    w = [min(x, cap) for x in raw]
    seqs = [row for row in rows if row]
    d = [-mean(row) for row in seqs]
    out = {
        "rollout_corr/kl": mean([-x for x in toks]),                     # E[log μ − log π]
        "rollout_corr/k3_kl": mean([math.exp(x) - x - 1 for x in toks]),
        "rollout_corr/chi2_token": mean([r * r for r in raw]) - 1.0,
        "rollout_corr/chi2_seq": mean([math.exp(2 * clamp(sum(row))) for row in seqs]) - 1.0,
        "rollout_corr/ppl_ratio": mean([math.exp(x) for x in d]),
        "rollout_corr/log_ppl_diff": mean(d), "rollout_corr/log_ppl_abs_diff": mean([abs(x) for x in d]),
        "rollout_corr/log_ppl_diff_max": max(d), "rollout_corr/log_ppl_diff_min": min(d),
        "rollout_corr/rollout_is_mean": mean(w), "rollout_corr/rollout_is_max": max(w),
        "rollout_corr/rollout_is_min": min(w),
        "rollout_corr/rollout_is_ratio_fraction_high": mean([float(r > cap) for r in raw]),
        "rollout_corr/rollout_is_ratio_fraction_low": mean([float(r < 1 / cap) for r in raw]),
        "rollout_corr/rollout_rs_seq_masked_fraction": mean([float(any(k == 0 for k in row)) for row in kept if row]),
    }
    return out


def verl_view(log_r, resp, keep, cap):
    return finalize_floats(as_mismatch(rollout_corr_sums(log_r, resp, keep=keep, cap=cap, layout=(B, T))))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_key_equals_the_float64_hand_computation(seed):
    log_r, resp, keep = layout_batch(seed)
    cap = 1.3
    got = verl_view(log_r, resp, keep, cap)
    want = hand(log_r, resp, keep, cap)
    assert set(want) <= set(got)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-14), key
    # the cap splits the batch, so the fractions and the capped max are decisive here
    assert 0 < want["rollout_corr/rollout_is_ratio_fraction_high"] < 1
    assert 0 < want["rollout_corr/rollout_is_ratio_fraction_low"] < 1
    assert 0 < want["rollout_corr/rollout_rs_seq_masked_fraction"] < 1


def test_planted_bugs_are_caught():
    """Each decisive comparison can fail: a sign flip of k1, verl's mean(r²) − 1 read as χ²
    without the − 1, the empty sequence counted, the uncapped max, each differs from the core."""
    log_r, resp, keep = layout_batch(4)
    cap = 1.3
    got = verl_view(log_r, resp, keep, cap)
    want = hand(log_r, resp, keep, cap)
    close = lambda a, b: a == pytest.approx(b, rel=1e-9, abs=1e-12)  # noqa: E731
    assert not close(got["rollout_corr/kl"], -want["rollout_corr/kl"])
    assert not close(got["rollout_corr/chi2_token"], want["rollout_corr/chi2_token"] + 1.0)
    n_seq = 5  # with the empty sequence counted (d = 0, as verl does) the means change
    assert not close(got["rollout_corr/ppl_ratio"], (want["rollout_corr/ppl_ratio"] * n_seq + 1.0) / (n_seq + 1))
    uncapped = math.exp(max(float(x) for x in log_r[resp]))
    assert not close(got["rollout_corr/rollout_is_max"], uncapped)


def test_merging_sequence_splits_is_exact_and_the_key_set_follows_the_inputs():
    log_r, resp, keep = layout_batch(5)
    whole = finalize_floats(rollout_corr_sums(log_r, resp, keep=keep, cap=2.0, layout=(B, T)))
    parts = []
    for lo, hi in ((0, 1), (1, 4), (4, B)):  # micro-batches or ranks: whole sequences each
        rows = slice(lo * T, hi * T)
        parts.append(rollout_corr_sums(log_r[rows], resp[rows], keep=keep[rows], cap=2.0, layout=(hi - lo, T)))
    merged = finalize_floats(merge_metrics(*parts))
    assert merged == pytest.approx(whole, rel=1e-12, abs=1e-15)
    bare = rollout_corr_sums(log_r, resp)
    assert set(bare) == {"corr/k1_kl", "corr/k3_kl", "corr/chi2_token", "corr/is_mean", "corr/is_max", "corr/is_min"}
    assert set(whole) - set(bare) == {k for k in ROLLOUT_CORR_KEYS if k.startswith("corr/")} - set(bare)


def test_extreme_ratios_stay_finite_and_match_verl_within_the_clamp():
    """|log r| beyond verl's bound of 20: weights and χ² as verl clamps them, k3 on the upper
    side only; every value finite (SPEC §8). Inside the bound nothing is clamped."""
    log_r = torch.tensor([300.0, -300.0, 0.5, -0.25], dtype=torch.float64)
    resp = torch.ones(4, dtype=torch.bool)
    got = finalize_floats(rollout_corr_sums(log_r, resp, layout=(2, 2)))
    assert all(math.isfinite(v) for v in got.values()), got
    assert got["corr/is_max"] == math.exp(SAFETY_BOUND) and got["corr/is_min"] == math.exp(-SAFETY_BOUND)
    k3 = [math.expm1(min(x, SAFETY_BOUND)) - x for x in (300.0, -300.0, 0.5, -0.25)]
    assert got["corr/k3_kl"] == pytest.approx(sum(k3) / 4, rel=1e-12)
    assert got["corr/k1_kl"] == pytest.approx(-(0.5 - 0.25) / 4, rel=1e-12)
    # a small mismatch: χ² taken per term keeps its digits (mean(r²) − 1 would cancel them)
    tiny = torch.full((8,), 1e-9, dtype=torch.float64)
    got = finalize_floats(rollout_corr_sums(tiny, torch.ones(8, dtype=torch.bool)))
    assert got["corr/chi2_token"] == pytest.approx(2e-9, rel=1e-8)
    assert got["corr/k3_kl"] == pytest.approx(0.5e-18, rel=1e-6)


def test_the_loss_reports_them_from_its_own_ratios():
    """pdm_policy_loss: the corr/* keys are the core's function of its own log r, [B, T] layout,
    keep mask and cap; the rollout-time view renames them to verl's keys."""
    gen = torch.Generator().manual_seed(7)
    n, k = 30, 5
    mu = torch.log_softmax(2 * torch.randn(B * T, n, generator=gen, dtype=torch.float64), -1)
    logits = mu + 0.5 * torch.randn(B * T, n, generator=gen, dtype=torch.float64)
    sampled = torch.multinomial(mu.exp(), 1, generator=gen)[:, 0]
    support = support_from_full(mu, sampled, k=k)
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    resp = layout_batch()[1].reshape(B, T)
    cfg = MaskConfig(rule="pdm_topk", delta=0.02, k=k, clip_ratio_c=1.4)
    out = pdm_policy_loss(policy_on_support(logits, support.ids), support, adv, resp, cfg, compiled=False)
    want = hand(out.stats.log_ratio, resp.reshape(-1), out.keep.reshape(-1).double(), 1.4)
    view = finalize_floats(as_mismatch(out.metric_sums))
    for key, value in want.items():
        assert view[key] == pytest.approx(value, rel=1e-12, abs=1e-14), key
    assert view["rollout_corr/rollout_rs_masked_fraction"] == out.metrics["mask/frac_dropped"].item()
