"""``pdm-lab mechanism``'s rule pairs (envs/transfer/mechanism.py): whichever rules a run audited
(``pdm_kernel`` included), each other rule against the reference: the paired difference of sign
agreement on the probed disagreement tokens, the Newcombe difference of unsafe-keep at each step
size, and the kernel-aware test's fitted b/a over the audited steps."""
from __future__ import annotations

import statistics

import pytest
import torch

from pdm_lab.audit.intervals import paired_rate_diff_ci, rate_diff_ci
from pdm_lab.audit.probe import summarize_probe
from pdm_lab.audit.probe_record import step_scale_record

from pdm_lab.envs.transfer.mechanism import mechanism_doc, mechanism_markdown

A, B, C = "pdm_topk", "pdm_kernel", "dppo_topk_kl"


def _line(rules, grows, outward, disagreement, fit, keep, dd) -> dict:
    """One audited step: a probe over the given tokens (``outward`` rule → predicted sign bits,
    ``grows`` the own update's), one step size with the given keep masks and ΔD."""
    n = len(grows)
    data = {"disagreement": disagreement, "grows": {"topk_kl": grows}, "grows_precond": {},
            "outward": outward, "kernel_outward": {}, "cos_kv_v": [0.1] * n, "head_share": None,
            "kernel_fit": {"a": [fit[0]], "b": [fit[1]], "n": [3], "sample": "probed non-disagreement tokens"}}
    d = torch.full((n,), 1e-3, dtype=torch.float64)
    scale = step_scale_record(rules, {r: torch.tensor(keep[r]) for r in rules},
                              {r: torch.tensor(dd[r], dtype=torch.float64) for r in rules}, None, d,
                              torch.ones(n, dtype=torch.bool), 1e-12, 1.0)
    return {"rules": list(rules), "delta": 5e-4, "k": 20, "outside": n, "probe": summarize_probe(data),
            "step_scales": {"1": scale}}


def test_pdm_kernel_against_pdm_topk_paired_and_newcombe_from_the_pooled_steps():
    # step 1: 4 disagreement tokens (B right on 3, A on 1) and 2 agreeing ones (both right: no
    # effect on the paired difference, which counts the disagreement tokens only)
    l1 = _line([A, B], grows=[1, 1, 0, 0, 1, 0], outward={A: [0, 0, 1, 0, 1, 0], B: [1, 1, 0, 1, 1, 0]},
               disagreement=[1, 1, 1, 1, 0, 0], fit=(2.0, 6.0),
               keep={A: [1, 1, 0, 1, 0, 1], B: [0, 0, 1, 0, 0, 1]}, dd={A: [1, -1, 0, 1, 0, 0], B: [0, 0, 1, 0, 0, 0]})
    # step 2: 3 disagreement tokens, B right on 2, A on 1
    l2 = _line([A, B], grows=[1, 0, 1], outward={A: [0, 1, 1], B: [1, 0, 0]}, disagreement=[1, 1, 1],
               fit=(1.0, -2.0), keep={A: [1, 0, 0], B: [0, 1, 1]}, dd={A: [1, 0, 0], B: [0, -1, 1]})
    doc = mechanism_doc([l1, l2], ["seed1", "seed2"])
    assert set(doc["pairs"]) == {f"{A}|{B}"}
    pair = doc["pairs"][f"{A}|{B}"]
    b_right = [1, 1, 1, 0, 1, 1, 0]  # B's sign right on the 7 disagreement tokens, in pooled order
    a_right = [0, 0, 0, 1, 0, 0, 1]
    assert pair["sign_agreement_diff"] == pytest.approx(paired_rate_diff_ci(torch.tensor(b_right).bool(),
                                                                            torch.tensor(a_right).bool()))
    assert pair["sign_agreement_diff"]["diff"] == pytest.approx(3 / 7)
    # unsafe-keep on each rule's kept disagreement tokens: A kept 3+1, grew 2+1; B kept 1+2, grew 1+1
    sa, sb = doc["step_scales"]["1"][A], doc["step_scales"]["1"][B]
    assert (sa["grew"], sa["n"], sb["grew"], sb["n"]) == (3, 4, 2, 3)
    assert pair["unsafe_keep_diff"]["1"] == rate_diff_ci(2, 3, 3, 4)
    ba = doc["kernel_b_over_a"]
    assert ba["n"] == 2 and ba["values"] == [-2.0, 3.0] and ba["median"] == pytest.approx(statistics.median([3.0, -2.0]))
    md = mechanism_markdown(doc)
    assert f"`{B}` − `{A}` on disagreement tokens: 42.9%" in md
    assert f"`{B}` − `{A}` (Newcombe 95%): ×1 -8.3%" in md
    assert "fitted b/a over 2 probes" in md


def test_three_rules_pair_each_with_the_reference():
    kw = dict(grows=[1, 0], disagreement=[1, 1], fit=(1.0, 3.0), dd={A: [1, 1], B: [1, 1], C: [1, 1]})
    line = _line([A, B, C], outward={A: [0, 1], B: [1, 0], C: [1, 1]},
                 keep={A: [1, 0], B: [0, 1], C: [0, 0]}, **kw)
    doc = mechanism_doc([line], ["s"])
    assert set(doc["pairs"]) == {f"{A}|{B}", f"{A}|{C}"}
    assert doc["pairs"][f"{A}|{B}"]["sign_agreement_diff"]["diff"] == pytest.approx(1.0)
    assert doc["pairs"][f"{A}|{C}"]["sign_agreement_diff"]["diff"] == pytest.approx(0.5)


def _selection_line(seed, keep, dd, memory) -> dict:
    n = len(memory)
    rules = list(keep)
    scale = step_scale_record(rules, {r: torch.tensor(keep[r]) for r in rules},
                              {r: torch.tensor(dd[r], dtype=torch.float64) for r in rules},
                              torch.tensor(memory, dtype=torch.float64), torch.full((n,), 0.2, dtype=torch.float64),
                              torch.ones(n, dtype=torch.bool), 1e-12, 1.0)
    return {"rules": rules, "delta": 0.15, "k": 20, "outside": n, "seed": seed, "step_scales": {"1": scale}}


def test_selection_controls_score_each_rules_kept_tokens_under_the_common_steps():
    # 4 disagreement tokens: C (the reference) keeps 0 and 1, A keeps 2 and 3. Under its own step each
    # rule's kept tokens grow (unsafe-keep 1 vs 1/2); under C's step (the common batch gradient) A's
    # kept tokens grow on 0 of 2 and under the momentum-only step on 1 of 2.
    line = _selection_line(0, keep={C: [1, 1, 0, 0], A: [0, 0, 1, 1]},
                           dd={C: [1, 1, -1, -1], A: [-1, -1, 1, -1]}, memory=[1, -1, 1, -1])
    doc = mechanism_doc([line, _selection_line(1, keep={C: [1, 0], A: [0, 1]}, dd={C: [-1, 1], A: [1, 1]},
                                               memory=[-1, -1])], ["s0", "s1"])
    sel = doc["step_scales"]["1"]["selection"]
    assert (sel[A]["reference_step"]["grew"], sel[A]["reference_step"]["n"]) == (1, 3)  # C's ΔD on A's kept: 2, 3 | 1
    assert (sel[A]["momentum_only"]["grew"], sel[A]["momentum_only"]["n"]) == (1, 3)
    assert (sel[C]["reference_step"]["grew"], sel[C]["reference_step"]["n"]) == (2, 3)  # = C's unsafe-keep
    assert sel[C]["reference_step"]["grew"] == doc["step_scales"]["1"][C]["grew"]
    # the planted bug: scoring A's kept tokens under A's own step is its unsafe-keep, not a control
    assert doc["step_scales"]["1"][A]["grew"] == 2 != sel[A]["reference_step"]["grew"]
    per_seed = {row["seed"]: row for row in doc["per_seed"]}
    assert per_seed[0][A]["grew"] == 1 and per_seed[0][A]["n"] == 2 and per_seed[1][A]["grew"] == 1
    share = doc["disagreement_share"]
    assert (share["disagreement"], share["outside"]) == (6, 6) and share["share"] == 1.0
    md = mechanism_markdown(doc)
    assert "selection controls" in md and "## Per seed at the run's step (2 seeds)" in md
    assert "decide differently on 6 of 6 outside tokens" in md


def test_outside_decisions_count_every_token_once_by_advantage_sign():
    """The per-token rows say how the rules decided each outside token: kept by both, dropped by
    both, or decided differently, split by the sign of Â (two ranks' rows pooled)."""
    line = _selection_line(0, keep={C: [1, 1, 0, 0], A: [0, 0, 1, 1]}, dd={C: [1, 1, -1, -1], A: [-1, -1, 1, -1]},
                           memory=[1, -1, 1, -1])
    line["outside_tokens"] = [
        {"advantage": [1.0, -1.0, 2.0], "keep": {C: [True, False, True], A: [True, False, False]}},
        {"advantage": [-0.5, 0.5], "keep": {C: [True, False], A: [False, False]}}]
    dec = mechanism_doc([line], ["s0"])["decisions"]
    assert dec["tokens"] == 5
    assert dec["positive"] == {"kept_by_all": 1, "dropped_by_all": 1, "differ": 1}
    assert dec["negative"] == {"kept_by_all": 0, "dropped_by_all": 1, "differ": 1}
    md = mechanism_markdown(mechanism_doc([line], ["s0"]))
    assert "| Â > 0 (3) | 1 (33.3%) | 1 (33.3%) | 1 (33.3%) |" in md
    # records without per-token rows (written before they existed) give no table, not zeros
    del line["outside_tokens"]
    assert mechanism_doc([line], ["s0"])["decisions"] is None
