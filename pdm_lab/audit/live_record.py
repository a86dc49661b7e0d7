"""The live audit's record (SPEC §6c): one batch's counts per rule pair (``step_record``), their
merge over ranks and steps, the flat metric keys a trainer logs, and JSON-safe output. Shared by
the scaling loop, TRL and the readers of ``audit.jsonl``; ``live.run_live_audit`` builds it."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from pdm_lab.audit.measure import delta_rates

#: the count fields of a ``delta_rates`` entry (merged by summing)
COUNT_KEYS = ("count", "grew", "shrank", "flat_count")


def pairs_of(rules: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """(A, R) for every rule R after the reference A = rules[0] (the toy audit's pairs)."""
    return [(rules[0], r) for r in rules[1:] if r != rules[0]]


@torch.no_grad()
def step_record(rules, keep: dict[str, Tensor], delta_d: dict[str, dict[str, Tensor | None]],
                outside: Tensor, tol: float) -> dict:
    """The audit's counts on one batch.

    Args:
        rules: the compared rules, reference first.
        keep: rule → [N] bool, the keep mask its step applied.
        delta_d: rule → divergence name → [N] ΔD (float64; only outside rows are read), or None
            where that divergence was not measured.
        outside: [N] bool, D > δ ∧ Â ≠ 0 (the tokens the pairs score).
        tol: |ΔD| ≤ tol is flat.

    Returns:
        ``{"outside", "pairs": {"A|B": {"disagreement", A: {div: rates}, B: …}},
        "dropped_outside": {rule: {div: rates}}}`` with ``delta_rates`` entries (None: not measured).
    """
    outside = outside.bool()
    record = {"outside": int(outside.sum()), "pairs": {}, "dropped_outside": {}}

    def rates(rule: str, considered: Tensor) -> dict:
        out = {}
        for name, d in delta_d[rule].items():
            out[name] = None if d is None else delta_rates(torch.where(considered, d, torch.zeros_like(d)),
                                                           considered, tol)
        return out

    for a, b in pairs_of(rules):
        disagree = outside & (keep[a].bool() != keep[b].bool())
        entry = {"disagreement": int(disagree.sum())}
        for rule in (a, b):
            entry[rule] = rates(rule, disagree & keep[rule].bool())
        record["pairs"][f"{a}|{b}"] = entry
    for rule in dict.fromkeys(rules):
        record["dropped_outside"][rule] = rates(rule, outside & ~keep[rule].bool())
    return record


def _rates_from_counts(count: int, grew: int, shrank: int, flat: int) -> dict:
    nan = float("nan")
    return {"unsafe_keep": grew / count if count else nan, "shrink": shrank / count if count else nan,
            "flat": flat / count if count else nan, "count": count, "grew": grew, "shrank": shrank,
            "flat_count": flat}


def merge_rates(entries: list[dict | None]) -> dict | None:
    """``delta_rates`` entries summed by their counts (None if any is None: not measured)."""
    if any(e is None for e in entries):
        return None
    sums = [sum(int(e[k]) for e in entries) for k in COUNT_KEYS]
    return _rates_from_counts(*sums)


def merge_records(records: list[dict]) -> dict:
    """Several ranks' ``step_record``s of one step → one (counts summed, rates recomputed)."""
    first = records[0]
    out = {"outside": sum(r["outside"] for r in records), "pairs": {}, "dropped_outside": {}}
    for key, pair in first["pairs"].items():
        merged = {"disagreement": sum(r["pairs"][key]["disagreement"] for r in records)}
        for rule in pair:
            if rule == "disagreement":
                continue
            merged[rule] = {name: merge_rates([r["pairs"][key][rule][name] for r in records]) for name in pair[rule]}
        out["pairs"][key] = merged
    for rule, tables in first["dropped_outside"].items():
        out["dropped_outside"][rule] = {name: merge_rates([r["dropped_outside"][rule][name] for r in records])
                                        for name in tables}
    return out


def flat_metrics(record: dict, rules, divergence: str = "topk_kl") -> dict[str, float]:
    """Per-rule rates of a (merged) record as ``audit/...`` metric floats for a trainer's log."""
    out = {"audit/outside": float(record["outside"])}
    for (a, b) in pairs_of(rules):
        pair = record["pairs"][f"{a}|{b}"]
        out[f"audit/{a}|{b}/disagreement"] = float(pair["disagreement"])
        for rule in (a, b):
            rates = pair[rule][divergence]
            if rates is None:
                continue
            for key in ("unsafe_keep", "shrink", "flat"):
                out[f"audit/{a}|{b}/{rule}/{key}"] = rates[key]
            out[f"audit/{a}|{b}/{rule}/kept"] = float(rates["count"])
    for rule, tables in record["dropped_outside"].items():
        rates = tables.get(divergence)
        if rates is not None:
            out[f"audit/{rule}/dropped_grew"] = rates["unsafe_keep"]
    return out


def json_safe(obj):
    """NaN/inf → None, recursively (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def distinct_contexts(prompts, responses, response_masks) -> int:
    """Distinct (prompt, response prefix) contexts among the response tokens: the regime table's
    tokens-per-context denominator. Each argument is one list of token ids (or 0/1 flags) per
    sequence; a response ends at its first padding flag."""
    seen = set()
    for prompt, ids, resp in zip(prompts, responses, response_masks):
        h = hash(tuple(prompt))
        for tok, real in zip(ids, resp):
            if not real:
                break
            seen.add(h)
            h = hash((h, tok))
    return len(seen)
