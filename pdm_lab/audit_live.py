"""The direction audit on a live training batch (SPEC §6c): host snapshot and the per-step record.

A trainer audits its own batch by taking, for each compared rule, one optimiser step from the
same parameters *and optimiser state*, measuring ΔD on the batch's outside tokens, and putting
everything back bit for bit before its real update. Two pieces are framework-free and live here,
once, for the scaling loop and the TRL trainer alike:

* ``HostSnapshot`` — the parameters (each rank's local shard), the optimiser's per-parameter
  state, its param-group settings, any gradients and the torch RNG, copied to host memory, and
  restored in place (a DTensor shard keeps its placement; state the audit's steps created is
  removed again). Host memory: the snapshot's ``nbytes`` (AdamW: parameters + two moments).
* ``step_record`` — from each rule's keep mask and ΔD, the audit's counts in the toy audit's
  shape (``pdm_lab.audit.delta_rates`` entries per pair and rule, per measured divergence), plus
  how often each rule's *dropped* outside tokens grew anyway (growth that can only come from the
  other tokens' updates through shared weights: interference). ``merge_records`` sums the counts
  of several ranks' records and recomputes the rates.

Rates are NaN where nothing was counted; ``json_safe`` writes them as null.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Annotated

import torch
import torch.distributed as dist
from torch import Tensor

from .audit import delta_rates
from .config import ConfigError, at_least, config_dataclass, non_negative, one_of
from .errors import PDMInputError
from .masks import MASK_RULES

COUNT_KEYS = ("count", "grew", "shrank", "flat_count")


@config_dataclass("audit")
class LiveAuditConfig:
    """The ``audit:`` section of a trainer (the scaling loop's config, ``PDMGRPOTrainer(audit=…)``):
    every ``every`` steps, one optimiser step per rule from the same parameters and optimiser
    state, ΔD on the batch's outside tokens, everything restored bit-exactly; one line per
    audited step in ``audit.jsonl``. K is the mask's (the rollout's top-K). Off by default."""

    every: Annotated[int, at_least(0)] = 0
    """Audit every this many steps (0: never). The paper audited 61 batches of 1024 sequences."""
    rules: tuple[str, ...] = ("dppo_topk_kl", "pdm_topk")
    """The compared rules; the first is the reference every other is paired with (paper: the
    ratio test vs PDM)."""
    delta: Annotated[float, non_negative] | None = None
    """δ of the audited rules and of the outside set (None: ``mask.delta``; paper: 0.15)."""
    sequences: Annotated[int, at_least(1)] | None = None
    """Audit the first this many sequences of the step's batch, over all ranks (None: all of it;
    paper: 1024). Each rank audits its share."""
    tolerance: Annotated[float, non_negative] = 1e-9
    """|ΔD| ≤ tolerance counts as flat: D is measured with lm_head and the softmax in float64 on
    the trainer's decoder, which is deterministic, so a step that does not move a token gives
    ΔD = 0 exactly."""

    def __post_init__(self) -> None:
        if len(self.rules) < 2:
            raise ConfigError(f"audit.rules: compare at least two rules, got {list(self.rules)}")
        for i, rule in enumerate(self.rules):
            one_of(f"audit.rules[{i}]", rule, MASK_RULES)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor shard → its local tensor


def _host_copy(t: Tensor) -> Tensor:
    return _local(t).detach().to("cpu", copy=True)


@dataclass
class HostSnapshot:
    """What one optimiser step changes, on the host: take before the audit, restore after it."""

    params: list[Tensor]
    """each parameter's local shard."""
    grads: list[Tensor | None]
    """each parameter's gradient (None where it had none)."""
    state: list[dict | None]
    """the optimiser's state per parameter (None: it had none, e.g. before AdamW's first step)."""
    groups: list[dict] = field(default_factory=list)
    """the param groups' settings (lr, betas, …), without their parameter lists."""
    rng: Tensor | None = None
    """torch's CPU generator state."""

    @classmethod
    @torch.no_grad()
    def take(cls, params: list[Tensor], optimizer: torch.optim.Optimizer) -> "HostSnapshot":
        state = []
        for p in params:
            st = optimizer.state.get(p)
            state.append(None if not st else {k: _host_copy(v) if torch.is_tensor(v) else copy.deepcopy(v)
                                              for k, v in st.items()})
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        return cls(params=[_host_copy(p) for p in params],
                   grads=[None if p.grad is None else _host_copy(p.grad) for p in params],
                   state=state, groups=groups, rng=torch.get_rng_state())

    @property
    def nbytes(self) -> int:
        """Host bytes held (parameters, gradients, optimiser state)."""
        total = sum(t.numel() * t.element_size() for t in self.params)
        total += sum(t.numel() * t.element_size() for t in self.grads if t is not None)
        for st in self.state:
            total += sum(v.numel() * v.element_size() for v in (st or {}).values() if torch.is_tensor(v))
        return total

    def restore(self, params: list[Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Everything back, bit for bit, in place."""
        if len(params) != len(self.params):
            raise PDMInputError(f"params: {len(params)} tensors, the snapshot holds {len(self.params)}")
        restore_params(self, params)
        restore_optimizer(self, params, optimizer)
        if self.rng is not None:
            torch.set_rng_state(self.rng)


@torch.no_grad()
def restore_params(snap: HostSnapshot, params: list[Tensor]) -> None:
    """Parameters and gradients back from the snapshot (in place: shards keep their placement)."""
    for p, saved, grad in zip(params, snap.params, snap.grads):
        _local(p).copy_(saved)
        if grad is None:
            p.grad = None
        elif p.grad is not None:
            _local(p.grad).copy_(grad)
        elif hasattr(p, "to_local"):
            raise PDMInputError("params: a sharded gradient the snapshot holds was freed; cannot rebuild it")
        else:  # freed by a zero_grad(set_to_none=True) of the audited step
            p.grad = grad.to(p.device, copy=True)


@torch.no_grad()
def restore_optimizer(snap: HostSnapshot, params: list[Tensor], optimizer: torch.optim.Optimizer) -> None:
    """The optimiser's state and param-group settings back from the snapshot; state created since
    (the first step of a fresh AdamW) is removed, so the next real step is its first again."""
    for p, saved in zip(params, snap.state):
        if saved is None:
            optimizer.state.pop(p, None)
            continue
        live = optimizer.state[p]
        for key in list(live):
            if key not in saved:
                del live[key]
        for key, value in saved.items():
            current = live.get(key)
            if torch.is_tensor(value) and torch.is_tensor(current) and _local(current).shape == value.shape:
                _local(current).copy_(value)
            elif torch.is_tensor(value):
                raise PDMInputError(f"optimizer state {key!r}: its tensor was replaced; cannot restore in place")
            else:
                live[key] = copy.deepcopy(value)
    for group, saved in zip(optimizer.param_groups, snap.groups):
        group.update(copy.deepcopy(saved))


def support_in_float64(support):
    """μ's support as the rules built it (in the engine's dtype, whose rounding its checks allow),
    with μ cast to float64 for the measurement of D. Casting first and building in float64 would
    re-check a float32 head mass of 1 + 1e-8 against float64 rounding and refuse it."""
    return dataclasses.replace(support, mu_logp=support.mu_logp.double(), mu_tail_logp=support.mu_tail_logp.double(),
                               mu_kth_logp=support.mu_kth_logp.double())


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


def gather_objects(obj) -> list:
    """``obj`` from every rank of the default process group (a one-item list outside one)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
