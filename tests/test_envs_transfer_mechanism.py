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
