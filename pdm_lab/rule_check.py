"""The registration check: what a mask rule's drop function reads and how its drops move, over a
varied set of real batches, so that its declared record can be checked (``pdm_lab.rule_record``).

The check set is the product of

* real ``TokenStats`` (float64, ``token_stats`` with full distributions, binary divergences, a
  coupled c_t and a kernel term) of one eight-token batch (B = 2 responses × T = 4, the second one token shorter) under
  K ∈ {1, 3} × both conventions (``union``, ``kslot``) × three policies (every r > 1, every
  r < 1, mixed with one r = 1 token). The batch has ties in μ that K splits (rows 0, 3), sampled
  tokens outside μ's top-K, μ with cut tokens (log μ = −inf, so K = 3 reaches a −inf slot), and
  π = μ on one row;
* five advantage patterns (mixed signs and zeros, all positive, all negative, all zero, one sign
  per response);
* four configs: δ ∈ {0, 10⁻³, 0.05, 10} (everything outside the region … everything inside),
  δ_neg unset or set, every optional ``MaskConfig`` field set or None, each ``seq_agg``, the
  band's upper end from 0.02 to open.

So a branch on the sign of Â or r − 1, on δ, K, the convention or an optional field is taken
by some probe. Every call's reads are noted (``RuleCheckStats`` for the statistics, ``_CheckConfig``
for the config) and its drops kept, to tell whether they change with K and the convention.
"""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from pdm_lab.direction import DDOT_ESTIMATORS
from pdm_lab.errors import UserInputError
from pdm_lab.policy_side import policy_on_support
from pdm_lab.tokenwise import TokenStats, token_stats
from pdm_lab.support import support_from_full

DropFn = Callable[[TokenStats, Tensor, Any], Tensor]
LEVELS = ("token", "sequence")


class RuleRecordError(UserInputError, ValueError):
    """A mask rule that cannot be registered: its declared record disagrees with what its drop
    function does, or the function cannot be called as a drop function. One line, naming the
    rule and the record field (or the signature)."""


#: B = 2 responses × T = 4 tokens; the second response is one token shorter.
CHECK_RESPONSES = ((True, True, True, True), (True, True, True, False))
_NEG = float("-inf")
#: μ per token over a 6-token vocabulary (unnormalised; −inf: a token μ never samples) and the
#: sampled id: ties (rows 0, 3), cut tokens (rows 1, 2), k outside μ's top-2 (rows 2, 5).
_MU = (
    ((2.0, 1.0, 0.5, 0.5, 0.0, 0.0), 0),
    ((2.0, 1.6, _NEG, _NEG, _NEG, _NEG), 1),
    ((1.5, 1.2, 0.6, 0.3, _NEG, _NEG), 3),
    ((1.0, 1.0, 0.7, 0.2, 0.2, 0.0), 1),
    ((0.3, 1.4, 0.2, 0.9, 0.1, 0.5), 1),
    ((1.8, 0.4, 1.1, 0.0, 0.9, 0.2), 4),
    ((0.1, 0.2, 2.2, 0.4, 1.7, 0.3), 2),
    ((0.5, 0.5, 0.5, 0.5, 0.5, 0.5), 5),
)
#: π's logits = μ's (cut tokens at −3) + this per-token shift, then ±1.5 on the sampled token.
_PI_NOISE = ((0.4, -0.3, 0.2, 0.0, -0.5, 0.3), (-0.6, 0.9, 0.0, 0.0, 0.0, 0.0), (0.0, 0.3, -0.4, 0.8, 0.0, 0.0),
             (0.0, -0.2, 0.5, 0.1, -0.3, 0.0), (0.0,) * 6, (-0.7, 0.2, 0.6, 0.0, -0.2, 0.4),
             (0.3, 0.0, -0.9, 0.5, 0.2, -0.1), (0.2, -0.2, 0.4, -0.4, 0.1, -0.1))
#: policies: every sampled token up (r > 1), down (r < 1), or the shifts alone (mixed; row 4: π = μ).
POLICIES = {"r>1": 1.5, "r<1": -1.5, "mixed": 0.0}
KS = (1, 3)
CONVENTIONS = ("union", "kslot")
ADVANTAGES = {
    "mixed": (1.0, -1.0, 0.0, 2.0, -0.5, 1.0, -1.0, 0.0),
    "all > 0": (1.0,) * 8,
    "all < 0": (-1.0,) * 8,
    "all 0": (0.0,) * 8,
    "per response": (1.0,) * 4 + (-1.0,) * 4,
}
_COUPLED = (0.2, -0.1, 0.3, 0.0, -0.4, 0.1, 0.5, -0.2)
#: h_t = ⟨Wᵀg, Wᵀv⟩ (``pdm_kernel``): both signs, a zero, magnitudes beside and beyond Ḋ's
_KERNEL = (-0.3, 0.05, 0.0, 0.4, -0.02, -1.0, 0.2, 0.6)

#: A value for every ``MaskConfig`` field (tests hold the key set equal to MaskConfig's); ``k``
#: and ``convention`` are the probe's own per call.
CHECK_CONFIG = {
    "rule": "probe", "delta": 0.05, "delta_neg": None, "k": 2, "convention": "union", "estimator": None,
    "eps_low": 0.2, "eps_high": 0.28, "icepop_low": 0.5, "icepop_high": 2.0, "clip_ratio_c": 2.0,
    "aggregation": "token-mean", "horizon": 3, "dual_clip_c": 3.0, "seq_agg": "mean",
    "band_low": -0.02, "band_high": 0.02, "veto_floor": 0.5, "opsm_delta": 1e-4, "kernel_ratio": 1.0,
}
_UNSET = {"delta_neg": None, "clip_ratio_c": None, "horizon": None, "band_low": None, "veto_floor": None}
CONFIGS = (
    {**CHECK_CONFIG, **_UNSET, "delta": 0.0, "seq_agg": "mean"},
    {**CHECK_CONFIG, "delta": 1e-3, "delta_neg": 0.05, "band_high": 0.1, "seq_agg": "max", "kernel_ratio": 0.0},
    {**CHECK_CONFIG, "delta": 0.05, "band_high": 0.2, "seq_agg": "sum", "kernel_ratio": 10.0},
    {**CHECK_CONFIG, **_UNSET, "delta": 10.0, "delta_neg": 1e-3, "band_high": None, "seq_agg": "mean"},
)
#: ``MaskConfig`` fields that are δ, and those that are K or the convention.
DELTA_FIELDS = ("delta", "delta_neg", "delta_for_negative")
K_FIELDS = ("k", "convention")


class _ProbeDdot(Mapping):
    """``stats.ddot`` of the probe: each estimator read noted as ``ddot[name]``."""

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


class RuleCheckStats:
    """The ``TokenStats`` a drop function sees at registration: a real one, each field read noted
    in ``reads``. A rule with a side effect (a log line, a counter) performs it then, once per
    probe; ``isinstance(stats, RuleCheckStats)`` tells those calls apart."""

    def __init__(self, stats: TokenStats, reads: set[str]):
        values = {f.name: getattr(stats, f.name) for f in dataclasses.fields(TokenStats)}
        values["ddot"] = _ProbeDdot(dict(stats.ddot), reads)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_reads", reads)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name not in values:
            raise AttributeError(f"TokenStats has no field {name!r}")
        object.__getattribute__(self, "_reads").add(name)
        return values[name]


class _CheckConfig:
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


_STATS_CACHE: dict[tuple[str, ...], dict[tuple[int, str, str], TokenStats]] = {}


def check_stats() -> dict[tuple[int, str, str], TokenStats]:
    """(K, convention, policy) → the probe batch's real ``TokenStats`` (built once per set of
    registered Ḋ estimators: a new estimator gets its Ḋ)."""
    key = tuple(DDOT_ESTIMATORS)
    if key not in _STATS_CACHE:
        mu = torch.log_softmax(torch.tensor([row for row, _ in _MU], dtype=torch.float64), dim=1)
        sampled = torch.tensor([k for _, k in _MU])
        noise = torch.tensor(_PI_NOISE, dtype=torch.float64)
        base = torch.where(torch.isfinite(mu), mu, torch.full_like(mu, -3.0)) + noise
        out = {}
        for policy, shift in POLICIES.items():
            logits = base + shift * torch.nn.functional.one_hot(sampled, mu.shape[1]).to(mu.dtype)
            pi_full = torch.log_softmax(logits, dim=1)
            for k in KS:
                for convention in CONVENTIONS:
                    support = support_from_full(mu, sampled, k=k, convention=convention, compiled=False)
                    pi = policy_on_support(logits, support.ids)
                    stats = token_stats(support, pi, mu_full=mu, pi_full=pi_full, compiled=False)
                    out[k, convention, policy] = dataclasses.replace(
                        stats, coupled=torch.tensor(_COUPLED, dtype=torch.float64),
                        kernel=torch.tensor(_KERNEL, dtype=torch.float64))
        _STATS_CACHE.clear()
        _STATS_CACHE[key] = out
    return _STATS_CACHE[key]


def signature_level(name: str, fn: DropFn) -> str | None:
    """``token`` for a (stats, advantages, cfg) function, ``sequence`` for one that also takes the
    [B, T] response mask; None when the signature does not say (``*args``). Any other signature
    is refused (``RuleRecordError``)."""
    if not callable(fn):
        raise RuleRecordError(f"rule {name!r}: signature: register a function, got {type(fn).__name__}")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    required_kw = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if len(positional) in (3, 4) and not required_kw:
        return "token" if len(positional) == 3 else "sequence"
    got = ", ".join([p.name for p in positional] + [f"*, {n}" for n in required_kw])
    raise RuleRecordError(f"rule {name!r}: signature: a drop function takes (stats, advantages, cfg), or "
                          f"(stats, advantages, cfg, response_mask) for a sequence rule; got ({got})")


@dataclasses.dataclass
class Observation:
    """What a drop function did over the check set."""

    stats_reads: set[str]      # TokenStats fields, and ``ddot[<estimator>]`` per Ḋ read
    cfg_reads: set[str]        # MaskConfig fields
    varies_with_k: bool        # some probe's drops differ between two (K, convention) supports


def observe(name: str, fn: DropFn, level: str) -> Observation:
    """Run ``fn`` on every probe; raises ``RuleRecordError`` naming the probe when the function
    fails there or returns anything but an [N] bool tensor."""
    stats_reads: set[str] = set()
    cfg_reads: set[str] = set()
    response_mask = torch.tensor(CHECK_RESPONSES)
    drops: dict[tuple, list[Tensor]] = {}
    advantages = {name: torch.tensor(values, dtype=torch.float64) for name, values in ADVANTAGES.items()}
    for (k, convention, policy), stats in check_stats().items():
        probe = RuleCheckStats(stats, stats_reads)
        configs = [_CheckConfig({**config, "k": k, "convention": convention}, cfg_reads) for config in CONFIGS]
        for adv_name, adv in advantages.items():
            for c, (config, cfg) in enumerate(zip(CONFIGS, configs)):
                args = (probe, adv.clone(), cfg)
                where = (f"K={k}, {convention}, {policy}, Â {adv_name}, δ={config['delta']}, "
                         f"seq_agg={config['seq_agg']}")
                try:
                    drop = fn(*args, response_mask) if level == "sequence" else fn(*args)
                except Exception as err:  # noqa: BLE001 - whatever it is, the rule cannot be registered
                    msg = str(err).splitlines()[0] if str(err) else ""
                    raise RuleRecordError(f"rule {name!r}: probe: its drop function fails on the registration check "
                                          f"({level}-level call; {where}): {type(err).__name__}: {msg}") from err
                if not (isinstance(drop, Tensor) and drop.dtype == torch.bool and drop.shape == adv.shape):
                    got = f"{drop.dtype} {tuple(drop.shape)}" if isinstance(drop, Tensor) else type(drop).__name__
                    raise RuleRecordError(f"rule {name!r}: returns: a drop function returns an [N] bool tensor (N = "
                                          f"{adv.numel()} on the probe), got {got}")
                drops.setdefault((policy, adv_name, c), []).append(drop)
    varies = any(any(not torch.equal(d, same[0]) for d in same[1:]) for same in drops.values())
    return Observation(stats_reads, cfg_reads, varies)
