"""Rule records are declared and checked (pdm_lab.rule_record): a planted mis-declared rule is
refused at registration in one line naming the field; a branch one probe does not take is seen by
the check set; every built-in rule's name is written literally where it is registered."""
import re
from pathlib import Path

import pytest
import torch

from pdm_lab import direction

from pdm_lab import rule_check
from pdm_lab.errors import exit_code, is_input_error
from pdm_lab.masks import MASK_RULES, RuleRecordError, register_mask
from pdm_lab.rule_record import DIVERGENCES, FIELDS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def registry():
    """MASK_RULES and DDOT_ESTIMATORS as they were, after the test registers its own."""
    rules, estimators = dict(MASK_RULES), dict(direction.DDOT_ESTIMATORS)
    yield
    for live, saved in ((MASK_RULES, rules), (direction.DDOT_ESTIMATORS, estimators)):
        live.clear()
        live.update(saved)


# --- planted rules: each function, and a record that lies about it --------------------------

def _topk_pdm(stats, advantages, cfg):
    return (stats.topk_kl > cfg.delta) & (advantages * stats.ddot["topk"] > 0)


def _ratio_with_delta(stats, advantages, cfg):
    return (stats.log_ratio.abs() > cfg.delta) & (advantages != 0)


def _delta_only_when_all_negative(stats, advantages, cfg):
    if bool((advantages < 0).all()):  # the mixed-Â probe never takes this branch
        return stats.log_ratio < -cfg.delta
    return advantages * stats.log_ratio > 0.5


def _tail_only_under_kslot(stats, advantages, cfg):
    if cfg.convention == "kslot":
        return stats.mu_tail > 0.1
    return stats.log_ratio > 0.5


def _topk_only_when_every_ratio_below_one(stats, advantages, cfg):
    if bool((stats.log_ratio < 0).all()):
        return (stats.topk_tv > 0.05) & (advantages != 0)
    return torch.zeros_like(advantages, dtype=torch.bool)


def _two_arguments(stats, advantages):
    return advantages > 0


def _five_arguments(stats, advantages, cfg, response_mask, extra):
    return advantages > 0


def _sequence(stats, advantages, cfg, response_mask):
    resp = response_mask.bool()
    seq = (stats.log_ratio.reshape(resp.shape).abs() * resp).amax(dim=1) > 0.5
    return (seq[:, None] & resp).reshape(-1) & (advantages != 0)


def _reads_coupled(stats, advantages, cfg):
    return (stats.topk_kl > cfg.delta) & (advantages != 0) & (stats.coupled > 0)


def _reads_kernel(stats, advantages, cfg):
    return (stats.topk_kl > cfg.delta) & (advantages * (stats.ddot["topk"] + cfg.kernel_ratio * stats.kernel) > 0)


def _binary_tv(stats, advantages, cfg):
    return (stats.binary_tv > cfg.delta) & (advantages * stats.log_ratio > 0)


def _topk_tv(stats, advantages, cfg):
    return (stats.topk_tv > cfg.delta) & (advantages * stats.log_ratio > 0)


def _tail_guard_only(stats, advantages, cfg):
    return (stats.mu_tail >= 0) & (advantages > 0)  # reads the support, drops never move with K


def _full_kl(stats, advantages, cfg):
    return stats.full_kl > cfg.delta


def _type_error_inside(stats, advantages, cfg):
    return stats.log_ratio > cfg.delta + "0.1"


def _keep_floats(stats, advantages, cfg):
    return (stats.log_ratio <= 0).float()


PDM = dict(divergence="topk_kl", estimator="topk", support="topk", uses_delta=True, uses_k=True)
PLANTED = {
    # declarations that misstate what the rule reads
    "topk rule declared one slot": (_topk_pdm, {**PDM, "support": "slot", "uses_k": False}, "support"),
    "delta read, declared unread": (_ratio_with_delta, {"uses_delta": False}, "uses_delta"),
    "delta read, left out": (_ratio_with_delta, {}, "uses_delta"),
    "delta read in an untaken branch": (_delta_only_when_all_negative, {}, "uses_delta"),
    "top-K tail read under kslot only": (_tail_only_under_kslot, {}, "support"),
    "topk read when every r < 1": (_topk_only_when_every_ratio_below_one, {}, "divergence"),
    "two arguments": (_two_arguments, {}, "signature"),
    "five arguments": (_five_arguments, {"level": "sequence"}, "signature"),
    "wrong estimator": (_topk_pdm, {**PDM, "estimator": "agg"}, "estimator"),
    "sequence rule declared token": (_sequence, {"level": "token"}, "level"),
    "sequence rule, level left out": (_sequence, {}, "level"),
    "token rule declared sequence": (_ratio_with_delta, {"uses_delta": True, "level": "sequence"}, "level"),
    # the other fields
    "needs the model, declared not": (_reads_coupled, {**PDM, "estimator": None}, "needs"),
    "needs the unembedding, declared not": (_reads_kernel, PDM, "needs"),
    "needs the unembedding, declared the model": (_reads_kernel, {**PDM, "needs": ("coupled",)}, "needs"),
    "binary divergence, declared not read": (_binary_tv, {"divergence": "binary_tv", "uses_delta": True,
                                                          "binary_stats": False}, "binary_stats"),
    "wrong divergence": (_topk_tv, {**PDM, "estimator": None, "divergence": "topk_kl"}, "divergence"),
    "drops change with K, declared not": (_topk_pdm, {**PDM, "uses_k": False}, "uses_k"),
    "K declared, drops never move": (_tail_guard_only, {"support": "topk", "uses_k": True}, "uses_k"),
    "K declared on one slot": (_ratio_with_delta, {"uses_delta": True, "uses_k": True}, "uses_k"),
    "full distributions, declared not": (_full_kl, {"uses_delta": True}, "needs"),
    "unknown estimator": (_topk_pdm, {**PDM, "estimator": "nope"}, "estimator"),
    "like an unknown rule": (_topk_pdm, {"like": "pdm_nope"}, "like"),
    # functions no record describes
    "type error inside": (_type_error_inside, {"uses_delta": True}, "probe"),
    "keep floats returned": (_keep_floats, {}, "returns"),
}


@pytest.mark.parametrize("lie", sorted(PLANTED))
def test_a_planted_misdeclared_rule_is_refused_naming_the_field(registry, lie):
    fn, declared, field = PLANTED[lie]
    with pytest.raises(RuleRecordError) as caught:
        register_mask("test_planted", **declared)(fn)
    message = str(caught.value)
    assert message.startswith(f"rule 'test_planted': {field}:"), message
    assert "\n" not in message and not isinstance(caught.value, TypeError)
    assert is_input_error(caught.value) and exit_code(caught.value) == 2  # one line, exit 2 on the CLI
    assert "test_planted" not in MASK_RULES


@pytest.mark.parametrize("fn, declared", [
    (_topk_pdm, PDM),
    (_ratio_with_delta, {"uses_delta": True}),
    (_delta_only_when_all_negative, {"uses_delta": True}),
    (_tail_only_under_kslot, {"support": "topk", "uses_k": True}),
    (_sequence, {"level": "sequence"}),
    (_reads_coupled, {**PDM, "estimator": None, "needs": ("coupled",)}),
    (_reads_kernel, {**PDM, "needs": ("kernel",)}),
    (_binary_tv, {"divergence": "binary_tv", "uses_delta": True}),
    (_tail_guard_only, {"support": "topk"}),
    (_full_kl, {"uses_delta": True, "needs": ("full",)}),
])
def test_the_same_functions_declared_truly_register_with_that_record(registry, fn, declared):
    register_mask("test_true", **declared)(fn)
    record = MASK_RULES["test_true"].record()
    assert {key: record[key] for key in declared} == {k: tuple(v) if k == "needs" else v for k, v in declared.items()}


def test_one_check_case_misses_the_branch_the_check_set_takes():
    """The untaken-branch rule on a single probe (mixed Â, δ = 0.05) reads no δ: a record derived
    from one call would lie; over the set, the all-negative-Â probe reads it."""
    stats = rule_check.check_stats()[3, "union", "mixed"]
    stats_reads, cfg_reads = set(), set()
    cfg = rule_check._CheckConfig(rule_check.CHECK_CONFIG, cfg_reads)
    _delta_only_when_all_negative(rule_check.RuleCheckStats(stats, stats_reads),
                                  torch.tensor(rule_check.ADVANTAGES["mixed"], dtype=torch.float64), cfg)
    assert "delta" not in cfg_reads
    assert "delta" in rule_check.observe("branchy", _delta_only_when_all_negative, "token").cfg_reads


def _alternative(field, value):
    """Another valid value of a record field: the one-field lie about a true record."""
    others = {"divergence": (None, *DIVERGENCES), "estimator": (None, "topk", "agg"), "support": ("topk", "slot"),
              "uses_delta": (False, True), "uses_k": (False, True), "level": ("token", "sequence"),
              "needs": ((), ("full",)), "binary_stats": (False, True)}[field]
    return next(v for v in others if v != value)


@pytest.mark.parametrize("field", FIELDS)
def test_every_one_field_lie_about_a_builtin_record_is_refused(registry, field):
    """One built-in per distinct record (the others share it); each registered truly at import."""
    by_record = {tuple(rule.record().values()): rule for rule in MASK_RULES.values()}
    for rule in by_record.values():
        lie = {**rule.record(), field: _alternative(field, getattr(rule, field))}
        with pytest.raises(RuleRecordError, match=rf"^rule 'test_lie': {field}:"):
            register_mask("test_lie", **lie)(rule.drop)


def test_every_builtin_name_is_literal_where_it_is_registered():
    sources = {path: path.read_text(encoding="utf-8") for path in
               (ROOT / "pdm_lab" / "masks.py", ROOT / "pdm_lab" / "framework_rules.py")}
    for name in MASK_RULES:
        hits = [p for p, text in sources.items() if re.search(rf'@_register_builtin\(\s*"{re.escape(name)}"', text)]
        assert len(hits) == 1, name
    for text in sources.values():
        assert "register_mask(f" not in text and not re.search(r"^\s+register_mask\(", text, re.M)


def test_the_check_set_covers_what_its_docstring_says():
    stats = rule_check.check_stats()
    wide = rule_check.support_from_full(
        torch.log_softmax(torch.tensor([row for row, _ in rule_check._MU], dtype=torch.float64), dim=1),
        torch.tensor([k for _, k in rule_check._MU]), k=3, convention="union")
    assert bool(torch.isneginf(wide.mu_logp).any())                              # cut tokens in the top-K
    assert bool((stats[1, "union", "mixed"].topk_kl != stats[1, "kslot", "mixed"].topk_kl).any())
    assert bool((stats[1, "union", "r>1"].log_ratio > 0).all())                 # each sign of r − 1
    assert bool((stats[1, "union", "r<1"].log_ratio < 0).all())
    assert bool((stats[1, "union", "mixed"].log_ratio == 0).any())
    d = torch.stack([s.topk_kl for s in stats.values()])
    deltas = [c["delta"] for c in rule_check.CONFIGS]
    assert bool((d > min(deltas)).any()) and not bool((d > max(deltas)).any())  # outside and inside
    signs = {tuple(torch.sign(torch.tensor(a)).unique().tolist()) for a in rule_check.ADVANTAGES.values()}
    assert {(1.0,), (-1.0,), (0.0,), (-1.0, 0.0, 1.0)} <= signs


@pytest.mark.parametrize("name", sorted(MASK_RULES))
def test_every_builtin_rule_passes_the_registration_check(name):
    """Built-in rules register unchecked (no process pays the check at import); the suite runs the
    same check on each, so a built-in whose record lies fails here by name."""
    from pdm_lab.masks import check_registered

    check_registered(MASK_RULES[name])


def test_a_builtin_whose_record_lies_fails_the_suites_check():
    import dataclasses

    from pdm_lab.masks import check_registered
    from pdm_lab.rule_check import RuleRecordError

    lying = dataclasses.replace(MASK_RULES["pdm_topk"], uses_delta=False, said=MASK_RULES["pdm_topk"].said | {"uses_delta"})
    with pytest.raises(RuleRecordError, match="uses_delta"):
        check_registered(lying)


def test_importing_the_library_runs_no_registration_check():
    import subprocess
    import sys

    code = ("import pdm_lab.rule_check as c; calls = []; real = c.observe\n"
            "c.observe = lambda *a, **k: calls.append(a[0]) or real(*a, **k)\n"
            "import pdm_lab.masks as m; import pdm_lab.framework_rules\n"
            "assert len(m.MASK_RULES) > 20 and not calls, calls\n")
    subprocess.run([sys.executable, "-c", code], check=True)
