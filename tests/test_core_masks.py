"""Mask rules follow SPEC §4's truth table; the registry; permutation equivariance; diagnose."""
import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

from core_helpers import mismatched_pair, sample_from
import pdm_lab
from pdm_lab import MaskConfig, compute_mask, diagnose
from pdm_lab.support import id_dtype
from pdm_lab import direction
from pdm_lab import rule_check
from pdm_lab.integrations.sampled_token import sampled_token_rules
from pdm_lab.masks import MASK_RULES, pdm_rule, register_mask
from pdm_lab.tokenwise import TokenStats


def _stats(**cols):
    n = len(next(iter(cols.values())))
    z = torch.zeros(n, dtype=torch.float64)
    t = lambda name: torch.tensor(cols[name], dtype=torch.float64) if name in cols else z
    ratio = t("ratio") if "ratio" in cols else torch.ones(n, dtype=torch.float64)
    ddot = {name: t("ddot") for name in ("agg", "uniform", "topk", "exact")}
    return TokenStats(topk_kl=t("d"), topk_tv=t("d"), binary_kl=t("d"), binary_tv=t("d"), full_kl=None,
                      log_ratio=torch.log(ratio), ratio=ratio, mu_tail=z, pi_tail=z, ddot=ddot,
                      ddot_lower=z, ddot_upper=z)


# columns: D, r, Ḋ, Â  → expected keep for dppo_topk_kl and pdm_*
TRUTH = [
    # inside the region: always kept
    (0.10, 1.5, +1.0, +1.0, 1, 1),
    (0.10, 0.5, -1.0, -1.0, 1, 1),
    # outside, ratio and Ḋ agree: both drop outward updates, keep inward
    (0.30, 1.5, +0.2, +1.0, 0, 0),
    (0.30, 1.5, +0.2, -1.0, 1, 1),
    (0.30, 0.5, -0.2, -1.0, 0, 0),
    (0.30, 0.5, -0.2, +1.0, 1, 1),
    # outside, they disagree: r > 1 but Ḋ < 0 (global coupling pulls back)
    (0.30, 1.5, -0.2, +1.0, 0, 1),
    (0.30, 1.5, -0.2, -1.0, 1, 0),
    # Â = 0 or a zero direction keeps
    (0.30, 1.5, +0.2, 0.0, 1, 1),
    (0.30, 1.5, 0.0, +1.0, 0, 1),
    (0.30, 1.0, +0.2, +1.0, 1, 0),
]


@pytest.mark.parametrize("row", TRUTH)
@pytest.mark.parametrize("estimator", ["agg", "uniform", "topk", "exact"])
def test_truth_table(row, estimator):
    d, r, dd, a, keep_dppo, keep_pdm = row
    stats = _stats(d=[d], ratio=[r], ddot=[dd])
    adv = torch.tensor([a], dtype=torch.float64)
    assert compute_mask(MaskConfig(rule="dppo_topk_kl", delta=0.15), stats, adv).item() == keep_dppo
    assert compute_mask(MaskConfig(rule=f"pdm_{estimator}", delta=0.15), stats, adv).item() == keep_pdm


def test_separate_delta_for_negative_advantages():
    stats = _stats(d=[0.3, 0.3], ratio=[1.5, 0.5], ddot=[0.1, -0.1])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    keep = compute_mask(MaskConfig(rule="pdm_uniform", delta=0.15, delta_neg=0.5), stats, adv)
    assert keep.tolist() == [0.0, 1.0]


def test_ppo_clip_and_icepop_and_none():
    stats = _stats(d=[0, 0, 0, 0], ratio=[1.3, 1.1, 0.7, 0.3])
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    assert compute_mask(MaskConfig(rule="ppo_clip"), stats, adv).tolist() == [0, 1, 0, 1]
    assert compute_mask(MaskConfig(rule="icepop", icepop_low=0.5, icepop_high=1.2), stats, adv).tolist() == [0, 1, 1, 0]
    assert compute_mask(MaskConfig(rule="none"), stats, adv).tolist() == [1, 1, 1, 1]


def test_binary_rules_use_binary_divergence():
    stats = _stats(d=[0.3], ratio=[1.5])
    stats = dataclasses.replace(stats, binary_tv=torch.tensor([0.01], dtype=torch.float64))
    adv = torch.ones(1, dtype=torch.float64)
    assert compute_mask(MaskConfig(rule="dppo_binary_tv"), stats, adv).item() == 1
    assert compute_mask(MaskConfig(rule="dppo_topk_tv"), stats, adv).item() == 0


def test_unknown_rule_lists_valid_names():
    with pytest.raises(pdm_lab.ConfigError, match="pdm_uniform"):
        MaskConfig(rule="pdm_unifrom")


@pytest.fixture
def registry():
    """MASK_RULES and DDOT_ESTIMATORS as they were, after the test registers its own."""
    rules, estimators = dict(MASK_RULES), dict(direction.DDOT_ESTIMATORS)
    yield
    for live, saved in ((MASK_RULES, rules), (direction.DDOT_ESTIMATORS, estimators)):
        live.clear()
        live.update(saved)


#: Every built-in record as SPEC §4 states it: (divergence, estimator, support, uses_delta,
#: uses_k, level, needs, binary_stats). verl and the launch files choose the top-K path by
#: ``support``, the sweep its δ and K axes by ``uses_delta`` / ``uses_k``, the loss computes
#: binary divergences by ``binary_stats``.
RECORDS = {
    "none": (None, None, "slot", False, False, "token", (), False),
    "ppo_clip": (None, None, "slot", False, False, "token", (), False),
    "ppo_clip_dual": (None, None, "slot", False, False, "token", (), False),
    "icepop": (None, None, "slot", False, False, "token", (), False),
    "dppo_binary_tv": ("binary_tv", None, "slot", True, False, "token", (), True),
    "dppo_binary_kl": ("binary_kl", None, "slot", True, False, "token", (), True),
    "dppo_topk_tv": ("topk_tv", None, "topk", True, True, "token", (), False),
    "dppo_topk_kl": ("topk_kl", None, "topk", True, True, "token", (), False),
    "pdm_exact": ("topk_kl", "exact", "topk", True, True, "token", ("full",), False),
    "pdm_agg": ("topk_kl", "agg", "topk", True, True, "token", (), False),
    "pdm_uniform": ("topk_kl", "uniform", "topk", True, True, "token", (), False),
    "pdm_topk": ("topk_kl", "topk", "topk", True, True, "token", (), False),
    "pdm_coupled": ("topk_kl", None, "topk", True, True, "token", ("coupled",), False),
    "pdm_kernel": ("topk_kl", "topk", "topk", True, True, "token", ("kernel",), False),
    **{f"seq_{s}": (None, None, "slot", False, False, "sequence", (), False) for s in ("k1", "k2", "k3", "geo_mean")},
    "seq_topk_kl": ("topk_kl", None, "topk", False, True, "sequence", (), False),
    "opsm": (None, None, "slot", False, False, "sequence", (), False),
    **{f"token_{s}": (None, None, "slot", False, False, "token", (), False) for s in ("k1", "k2", "k3")},
}
FACTS = ("divergence", "estimator", "support", "uses_delta", "uses_k", "level", "needs", "binary_stats")


def _facts(rule):
    return tuple(getattr(rule, fact) for fact in FACTS)


def test_every_builtin_record_is_as_spec_states_it():
    assert {name: _facts(rule) for name, rule in MASK_RULES.items()} == RECORDS
    assert FACTS == tuple(MASK_RULES["none"].record())


def test_the_rules_example_registers_a_topk_rule(registry):
    """docs/guide/rules.md's own example registers, with the record it declares."""
    guide = (Path(__file__).resolve().parents[1] / "docs" / "guide" / "rules.md").read_text(encoding="utf-8")
    start = guide.index("from pdm_lab.masks import")
    exec(guide[start:guide.index("```", start)], {})
    assert _facts(MASK_RULES["my_rule"]) == ("topk_kl", "topk", "topk", True, True, "token", (), False)


def test_a_rule_that_delegates_declares_the_record_of_what_it_calls(registry):
    inner = MASK_RULES["pdm_topk"]

    @register_mask("test_delegating", like="pdm_topk")
    def delegating(stats, advantages, cfg):
        return inner(stats, advantages, cfg)

    assert _facts(MASK_RULES["test_delegating"]) == _facts(inner)
    assert "test_delegating" not in sampled_token_rules()  # the verl plugin's sampled-token set


def test_a_new_estimator_gets_its_rule_as_direction_py_says(registry):
    @direction.register_ddot_estimator("test_half_agg")
    def half_agg(view):
        return direction._where_tail(view, 0.5 * view.pi_tail * (view.mu_tail - view.pi_tail))

    register_mask("pdm_test_half_agg", like="pdm_topk", estimator="test_half_agg")(pdm_rule("test_half_agg"))
    rule = MASK_RULES["pdm_test_half_agg"]
    assert _facts(rule) == ("topk_kl", "test_half_agg", "topk", True, True, "token", (), False)
    assert MaskConfig(rule="pdm_test_half_agg").direction_estimator == "test_half_agg"


def test_the_probe_configs_have_every_mask_config_field():
    fields = {f.name for f in dataclasses.fields(MaskConfig)}
    assert set(rule_check.CHECK_CONFIG) == fields
    assert all(set(config) == fields for config in rule_check.CONFIGS)


def test_adding_a_rule_is_one_decorated_function():
    @register_mask("test_drop_all_positive")  # declares the defaults: one slot, no δ, no K
    def _drop_pos(stats, advantages, cfg):
        return advantages > 0

    try:
        stats = _stats(d=[0.0, 0.0], ratio=[1.0, 1.0])
        keep = compute_mask(MaskConfig(rule="test_drop_all_positive"), stats, torch.tensor([1.0, -1.0], dtype=torch.float64))
        assert keep.tolist() == [0.0, 1.0]
    finally:
        MASK_RULES.pop("test_drop_all_positive")


@given(seed=st.integers(0, 10**6), n=st.integers(2, 500))
def test_permuting_tokens_permutes_outputs(seed, n):
    mu, pi = mismatched_pair(12, n, seed, noise=1.0)
    sampled = sample_from(mu, seed)
    adv = torch.randn(12, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(seed + 1))
    a = diagnose(mu, pi, sampled, adv, k=5, delta=0.05)
    b = diagnose(mu[perm], pi[perm], sampled[perm], adv[perm], k=5, delta=0.05)
    for key, value in a.items():
        assert torch.equal(value[perm], b[key]), key


def test_diagnose_keys_and_shapes():
    mu, pi = mismatched_pair(7, 100, 0)
    out = diagnose(mu, pi, sample_from(mu, 0), torch.ones(7, dtype=torch.float64), k=20, delta=0.15)
    keys = {"topk_kl", "topk_tv", "full_kl", "ratio", "mu_tail", "pi_tail", "ddot_exact", "ddot_agg",
            "ddot_uniform", "ddot_topk", "ddot_lower", "ddot_upper", "outside", "mask_dppo_topk_kl",
            "mask_pdm_exact", "mask_pdm_agg", "mask_pdm_uniform", "mask_pdm_topk", "support"}
    assert keys <= set(out)
    for key in keys - {"support"}:
        assert out[key].shape == (7,), key
    assert out["outside"].dtype == torch.bool
    assert out["support"].dtype == id_dtype(out["support"].max().item() + 1) and out["support"].shape[0] == 7
    assert set(out["mask_pdm_topk"].unique().tolist()) <= {0.0, 1.0}
