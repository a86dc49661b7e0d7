"""Per-step metrics of SPEC §5 as mergeable sums: one function merges them across mini-batches,
ranks and seeds, exactly.

Each key carries a declared reduction and a count: ``mean`` keeps Σx and n (the value is Σx/n),
``sum`` keeps Σx, ``max``/``min`` keep the extreme. Merging adds sums and counts and takes
extremes, so a token-weighted mean over a whole batch on all ranks is the same number whatever
the split. A key with count 0 finalises to NaN (logged as null, reported as "n/a"), never 0.0.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import Tensor

from pdm_lab.masks import outside_region
from pdm_lab.rollout_corr import ROLLOUT_CORR_KEYS, rollout_corr_terms
from pdm_lab.fast.rowops import all_true

if TYPE_CHECKING:
    from pdm_lab.tokenwise import TokenStats

REDUCTIONS = ("mean", "sum", "max", "min")


@dataclass(frozen=True)
class Metric:
    """One key's running state: ``value`` is Σx (mean, sum) or the extreme (max, min; ±inf when
    count = 0); ``count`` the observations behind it. Both 0-d tensors (float64)."""

    reduce: str
    value: Tensor
    count: Tensor


#: Metrics as sums: ``{"mask/frac_dropped": Metric("mean", Σ dropped, n), …}``.
MetricSums = dict[str, Metric]

_IDENTITY = {"mean": 0.0, "sum": 0.0, "max": float("-inf"), "min": float("inf")}


def _f64(x: Any) -> Tensor:
    return torch.as_tensor(x, dtype=torch.float64).detach()


def metric(reduce: str, value: Any, count: Any = 1) -> Metric:
    """A Metric from a value and its count (floats or tensors; ``value`` as the reduction wants)."""
    if reduce not in REDUCTIONS:
        raise ValueError(f"metric reduction: unknown {reduce!r}; valid: {', '.join(REDUCTIONS)}")
    return Metric(reduce, _f64(value), _f64(count))


def count_of(where: Tensor) -> Tensor:
    """The number of ``where`` entries, 0-d float64 (pass it on when several keys share `where`)."""
    # an integer count, exact at any N; count_nonzero reads the bytes (a bool sum casts [N] to
    # int64 first: 0.68 against 0.15 ms at N = 10⁶)
    return torch.count_nonzero(where).to(torch.float64)


def _select(x: Tensor, where: Tensor, fill: float) -> Tensor:
    """x where `where`, else `fill`; eagerly x itself when every entry counts (a batch without
    padding: one byte-wise check instead of a pass that writes [N]); compiled, always the select
    (fused, and a branch on data would break the graph)."""
    where = where.bool()
    if torch.compiler.is_compiling():
        return torch.where(where, x, fill)
    return x if bool(all_true(where)) else torch.where(where, x, fill)


def mean_of(x: Tensor, where: Tensor, count: Tensor | None = None) -> Metric:
    """``mean`` of x over the ``where`` entries (Σ and count; no division yet). `count`:
    ``count_of(where)`` when the caller has it."""
    count = count_of(where) if count is None else count
    if x.dtype == torch.bool:  # a fraction: its numerator is the count of x ∧ where (a select of
        # bools against the integer 0 made an int64 copy of [N]: two passes, 3.6 ms at N = 10⁶)
        return Metric("mean", count_of(x & where.bool()), count)
    # select, don't multiply: a padding slot's r may be inf (inf·0 = NaN). Summed in x's dtype
    # (torch's cascade sum: relative error ~1e-7·log N in float32), then float64 for the merges: a
    # float64 copy of each [N] key was most of the metrics' time
    return Metric("mean", _select(x, where, 0).sum().to(torch.float64), count)


def _extreme_of(reduce: str, x: Tensor, where: Tensor, count: Tensor | None) -> Metric:
    filled = _select(x, where, _IDENTITY[reduce])  # an extreme is exact in x's dtype
    if filled.numel() == 0:  # an empty batch: the identity, count 0
        value = _f64(_IDENTITY[reduce]).to(filled.device)
    else:
        value = (filled.max() if reduce == "max" else filled.min()).to(torch.float64)
    return Metric(reduce, value, count_of(where) if count is None else count)


def max_of(x: Tensor, where: Tensor, count: Tensor | None = None) -> Metric:
    """``max`` of x over the ``where`` entries (−inf, count 0 when there are none)."""
    return _extreme_of("max", x, where, count)


def min_of(x: Tensor, where: Tensor, count: Tensor | None = None) -> Metric:
    """``min`` of x over the ``where`` entries (+inf, count 0 when there are none)."""
    return _extreme_of("min", x, where, count)


def merge_metrics(*parts: Mapping[str, Metric]) -> MetricSums:
    """The exact merge of metric sums (mini-batches, steps, ranks, seeds): sums and counts add,
    extremes combine. A key in only some parts keeps what those parts saw."""
    out: MetricSums = {}
    for part in parts:
        for key, m in part.items():
            prev = out.get(key)
            if prev is None:
                out[key] = m
                continue
            if prev.reduce != m.reduce:
                raise ValueError(f"metric {key!r}: reduction {prev.reduce!r} merged with {m.reduce!r}")
            if m.reduce in ("mean", "sum"):
                value = prev.value + m.value
            elif m.reduce == "max":
                value = torch.maximum(prev.value, m.value)
            else:
                value = torch.minimum(prev.value, m.value)
            out[key] = Metric(m.reduce, value, prev.count + m.count)
    return out


def finalize(sums: Mapping[str, Metric]) -> dict[str, Tensor]:
    """0-d float64 tensors: mean = Σx/n, sum = Σx, max/min the extreme; NaN where count = 0."""
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    out = {}
    for key, m in sums.items():
        value = m.value / m.count if m.reduce == "mean" else m.value
        out[key] = torch.where(m.count > 0, value, nan)
    return out


def finalize_floats(sums: Mapping[str, Metric]) -> dict[str, float]:
    """``finalize`` as Python floats, for logs and tables (one host sync for all keys)."""
    done = finalize(sums)
    if not done:
        return {}
    values = torch.stack(list(done.values())).tolist()
    return dict(zip(done, values))


def rename(sums: Mapping[str, Metric], mapping: Mapping[str, str]) -> MetricSums:
    """The keys of ``mapping`` present in ``sums``, under their new names."""
    return {new: sums[old] for old, new in mapping.items() if old in sums}


#: The rollout-time view (μ against π before any update on the batch): the realised mismatch.
MISMATCH_KEYS = {"div/topk_kl_mean": "mismatch/topk_kl_mean", "div/topk_kl_max": "mismatch/topk_kl_max",
                 "div/topk_tv_mean": "mismatch/topk_tv_mean", "div/full_kl_mean": "mismatch/full_kl_mean",
                 "div/full_kl_max": "mismatch/full_kl_max", "ratio/min": "mismatch/ratio_min",
                 "ratio/max": "mismatch/ratio_max", "mask/frac_outside": "mismatch/frac_outside",
                 "mask/dir_disagree": "mismatch/dir_disagree"}


def as_mismatch(sums: Mapping[str, Metric]) -> MetricSums:
    """Step metrics of the batch before any update, as ``mismatch/*`` keys (``MISMATCH_KEYS``),
    and the rollout-correction ones under verl's ``rollout_corr/*`` keys (``ROLLOUT_CORR_KEYS``).
    verl computes its ``rollout_is_*`` statistics only with a rollout IS threshold; here that is
    the cap ``clip_ratio_c``: without one (no ``corr/is_frac_high``), no ``rollout_corr/rollout_is_*``
    key (the uncapped ``corr/is_*`` stay under pdm_lab's own names)."""
    corr = ROLLOUT_CORR_KEYS if "corr/is_frac_high" in sums else {
        k: v for k, v in ROLLOUT_CORR_KEYS.items() if not v.startswith("rollout_corr/rollout_is_")}
    return {**rename(sums, MISMATCH_KEYS), **rename(sums, corr)}


def all_reduce_metrics(sums: Mapping[str, Metric], group=None) -> MetricSums:
    """``merge_metrics`` across the ranks of ``group``, in three collectives whatever the keys:
    one SUM of every Σ and count, one MAX and one MIN. Every rank must hold the same keys
    (``step_metric_sums`` guarantees it): a checksum of the key set rides along, so different
    keys of equal count raise; a different count is a collective size mismatch the backend
    reports. Identity outside a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return dict(sums)
    keys = sorted(sums)
    additive = [k for k in keys if sums[k].reduce in ("mean", "sum")]
    maxes = [k for k in keys if sums[k].reduce == "max"]
    mins = [k for k in keys if sums[k].reduce == "min"]
    device = sums[keys[0]].value.device if keys else torch.device("cpu")
    check = float(zlib.crc32("\n".join(f"{k}:{sums[k].reduce}" for k in keys).encode()))

    def pack(values: list[Tensor]) -> Tensor:
        return torch.stack([v.to(device, torch.float64) for v in values]) if values else \
            torch.zeros(0, dtype=torch.float64, device=device)

    total = pack([sums[k].value for k in additive] + [sums[k].count for k in keys])
    high = torch.cat([pack([sums[k].value for k in maxes]), pack([_f64(check)])])
    low = torch.cat([pack([sums[k].value for k in mins]), pack([_f64(check)])])
    dist.all_reduce(total, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    if float(high[-1]) != check or float(low[-1]) != check:
        raise RuntimeError(f"all_reduce_metrics: ranks hold different metric keys (this rank: {', '.join(keys)})")
    counts = dict(zip(keys, total[len(additive):]))
    value = dict(zip(additive, total[:len(additive)]))
    value.update(zip(maxes, high[:-1]))
    value.update(zip(mins, low[:-1]))
    return {k: Metric(sums[k].reduce, value[k], counts[k]) for k in keys}


@torch.no_grad()
def direction_disagreement(stats: "TokenStats", estimator: str) -> Tensor:
    """[N] bool: sign(r − 1) ≠ sign(Ḋ_estimator), the ratio test and PDM pointing different ways."""
    return torch.sign(stats.log_ratio) != torch.sign(stats.ddot[estimator])


def sign_certified(stats: "TokenStats") -> Tensor:
    """[N] bool: the bounds on Ḋ fix its sign (lower > 0 or upper < 0), whatever the tail does."""
    return (stats.ddot_lower > 0) | (stats.ddot_upper < 0)


@torch.no_grad()
def rollout_corr_sums(log_ratio: Tensor, response: Tensor, n: Tensor | None = None, *, keep: Tensor | None = None,
                      cap: Any = None, layout: tuple[int, int] | None = None) -> MetricSums:
    """verl's rollout-correction metrics ``corr/*`` (``pdm_lab.rollout_corr.rollout_corr_terms``,
    same arguments) as sums; `n`: the count of `response`, when the caller has it."""
    reducers = {"mean": mean_of, "max": max_of, "min": min_of}
    sums: MetricSums = {}
    for i, (where, terms) in enumerate(rollout_corr_terms(log_ratio, response, keep=keep, cap=cap, layout=layout)):
        count = n if (i == 0 and n is not None) else count_of(where)
        sums.update({key: reducers[reduce](x, where, count) for key, (reduce, x) in terms.items()})
    return sums


@torch.no_grad()
def step_metric_sums(stats: "TokenStats", keep: Tensor | None, advantages: Tensor, response: Tensor,
                     cfg: Any, *, outside: Tensor | None = None, estimator: str | None = None,
                     cap: Any = None, layout: tuple[int, int] | None = None) -> MetricSums:
    """Metrics over response tokens as sums: mask fractions, region, direction disagreement (of
    the rule's own Ḋ estimator, ``cfg.direction_estimator``), D, tails, r, and the
    rollout-correction metrics ``corr/*`` (``pdm_lab.rollout_corr``).

    Args: stats [N]; keep [N] 1/0 or None (no mask yet: the ``mask/frac_dropped*`` keys are left
    out); advantages [N]; response [N] bool; cfg a ``MaskConfig`` (δ, δ_neg, estimator);
    outside: [N] bool, the response tokens outside the region, when the caller has them;
    estimator: the Ḋ estimator (default ``cfg.direction_estimator``). With both, cfg is unused.
    cap: the ratio cap c of the importance weight (default ``cfg.clip_ratio_c`` when cfg is
    given); layout: (B, T) of the N rows, for the per-sequence keys (None: left out).
    The key set depends only on ``keep is None``, ``stats.full_kl``, the estimator, ``cap is
    None`` and ``layout is None``, so every rank of a run holds the same keys.
    """
    if cap is None and cfg is not None:
        cap = cfg.clip_ratio_c
    response = response.bool()
    if outside is None:
        outside = outside_region(stats.topk_kl, advantages, cfg) & response
    n, n_out = count_of(response), count_of(outside)  # once each: shared by their keys
    metrics: MetricSums = {}
    if keep is not None:
        dropped = keep == 0  # keep is 1/0
        metrics.update({
            "mask/frac_dropped": mean_of(dropped, response, n),
            "mask/frac_dropped_pos": mean_of(dropped, response & (advantages > 0)),
            "mask/frac_dropped_neg": mean_of(dropped, response & (advantages < 0)),
        })
    metrics.update({
        "mask/frac_outside": Metric("mean", n_out, n),  # Σ over response of [outside] = |outside|
        "div/topk_kl_mean": mean_of(stats.topk_kl, response, n),
        "div/topk_kl_max": max_of(stats.topk_kl, response, n),
        "div/topk_tv_mean": mean_of(stats.topk_tv, response, n),
        "div/mu_tail_mean": mean_of(stats.mu_tail, response, n),
        "div/pi_tail_mean": mean_of(stats.pi_tail, response, n),
        "ratio/mean": mean_of(stats.ratio, response, n),
        "ratio/min": min_of(stats.ratio, response, n),
        "ratio/max": max_of(stats.ratio, response, n),
        "tokens/response": metric("sum", response.sum()),
    })
    if stats.full_kl is not None:
        metrics["div/full_kl_mean"] = mean_of(stats.full_kl, response, n)
        metrics["div/full_kl_max"] = max_of(stats.full_kl, response, n)
    estimator = cfg.direction_estimator if estimator is None else estimator
    if estimator in stats.ddot:
        metrics["mask/dir_disagree"] = mean_of(direction_disagreement(stats, estimator), outside, n_out)
    metrics["mask/ddot_sign_certified"] = mean_of(sign_certified(stats), outside, n_out)
    metrics.update(rollout_corr_sums(stats.log_ratio, response, n, keep=keep, cap=cap, layout=layout))
    return metrics
