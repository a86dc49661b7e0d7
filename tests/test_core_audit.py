"""Audit statistics: unsafe-keep rates, paired bootstrap CI, exact sign test."""
import math

import pytest
import torch

from pdm_lab.audit import paired_bootstrap_ci, sign_test, unsafe_keep_rates


def test_rates():
    dd = torch.tensor([0.1, -0.2, 0.0, 0.3, -0.1])
    out = unsafe_keep_rates(dd, torch.tensor([True, True, True, False, True]))
    assert out == {"unsafe_keep": 0.25, "shrink": 0.5, "count": 4}
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
