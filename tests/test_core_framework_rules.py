"""SPEC §4b rules (dual clip, sequence rejection, OPSM, token k-bands) against hand-computed cases,
their registry records, and the sequence layout through ``pdm_policy_loss``."""
import math

import pytest
import torch

from core_helpers import mismatched_pair, sample_from
from pdm_lab import MaskConfig, compute_mask, pdm_policy_loss, policy_on_support, support_from_full
from pdm_lab.config import ConfigError
from pdm_lab.errors import PDMInputError
from pdm_lab.masks import MASK_RULES
from pdm_lab.tokenwise import TokenStats


def _stats(ratio, d=None):
    r = torch.tensor(ratio, dtype=torch.float64)
    z = torch.zeros_like(r)
    dd = torch.tensor(d, dtype=torch.float64) if d is not None else z
    return TokenStats(topk_kl=dd, topk_tv=dd, binary_kl=dd, binary_tv=dd, full_kl=None, log_ratio=torch.log(r),
                      ratio=r, mu_tail=z, pi_tail=z, ddot={"topk": z}, ddot_lower=z, ddot_upper=z)


def _keep(rule, ratio, adv, resp=None, d=None, **cfg):
    stats = _stats(ratio, d)
    a = torch.tensor(adv, dtype=torch.float64)
    resp_t = None if resp is None else torch.tensor(resp, dtype=torch.bool)
    return compute_mask(MaskConfig(rule=rule, **cfg), stats, a, resp_t).tolist()


def test_records_state_what_each_rule_reads():
    assert MASK_RULES["seq_topk_kl"].level == "sequence" and MASK_RULES["seq_topk_kl"].uses_support
    assert MASK_RULES["seq_topk_kl"].divergence == "topk_kl"
    for name in ("seq_k1", "seq_k2", "seq_k3", "seq_geo_mean", "opsm"):
        rec = MASK_RULES[name]
        assert rec.level == "sequence" and not rec.uses_support and not rec.uses_delta, name
    for name in ("ppo_clip_dual", "token_k1", "token_k2", "token_k3"):
        assert MASK_RULES[name].level == "token" and not MASK_RULES[name].uses_support


def test_dual_clip_hand_cases():
    # r:      1.5 (Â>0: clip)  2.0 (Â<0: inside dual)  3.5 (Â<0: > c = 3)  0.7 (Â<0: < 1−ε_low)  3.5 (Â>0)
    keep = _keep("ppo_clip_dual", [1.5, 2.0, 3.5, 0.7, 3.5], [1.0, -1.0, -1.0, -1.0, 1.0])
    assert keep == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert _keep("ppo_clip_dual", [3.5], [-1.0], dual_clip_c=4.0) == [1.0]
    assert _keep("ppo_clip", [3.5], [-1.0]) == [1.0]  # plain ppo_clip keeps it (SPEC §4)


def test_sequence_k1_mean_is_the_geometric_mean_ratio_test():
    # two responses of three tokens; the second has one padding slot
    ratio = [1.1, 1.0, 0.95, 1.2, 1.3, 9.0]
    resp = [[1, 1, 1], [1, 1, 0]]
    adv = [1.0, 1.0, 1.0, -1.0, -1.0, 0.0]
    geo1 = (1.1 * 1.0 * 0.95) ** (1 / 3)  # 1.0146: inside e^±0.02
    geo2 = (1.2 * 1.3) ** 0.5              # 1.249: outside (padding's 9.0 never counts)
    assert math.exp(-0.02) < geo1 < math.exp(0.02) and geo2 > math.exp(0.02)
    expect = [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert _keep("seq_geo_mean", ratio, adv, resp) == expect
    assert _keep("seq_k1", ratio, adv, resp, seq_agg="mean") == expect
    # max of k1 over response 1 is log 1.1 = 0.095 > 0.02 → dropped too
    assert _keep("seq_k1", ratio, adv, resp, seq_agg="max") == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    # seq_geo_mean ignores seq_agg
    assert _keep("seq_geo_mean", ratio, adv, resp, seq_agg="max") == expect


def test_sequence_k2_k3_sum_hand_values():
    ratio = [1.1, 0.9, 1.0, 1.0]
    resp = [[1, 1], [1, 1]]
    adv = [1.0, 1.0, -1.0, -1.0]
    k2 = 0.5 * math.log(1.1) ** 2 + 0.5 * math.log(0.9) ** 2        # 0.01009
    k3 = (0.1 - math.log(1.1)) + (-0.1 - math.log(0.9))             # 0.01013
    assert _keep("seq_k2", ratio, adv, resp, seq_agg="sum", band_high=k2 - 1e-6) == [0, 0, 1, 1]
    assert _keep("seq_k2", ratio, adv, resp, seq_agg="sum", band_high=k2 + 1e-6) == [1, 1, 1, 1]
    assert _keep("seq_k3", ratio, adv, resp, seq_agg="sum", band_high=k3 - 1e-6) == [0, 0, 1, 1]
    assert _keep("seq_k3", ratio, adv, resp, seq_agg="sum", band_high=k3 + 1e-6) == [1, 1, 1, 1]


def test_sequence_topk_kl_and_veto():
    ratio = [1.0, 1.0, 1.0, 1e-5]
    resp = [[1, 1], [1, 1]]
    adv = [1.0, 1.0, 1.0, 1.0]
    d = [0.01, 0.05, 0.0, 0.0]  # response 1: mean D 0.03 > 0.02
    assert _keep("seq_topk_kl", ratio, adv, resp, d=d, band_low=None) == [0, 0, 1, 1]
    # response 2 has r = 1e-5 < floor 1e-4: the veto drops it whatever its statistic
    assert _keep("seq_topk_kl", ratio, adv, resp, d=d, band_low=None, veto_floor=1e-4) == [0, 0, 0, 0]


def test_opsm_hand_cases():
    # mean of log μ − log π = −mean log r
    ratio = [0.9, 0.9, 0.9, 0.9, 1.0, 1.0]
    resp = [[1, 1], [1, 1], [1, 1]]
    adv = [-1.0, -1.0, 1.0, 1.0, -1.0, -1.0]
    # response 1: Â<0, mean −log 0.9 = 0.105 > 1e-4 → drop; response 2: Â>0 → keep; response 3: 0 → keep
    assert _keep("opsm", ratio, adv, resp) == [0, 0, 1, 1, 1, 1]
    assert _keep("opsm", ratio, adv, resp, opsm_delta=0.2) == [1] * 6


def test_token_bands_hand_cases():
    ratio = [1.01, 1.05, 0.95, 1.05]
    adv = [1.0, 1.0, -1.0, 0.0]  # Â = 0 keeps
    assert _keep("token_k1", ratio, adv) == [1, 0, 0, 1]
    # k3: 5.0e-5, 1.2e-3, 1.3e-3 → the last two exceed 0.001
    assert _keep("token_k3", ratio, adv, band_high=0.001) == [1, 0, 0, 1]
    assert _keep("token_k2", ratio, adv, band_high=0.5 * math.log(1.05) ** 2 - 1e-9) == [1, 0, 0, 1]


def test_sequence_rule_needs_the_layout():
    with pytest.raises(PDMInputError, match="sequence-level"):
        _keep("seq_k1", [1.0, 1.0], [1.0, 1.0])


def test_config_checks_the_new_fields():
    with pytest.raises(ConfigError, match="seq_agg"):
        MaskConfig(seq_agg="median")
    with pytest.raises(ConfigError, match="band"):
        MaskConfig(rule="token_k1", band_low=None, band_high=None)
    with pytest.raises(ConfigError, match="dual_clip_c"):
        MaskConfig(dual_clip_c=0.5)


@pytest.mark.parametrize("rule", ["seq_k1", "seq_topk_kl", "opsm", "ppo_clip_dual", "token_k3"])
def test_rules_run_through_the_loss_with_padding(rule):
    b, t, n = 3, 4, 30
    mu, pi = mismatched_pair(b * t, n, seed=3, noise=0.3)
    k = sample_from(mu, 3)
    support = support_from_full(mu, k, k=5)
    pol = policy_on_support(pi, support.ids)
    resp = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([[1.0] * 4, [-1.0] * 4, [0.5] * 4], dtype=torch.float64)
    out = pdm_policy_loss(pol, support, adv, resp, MaskConfig(rule=rule, k=5, band_low=None, band_high=0.01))
    assert torch.isfinite(out.loss)
    keep = out.keep
    if MASK_RULES[rule].level == "sequence":  # a response is kept or dropped whole
        for row in range(b):
            vals = keep[row][resp[row]].unique()
            assert vals.numel() == 1
