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
  shape (``pdm_lab.audit.measure.delta_rates`` entries per pair and rule, per measured divergence), plus
  how often each rule's *dropped* outside tokens grew anyway (growth that can only come from the
  other tokens' updates through shared weights: interference). ``merge_records`` sums the counts
  of several ranks' records and recomputes the rates.

Rates are NaN where nothing was counted; ``json_safe`` writes them as null.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from pdm_lab.audit.live_record import (COUNT_KEYS, distinct_contexts, flat_metrics, json_safe,  # noqa: F401
                                       merge_rates, merge_records, pairs_of, step_record)
from pdm_lab.config import ConfigError, at_least, config_dataclass, non_negative, one_of
from pdm_lab.audit.snapshot import HostSnapshot, restore_optimizer, restore_params  # noqa: F401  (the audit's snapshot)
from pdm_lab.masks import MASK_RULES
from pdm_lab.audit.probe import support_in_float64  # noqa: F401  (re-exported: the stages' measurement support)

MINI_BATCH_CHOICES = ("first", "last", "all")
"""``LiveAuditConfig.mini_batch``'s named values (else an integer index)."""


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
    probe_tokens: Annotated[int, at_least(0)] = 32
    """The own-update probe and the step decomposition (SPEC §6d) on at most this many outside
    tokens per audited step, over all ranks, every disagreement token first (0: off). Each probed
    token costs about four passes of the model per kernel (K, J P Jᵀ, and one per rule)."""
    step_scales: tuple[float, ...] = (1.0, 0.1, 0.01)
    """Audit each rule's step at these multiples of the run's learning rate (1 is always run):
    unsafe-keep per rule against median |ΔD|/D, beside the kept-by-all and momentum-only controls."""
    mini_batch: Any = "last"  # int | str: checked in __post_init__ (the config's union check is numeric-only)
    """Where in the step the audit is taken (SPEC §6c), for a trainer that splits each rollout batch
    into M optimiser steps (the scaling loop's ``trainer.mini_batches``): ``first`` (j = 0, a fresh
    policy: the numerics alone), ``last`` (j = M − 1), ``all`` (every j, one record each), or an
    integer j < M. The state audited is the run's at the moment its mask acts on mini-batch j —
    after this batch's first j real optimiser steps, with their AdamW state — and the rules' steps
    are steps on mini-batch j; the record carries ``mini_batch``. Default ``last``: the most stale
    mini-batch, where D holds the numerics plus M − 1 steps of staleness, most tokens lie outside δ
    and so the mask acts most — the regime the paper's split (M = 8) trains in; ``first`` audits
    only the numerics, which SPEC §6b says is not the paper's regime. A trainer with one optimiser
    step per batch (the TRL trainer) audits that step whatever this says."""

    def __post_init__(self) -> None:
        if len(self.rules) < 2:
            raise ConfigError(f"audit.rules: compare at least two rules, got {list(self.rules)}")
        for i, rule in enumerate(self.rules):
            one_of(f"audit.rules[{i}]", rule, MASK_RULES)
            # a rule that needs ``kernel`` (pdm_kernel) is the stage's to supply: the loop's loss
            # path computes c_t (scaling/train_step.py); the TRL trainer refuses it
        choice = self.mini_batch
        if isinstance(choice, bool) or not (choice in MINI_BATCH_CHOICES or (isinstance(choice, int) and choice >= 0)):
            raise ConfigError(f"audit.mini_batch: first, last, all or a mini-batch index ≥ 0, got {choice!r}")
        for i, scale in enumerate(self.step_scales):
            if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
                raise ConfigError(f"audit.step_scales[{i}]: a positive multiple of the learning rate, got {scale!r}")

    def mini_batches(self, m: int) -> tuple[int, ...]:
        """The audited mini-batch indices of a step split into ``m`` optimiser steps."""
        choice = self.mini_batch
        if choice == "all":
            return tuple(range(m))
        j = {"first": 0, "last": m - 1}.get(choice, choice)
        if not 0 <= j < m:
            raise ConfigError(f"audit.mini_batch: {j} is not one of the step's {m} mini-batches (0 … {m - 1})")
        return (j,)

    @property
    def scales(self) -> tuple[float, ...]:
        """The audited multiples of the learning rate, the run's own (1) first."""
        return (1.0, *dict.fromkeys(float(s) for s in self.step_scales if float(s) != 1.0))


def gather_objects(obj) -> list:
    """``obj`` from every rank of the default process group (a one-item list outside one)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@dataclass
class StepOutcome:
    """What a stage's audited step reports, per audited token [n] (this rank's)."""

    keep: Tensor
    """the rule's keep mask (bool)."""
    topk_kl: Tensor
    """D at θ₀ as the loss computed it (the rules' own statistics)."""
    mu_tail: Tensor
    advantages: Tensor
    ratio: Tensor
    weights: Tensor | None = None
    """w_t (``probe_record.token_weights``), for the decomposition's own term."""
    clip_factor: float = 1.0
    """κ = min(1, max_norm/‖G‖) of the step's gradient clip."""


@dataclass
class ProbeView:
    """The probed rows as the probe needs them: μ's support (float64), π's processed logits [M, V]
    float64 at θ₀ and a ``LogitKernel`` over those rows (with ``directional``)."""

    support: Any
    logits: Tensor
    kernel: Any


class LiveAuditStage(Protocol):
    """What a trainer supplies to ``run_live_audit`` (the loop's and TRL's adapters)."""

    params: list[Tensor]
    optimizer: torch.optim.Optimizer

    def step(self, rule: str, optimizer, *, lr_scale: float, zero_advantages: bool) -> StepOutcome:
        """One optimiser step over the audited batch with ``rule``'s mask (δ the audit's), at
        ``lr_scale`` × the run's learning rate, every Â = 0 when ``zero_advantages``; steps with
        ``optimizer`` (the stage's own, or a recorder wrapping it)."""
        ...

    def measure(self) -> Tensor:
        """[n] D of the audited tokens at the current θ, in float64 (collective). A stage may also
        set ``mu_tail`` ([n] μ_T of those tokens) and ``advantages`` ([n] Â): an idle batch's
        record then states μ's top-K mass and the Â ≠ 0 count in its regime."""
        ...

    def probe_view(self, rows: Tensor, preconditioner) -> ProbeView:
        """The probed rows (this rank's ``rows`` into its n tokens; collective, possibly none)."""
        ...


@dataclass(frozen=True)
class LossDivergence:
    """D at θ₀ of a stage's audited tokens as the trainer's own loss computed them (its forward of
    each row before the step, float32): what the idle check reads in place of a forward of its own.

    Attributes:
        topk_kl: [n] the loss's D(μ‖π) per audited token, in the stage's token order.
        mu_tail: [n] μ_T of those tokens (the idle record's top-K mass).
    """

    topk_kl: Tensor
    mu_tail: Tensor


def run_live_audit(stage: LiveAuditStage, *, rules, cfg: LiveAuditConfig, mask_cfg, delta: float, contexts: int,
                   seed: int = 0, at_start: LossDivergence | None = None) -> dict:
    """SPEC §6c's audit of one live batch, once for every trainer: snapshot; D before; per step size
    and rule one step from the same θ and optimiser state, D after, restore; the momentum-only
    step (Â = 0) likewise; the outside set from the reference rule's stats; the own-update probe
    and the step decomposition (SPEC §6d) on up to ``cfg.probe_tokens`` outside tokens; every
    rank's record merged. Collective: every rank calls it at the same step.

    A batch with no token near δ (largest D at θ₀ ≤ ``IDLE_MARGIN``·δ on every rank) takes no snapshot
    and no step: its record has the same keys, zero counts, ``idle`` true (``_idle_record``). With
    ``at_start`` (every rank or none: the trainer's own loss already measured D at θ₀) the check
    reads it and costs no forward; a batch it finds busy is measured again in float64 by the stage.

    Returns the record: ``step_record``'s keys at the run's step, ``tokens``, ``zero_advantage``,
    ``regime``, ``step_scales`` (scale → ``step_scale_record``), ``probe`` (``own_update_probe``'s
    keys), ``decomposition`` (rule → ``step_decomposition``'s keys), ``host_snapshot_bytes``,
    ``state_fingerprint`` (every rank's ``state_fingerprint`` of the snapshotted parameters, in rank
    order: a check that the audit saw the state it claims), ``time/probe_s``, ``outside_tokens``
    (per rank, ``outside_token_rows``: the outside tokens with ids, keeps and ΔD per rule). The snapshot
    (parameters, gradients, optimiser state, RNG) is restored when the audit ends, also when a step
    raises (a non-finite update) before the error propagates.
    """

    rules = tuple(dict.fromkeys(rules))
    probing = cfg.probe_tokens > 0
    fingerprint = gather_objects(state_fingerprint(stage.params))
    if at_start is not None:  # the loss's own D at θ₀: "outside" is decided on exactly these values
        peak = _peak(at_start.topk_kl)
        if peak <= IDLE_MARGIN * delta:
            return _idle_record(rules, at_start.topk_kl.double(), getattr(stage, "advantages", None),
                                at_start.mu_tail, delta, cfg, contexts, fingerprint, peak, source="loss")
    before = stage.measure()  # D at θ₀ (float64, collective): read only, so before the snapshot
    peak = _peak(before)
    if peak <= IDLE_MARGIN * delta:  # no token can be outside: nothing to audit, no snapshot, no step
        return _idle_record(rules, before, getattr(stage, "advantages", None), getattr(stage, "mu_tail", None),
                            delta, cfg, contexts, fingerprint, peak, source="forward")
    snapshot = HostSnapshot.take(stage.params, stage.optimizer)
    try:
        return _audit_from_snapshot(stage, snapshot, rules, cfg, mask_cfg, delta, contexts, seed, probing,
                                    fingerprint, before)
    finally:  # also after a step that raised; and the probe's backward passes wrote the gradients a
        # trainer may have accumulated before the audit (TRL's pending audit): all back as they were
        snapshot.restore(stage.params, stage.optimizer)


def _peak(d: Tensor) -> float:
    """The largest D over every rank's tokens (collective; 0 where there are none)."""
    return max(float(x.max()) if x.numel() else 0.0 for x in gather_objects(d.detach().cpu()))


#: A batch whose largest D at θ₀ is at most this fraction of δ has no outside token (the loss-time
#: D that decides "outside" differs from a float64 forward's, or from another micro-batching of the
#: same loss, by float32 rounding, far below 1%), so the audit records it without a snapshot or a
#: step: an audit left on costs one forward when idle, none where the trainer hands over its loss's D.
IDLE_MARGIN = 0.99


def _idle_record(rules, before: Tensor, advantages: Tensor | None, mu_tail: Tensor | None, delta: float,
                 cfg: "LiveAuditConfig", contexts: int, fingerprint, peak: float, source: str) -> dict:
    """The record of a batch with no outside token: the same keys as an audited one, every count 0
    and every rate null (nothing counted), ``idle`` true, the regime from D at θ₀, ``idle_check``
    where that D came from (``forward``: the stage's float64 forward; ``loss``: the trainer's own
    loss, float32)."""
    from pdm_lab.audit.measure import regime_table
    from pdm_lab.audit.probe_record import step_scale_record

    n = int(before.numel())
    none = torch.zeros(n, dtype=torch.bool)
    zeros = torch.zeros(n, dtype=torch.float64)
    keep = {r: torch.ones(n, dtype=torch.bool) for r in rules}
    record = step_record(rules, keep, {r: {"topk_kl": zeros, "full_kl": None} for r in rules}, none, cfg.tolerance)
    considered = torch.ones(n, dtype=torch.bool) if advantages is None else advantages.detach().cpu().reshape(-1) != 0
    tail = None if mu_tail is None else mu_tail.detach().double().cpu().reshape(-1)
    gathered = gather_objects((n, before.detach().double().cpu(), considered, tail))
    d_all = torch.cat([g[1] for g in gathered])
    tokens = sum(g[0] for g in gathered)
    record.update(tokens=tokens, zero_advantage=sum(int((~g[2]).sum()) for g in gathered), idle=True, peak_d=peak,
                  idle_check=source, outside_tokens=[])
    if d_all.numel():
        all_none = torch.zeros(d_all.numel(), dtype=torch.bool)
        tails = [g[3] for g in gathered]
        mass = None if any(t is None for t in tails) else 1.0 - torch.cat(tails)
        record["regime"] = regime_table(d_all, all_none, torch.cat([g[2] for g in gathered]), topk_mass=mass,
                                        tokens_per_state=tokens / max(contexts, 1))
    record["step_scales"] = {f"{s:g}": step_scale_record(rules, {r: torch.ones_like(all_none) for r in rules},
                                                         {r: torch.zeros_like(d_all) for r in rules}, None, d_all,
                                                         all_none, cfg.tolerance, s)
                             for s in cfg.scales} if d_all.numel() else {}
    record["probe"] = None
    if cfg.probe_tokens > 0:
        record["decomposition"] = {rule: None for rule in rules}
    record.update({"rules": list(rules), "delta": delta, "tolerance": cfg.tolerance, "ranks": len(gathered),
                   "host_snapshot_bytes": 0, "state_fingerprint": list(fingerprint), "time/probe_s": 0.0})
    return record


def outside_token_rows(stage, rules, outside: Tensor, d: Tensor, adv: Tensor, keep: dict, dd: dict,
                       memory: Tensor | None) -> dict:
    """This rank's outside tokens, one entry per token in each list (SPEC §6d's per-token records):
    ``index`` (into the audited tokens), ``token_id`` (the stage's ``token_ids``; null where it has
    none), ``seq``/``col`` (the stage's ``token_seq``/``token_col`` where it has them), D at θ₀,
    Â, and per rule its keep and ΔD at the run's step, and ΔD of the momentum-only step — what
    ``mechanism``'s selection controls re-score, token by token."""
    idx = outside.nonzero(as_tuple=True)[0]

    def pick(name):
        t = getattr(stage, name, None)
        return None if t is None else [int(x) for x in t.reshape(-1)[idx].tolist()]

    return {"index": idx.tolist(), "token_id": pick("token_ids"), "seq": pick("token_seq"), "col": pick("token_col"),
            "d": d.double()[idx].tolist(), "advantage": adv.double()[idx].tolist(),
            "keep": {r: keep[r][idx].bool().tolist() for r in rules},
            "dd": {r: dd[r].double()[idx].tolist() for r in rules},
            "momentum_dd": None if memory is None else memory.double().cpu()[idx].tolist()}


def state_fingerprint(params) -> str:
    """A SHA-256 of this rank's parameters (local shards, their bytes in order): which state an
    audit snapshotted. ``run_live_audit`` records every rank's as ``state_fingerprint``."""
    import hashlib

    h = hashlib.sha256()
    for p in params:
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(str((tuple(t.shape), t.dtype)).encode())
        h.update(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _audit_from_snapshot(stage, snapshot, rules, cfg, mask_cfg, delta, contexts, seed, probing, fingerprint,
                         before: Tensor) -> dict:
    import dataclasses as _dc

    from pdm_lab.audit.measure import regime_table
    from pdm_lab.audit.central_difference import _world, adam_preconditioner
    from pdm_lab.masks import outside_region
    from pdm_lab.audit.probe import pool_decomposition, pool_probe, probe_rows, probe_with_kernel
    from pdm_lab.audit.probe_record import GradientRecorder, decompose_live, step_scale_record

    keep, first, recorders, dd, memory = {}, None, {}, {}, {}
    for scale in cfg.scales:
        dd[scale] = {}
        for rule in (*rules, None):  # None: the momentum-only step (every Â = 0)
            opt = GradientRecorder(stage.optimizer, stage.params) if probing and scale == 1.0 and rule else stage.optimizer
            out = stage.step(rule or rules[0], opt, lr_scale=scale, zero_advantages=rule is None)
            after = stage.measure()
            snapshot.restore(stage.params, stage.optimizer)
            if rule is None:
                memory[scale] = after - before
                continue
            dd[scale][rule] = after - before
            if scale == 1.0:
                keep[rule], first = out.keep.bool(), first or out
                if opt is not stage.optimizer:
                    recorders[rule] = opt
    adv = first.advantages
    considered = adv != 0
    outside = outside_region(first.topk_kl, adv, _dc.replace(mask_cfg, delta=delta, delta_neg=None)) & considered
    local = step_record(rules, keep, {r: {"topk_kl": dd[1.0][r], "full_kl": None} for r in rules}, outside,
                        cfg.tolerance)
    local.update(tokens=int(adv.numel()), zero_advantage=int((~considered).sum()), contexts=contexts)

    probe = decomp = None
    t_probe = time.perf_counter()
    if probing:
        masks = torch.stack([keep[r] for r in rules])
        disagree = outside & ~(masks.all(0) | ~masks.any(0))
        rows = probe_rows(outside.cpu(), disagree.cpu(), -(-cfg.probe_tokens // _world()), seed=seed)
        pre = adam_preconditioner(stage.optimizer, stage.params)
        view = stage.probe_view(rows.to(adv.device), pre)
        probe = probe_with_kernel(view.kernel, torch.arange(rows.numel()), view.support, view.logits,
                                  adv[rows].cpu(), first.ratio[rows].cpu(), precondition=pre is not None,
                                  rules=rules, cfg=mask_cfg, disagreement=disagree[rows].cpu())
        decomp = {}
        for rule, rec in recorders.items():
            decomp[rule] = decompose_live(
                view.kernel, stage.params, rec, view.support, view.logits, advantages=adv[rows].cpu(),
                ratio=first.ratio[rows].cpu(), weights=first.weights[rows].cpu(), keep=keep[rule][rows].cpu(),
                clip_factor=first.clip_factor, d=before[rows].cpu(), realised=dd[1.0][rule][rows].cpu(),
                memory=memory[1.0][rows].cpu())
    probe_s = time.perf_counter() - t_probe

    local["outside_tokens"] = outside_token_rows(stage, rules, outside.cpu(), before.cpu(), adv.cpu(),
                                                 {r: keep[r].cpu() for r in rules},
                                                 {r: dd[1.0][r].cpu() for r in rules}, memory.get(1.0))
    tokens = {"d": before.cpu(), "outside": outside.cpu(), "considered": considered.cpu(),
              "mu_tail": first.mu_tail.double().cpu(), "d32": first.topk_kl.double().cpu(),
              "keep": {r: keep[r].cpu() for r in rules}, "dd": {s: {r: x.cpu() for r, x in v.items()} for s, v in dd.items()},
              "memory": {s: x.cpu() for s, x in memory.items()}}
    gathered = gather_objects((local, tokens, probe, decomp))
    record = merge_records([g[0] for g in gathered])
    record.update(tokens=sum(g[0]["tokens"] for g in gathered),
                  zero_advantage=sum(g[0]["zero_advantage"] for g in gathered),
                  outside_tokens=[{"rank": i, **g[0]["outside_tokens"]} for i, g in enumerate(gathered)])
    contexts_all = sum(g[0]["contexts"] for g in gathered)
    cat = lambda f: torch.cat([f(g[1]) for g in gathered])  # noqa: E731
    if cat(lambda t: t["d32"]).numel():
        record["regime"] = regime_table(cat(lambda t: t["d32"]), cat(lambda t: t["outside"]),
                                        cat(lambda t: t["considered"]), topk_mass=1.0 - cat(lambda t: t["mu_tail"]),
                                        tokens_per_state=record["tokens"] / max(contexts_all, 1))
    keep_all = {r: cat(lambda t: t["keep"][r]) for r in rules}
    record["step_scales"] = {
        f"{s:g}": step_scale_record(rules, keep_all, {r: cat(lambda t: t["dd"][s][r]) for r in rules},
                                    cat(lambda t: t["memory"][s]), cat(lambda t: t["d"]), cat(lambda t: t["outside"]),
                                    cfg.tolerance, s)
        for s in cfg.scales}
    probes = [g[2] for g in gathered if g[2] and g[2]["probe/tokens"]]
    record["probe"] = pool_probe(probes) if probes else None
    if probing:
        record["decomposition"] = {}
        for rule in rules:
            parts = [g[3][rule] for g in gathered if g[3] and g[3][rule]["decomp/tokens"]]
            record["decomposition"][rule] = pool_decomposition(parts) if parts else None
    record.update({"rules": list(rules), "delta": delta, "tolerance": cfg.tolerance, "ranks": len(gathered),
                   "host_snapshot_bytes": snapshot.nbytes, "state_fingerprint": list(fingerprint),
                   "time/probe_s": probe_s})
    return record
