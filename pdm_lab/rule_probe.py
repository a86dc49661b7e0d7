"""The registration probe: what a mask rule's drop function reads, so that its record is derived.

``register_mask`` (``pdm_lab.masks``) calls a drop function once here, on ``RuleProbe`` (a
stand-in ``TokenStats`` of six tokens that notes every field and Ḋ estimator read) and a config
that notes every field read, under two configurations (the optional fields set, then None).
``facts_from_reads`` turns the reads into the record's facts (SPEC §4: the divergence thresholded,
the estimator deciding the direction, δ, the reduced support, DPPO's binary divergences, the
inputs beyond token statistics).
"""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from .direction import DDOT_ESTIMATORS
from .stats import TokenStats

DropFn = Callable[[TokenStats, Tensor, Any], Tensor]

#: The per-token divergences a rule may threshold: attribute names of ``TokenStats``.
DIVERGENCES = ("topk_kl", "topk_tv", "binary_kl", "binary_tv")
#: Those that ``token_stats`` computes only when asked (``binary=True``).
BINARY_DIVERGENCES = ("binary_kl", "binary_tv")
#: ``TokenStats`` fields whose values change with the reduced support S (K, the convention);
#: every Ḋ estimator but ``exact`` too (Ḋ_exact is the full Ḋ, whatever S is).
SUPPORT_FIELDS = ("topk_kl", "topk_tv", "mu_tail", "pi_tail", "ddot_lower", "ddot_upper")
#: ``MaskConfig`` fields that are δ: a rule reading one is swept over δ.
DELTA_FIELDS = ("delta", "delta_neg", "delta_for_negative")
LEVELS = ("token", "sequence")


#: Probe batch: B = 2 responses × T = 3 tokens (the second one token shorter), Â of both signs and 0.
_PROBE_RESPONSES = ((True, True, True), (True, True, False))
_PROBE_ADVANTAGES = (1.0, -1.0, 1.0, -1.0, 0.0, 1.0)

#: A value for every ``MaskConfig`` field (tests hold the two lists equal): the probe's two
#: configurations, with every optional field set and with them at None, so a branch on an
#: optional field is taken both ways.
_PROBE_CONFIG = {
    "rule": "probe", "delta": 0.15, "delta_neg": 0.3, "k": 3, "convention": "union", "estimator": None,
    "eps_low": 0.2, "eps_high": 0.28, "icepop_low": 0.5, "icepop_high": 2.0, "clip_ratio_c": 2.0,
    "aggregation": "token-mean", "horizon": 3, "dual_clip_c": 3.0, "seq_agg": "mean",
    "band_low": -0.02, "band_high": 0.02, "veto_floor": 0.5, "opsm_delta": 1e-4,
}
_PROBE_CONFIG_UNSET = {**_PROBE_CONFIG, "delta_neg": None, "clip_ratio_c": None, "horizon": None,
                       "band_low": None, "veto_floor": None}


class _ProbeDdot(Mapping):
    """``stats.ddot`` of the probe: every registered estimator, each read noted as ``ddot[name]``."""

    def __init__(self, values: dict[str, Tensor], reads: set[str]):
        self._values, self._reads = values, reads

    def __getitem__(self, name: str) -> Tensor:
        value = self._values[name]  # KeyError for an unknown estimator, as the real dict
        self._reads.add(f"ddot[{name}]")
        return value

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __iter__(self) -> Iterator[str]:
        for name in self._values:  # iterating reads every value
            self._reads.add(f"ddot[{name}]")
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


class RuleProbe:
    """The ``TokenStats`` a drop function sees once, at registration: every field filled (six
    tokens, ``_PROBE_RESPONSES``), each read noted in ``reads``. A rule with a side effect (a log
    line, a counter) performs it once then; ``isinstance(stats, RuleProbe)`` tells the call apart."""

    def __init__(self, reads: set[str]):
        n = len(_PROBE_ADVANTAGES)
        ramp = torch.linspace(0.0, 1.0, n)
        log_ratio = torch.tensor([0.0, 0.3, -0.4, 0.8, -1.2, 0.05])
        signed = torch.tensor([-0.1, 0.2, 0.3, -0.4, 0.1, 0.0])
        values = {f.name: 0.4 * ramp for f in dataclasses.fields(TokenStats)}
        values.update(log_ratio=log_ratio, ratio=torch.exp(log_ratio), mu_tail=0.05 * ramp,
                      pi_tail=0.04 * ramp, ddot_lower=signed - 0.05, ddot_upper=signed + 0.05, coupled=signed)
        values["ddot"] = _ProbeDdot({name: signed for name in DDOT_ESTIMATORS}, reads)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_reads", reads)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name not in values:
            raise AttributeError(f"TokenStats has no field {name!r}")
        object.__getattribute__(self, "_reads").add(name)
        return values[name]


class _ProbeConfig:
    """The ``MaskConfig`` a drop function sees at registration; notes each field it reads."""

    def __init__(self, values: dict[str, Any], reads: set[str]):
        self._values, self._reads = values, reads

    @property
    def delta_for_negative(self) -> float:
        self._reads.add("delta_for_negative")
        neg = self._values["delta_neg"]
        return self._values["delta"] if neg is None else neg

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self._values:
            raise AttributeError(f"cfg.{name}: not a MaskConfig field")
        self._reads.add(name)
        return self._values[name]


def arity_level(name: str, fn: DropFn) -> str | None:
    """``token`` for a (stats, advantages, cfg) function, ``sequence`` for one that also takes the
    [B, T] response mask; None when the signature does not say (``*args``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    if len(positional) == 3:
        return "token"
    if len(positional) == 4:
        return "sequence"
    raise ValueError(f"rule {name!r}: a drop function takes (stats, advantages, cfg), or (stats, "
                     f"advantages, cfg, response_mask) for a sequence rule; got {len(positional)} arguments")


def probe_reads(name: str, fn: DropFn, level: str) -> tuple[set[str], set[str]]:
    """(statistics, config fields) that ``fn`` reads on the probe, under both probe configs.

    Statistics are ``TokenStats`` field names, and ``ddot[<estimator>]`` per Ḋ read. Raises
    ``ValueError`` naming the rule when the function fails on the probe or returns anything but
    an [N] bool tensor."""
    stats_reads: set[str] = set()
    cfg_reads: set[str] = set()
    advantages = torch.tensor(_PROBE_ADVANTAGES)
    response_mask = torch.tensor(_PROBE_RESPONSES)
    for config in (_PROBE_CONFIG, _PROBE_CONFIG_UNSET):
        args = (RuleProbe(stats_reads), advantages.clone(), _ProbeConfig(config, cfg_reads))
        try:
            drop = fn(*args, response_mask) if level == "sequence" else fn(*args)
        except Exception as err:  # noqa: BLE001 - whatever it is, the rule cannot be registered
            raise ValueError(f"rule {name!r}: its drop function fails on the registration probe "
                             f"(a {level}-level call): {type(err).__name__}: {err}") from err
        if not (isinstance(drop, Tensor) and drop.dtype == torch.bool and drop.shape == advantages.shape):
            got = f"{drop.dtype} {tuple(drop.shape)}" if isinstance(drop, Tensor) else type(drop).__name__
            raise ValueError(f"rule {name!r}: a drop function returns an [N] bool tensor (N = "
                             f"{advantages.numel()} on the probe), got {got}")
    return stats_reads, cfg_reads


def facts_from_reads(name: str, stats_reads: set[str], cfg_reads: set[str]) -> dict[str, Any]:
    """The record's facts as the reads give them (see ``MaskRule`` for each)."""
    divergences = [d for d in DIVERGENCES if d in stats_reads]
    estimators = sorted(r[len("ddot["):-1] for r in stats_reads if r.startswith("ddot["))
    if len(divergences) > 1:
        raise ValueError(f"rule {name!r} reads the divergences {', '.join(divergences)}: a record names "
                         "the one divergence its rule thresholds")
    if len(estimators) > 1:
        raise ValueError(f"rule {name!r} reads Ḋ of the estimators {', '.join(estimators)}: a record "
                         "names the one estimator whose sign decides the direction")
    needs = tuple(need for need, reads in (("full", {"full_kl", "ddot[exact]"}), ("coupled", {"coupled"}))
                  if stats_reads & reads)
    return {
        "divergence": divergences[0] if divergences else None,
        "estimator": estimators[0] if estimators else None,
        "uses_delta": bool(cfg_reads & set(DELTA_FIELDS)),
        "uses_support": bool(stats_reads & set(SUPPORT_FIELDS)) or any(e != "exact" for e in estimators),
        "needs": needs,
        "binary_stats": bool(stats_reads & set(BINARY_DIVERGENCES)),
    }
