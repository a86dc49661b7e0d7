"""Audit statistics: unsafe-keep rates, paired bootstrap CI, exact sign test."""
import math

import pytest
import torch

from pdm_lab.audit import paired_bootstrap_ci, sign_test, unsafe_keep_rates


def test_rates():
    dd = torch.tensor([0.1, -0.2, 0.0, 0.3, -0.1])
    out = unsafe_keep_rates(dd, torch.tensor([True, True, True, False, True]))
    assert out == {"unsafe_keep": 0.25, "shrink": 0.5, "count": 4, "unsafe_count": 1, "shrink_count": 2}
    assert math.isnan(unsafe_keep_rates(dd, torch.zeros(5, dtype=torch.bool))["unsafe_keep"])


def test_sign_test_exact_values():
    # 9 wins of 10: p = 2·(C(10,0)+C(10,1))/2^10
    x = [1.0] * 9 + [0.0]
    y = [0.5] * 10
    assert sign_test(x, y) == pytest.approx(2 * 11 / 1024)
    assert sign_test([1, 2], [1, 2]) == 1.0


def test_bootstrap_ci_covers_mean_and_shrinks():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(61, generator=gen, dtype=torch.float64) + 0.5
    y = torch.zeros(61, dtype=torch.float64)
    mean, lo, hi = paired_bootstrap_ci(x, y, seed=1)
    assert lo < mean < hi and lo > 0
    _, lo2, hi2 = paired_bootstrap_ci(torch.cat([x, x, x, x]), torch.cat([y, y, y, y]), seed=1)
    assert hi2 - lo2 < hi - lo


def test_nan_pairs_dropped():
    mean, lo, hi = paired_bootstrap_ci([1.0, float("nan"), 3.0], [0.0, 0.0, 1.0], seed=0)
    assert mean == pytest.approx(1.5)


def test_group_advantages_invalid_samples_and_flat_groups():
    from pdm_lab.advantages import group_advantages

    r = torch.tensor([1.0, 0.0, 0.0, 5.0, 2.0, 2.0, 3.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    ok = torch.tensor([True, True, True, False, True, True, True])
    a = group_advantages(r, g, ok)
    assert a[3] == 0 and a[4] == 0 and a[5] == 0 and a[6] == 0  # skipped, flat group, singleton
    assert abs(float(a[:3].sum())) < 1e-6 and a[0] > 0 > a[1]
    torch.testing.assert_close(a[:3], torch.tensor([2 / 3, -1 / 3, -1 / 3]) / ((1 / 3) ** 0.5 + 1e-6))
    assert group_advantages(r, g, ok, scale_by_std=False)[:3].tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3])
