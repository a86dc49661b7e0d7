"""``MaskConfig``: the ``mask:`` section of every config — the rule, δ, K, the support convention
and the loss's options (SPEC §4–5) — for toy sweeps, full runs and the framework adapters alike."""
from __future__ import annotations

from typing import Annotated

from pdm_lab.aggregation import AGGREGATIONS
from pdm_lab.config import ConfigError, at_least, config_dataclass, greater_than, non_negative, one_of, positive
from pdm_lab.direction import DDOT_ESTIMATORS
from pdm_lab.masks import MASK_RULES, MaskRule
from pdm_lab.support import CONVENTIONS


@config_dataclass("mask")
class MaskConfig:
    """The trust-region mask and the policy loss (SPEC §4–5). Defaults follow the paper (§7)."""

    rule: str = "pdm_uniform"
    """Mask rule from the registry (``pdm_lab.masks.MASK_RULES``)."""
    delta: Annotated[float, non_negative] = 0.15
    """Trust-region threshold δ on the divergence (paper: 0.15, also 0.05)."""
    delta_neg: Annotated[float, non_negative] | None = None
    """Separate δ for Â < 0 (DPPO's code allows it); None: same as ``delta``."""
    k: Annotated[int, at_least(1)] = 20
    """K, how many of μ's top tokens the rollout exposes (paper: 20). The key is ``k`` as in DPPO's
    and verl's configs; in SPEC's symbols it is K, the support size — never k, the sampled token."""
    convention: str = "union"
    """Support convention: ``union`` (paper, TopK ∪ {k}) or ``kslot`` (DPPO's public code)."""
    estimator: str | None = None
    """Ḋ estimator of the direction metrics; None: the rule's own (``MaskRule.estimator``), or
    ``topk`` (the exact derivative of the thresholded D) for rules without one."""
    eps_low: Annotated[float, non_negative] = 0.2
    """ppo_clip lower ε (GRPO clip-higher: 0.2)."""
    eps_high: Annotated[float, non_negative] = 0.28
    """ppo_clip upper ε (GRPO clip-higher: 0.28)."""
    icepop_low: Annotated[float, non_negative] = 0.5
    """icepop α: keep only r ≥ α."""
    icepop_high: Annotated[float, non_negative] = 2.0
    """icepop β: keep only r ≤ β."""
    clip_ratio_c: Annotated[float, positive] | None = None
    """TIS-style cap c on the ratio factor, sg(min(r, c)); None: no cap."""
    aggregation: str = "token-mean"
    """Loss aggregation (DAPO's token-mean by default)."""
    horizon: Annotated[int, at_least(1)] | None = None
    """Fixed horizon for ``seq-mean-token-sum-norm``; None: the padded response length."""
    # SPEC §4b: the rules frameworks ship (pdm_lab/framework_rules.py)
    dual_clip_c: Annotated[float, greater_than(1.0)] = 3.0
    """``ppo_clip_dual``: also drop Â<0 ∧ r > c (verl's dual-clip default: 3)."""
    seq_agg: str = "mean"
    """``seq_*`` rules: aggregate of the per-token statistic over a response (mean, max, sum)."""
    band_low: float | None = -0.02
    """``seq_*``/``token_k*`` rules: drop below this (None: no lower bound). ±0.02 suits all four
    statistics' scales (k1: geometric-mean ratio within e^±0.02; k2, k3, D are ≥ 0)."""
    band_high: float | None = 0.02
    """``seq_*``/``token_k*`` rules: drop above this (None: no upper bound)."""
    veto_floor: Annotated[float, positive] | None = None
    """Sequence rules: drop a response if any token has r below this (verl's veto; None: off)."""
    opsm_delta: Annotated[float, non_negative] = 1e-4
    """``opsm``: drop an Â<0 response whose mean log μ_k − log π_k exceeds this (slime: 1e-4)."""
    kernel_ratio: Annotated[float, non_negative] = 1.0
    """``pdm_kernel``: λ = b/a, the weight of the head-kernel term h_t = ⟨Wᵀg, Wᵀv⟩ beside Ḋ_topk
    (drop D > δ ∧ Â·(Ḋ_topk + λ·h_t) > 0; 0 gives ``pdm_topk``'s drops). Take it from a run's
    own-update probe: the median b/a of ``probe/kernel_fit`` (``pdm-lab mechanism``); 1.0 is a
    placeholder, not a fitted value."""

    def __post_init__(self) -> None:
        one_of("mask.rule", self.rule, MASK_RULES)
        one_of("mask.convention", self.convention, CONVENTIONS)
        if self.estimator is not None:
            one_of("mask.estimator", self.estimator, DDOT_ESTIMATORS)
        one_of("mask.aggregation", self.aggregation, AGGREGATIONS)
        if self.icepop_high < self.icepop_low:
            raise ConfigError(f"mask.icepop_high ({self.icepop_high}) < icepop_low ({self.icepop_low})")
        _check_framework_fields(self)

    @property
    def delta_for_negative(self) -> float:
        return self.delta if self.delta_neg is None else self.delta_neg

    @property
    def rule_record(self) -> MaskRule:
        """The registry's record of ``rule`` (its divergence, estimator, what it reads)."""
        return MASK_RULES[self.rule]

    @property
    def direction_estimator(self) -> str:
        """The Ḋ estimator the direction metrics use: ``estimator``, else the rule's, else ``topk``."""
        return self.estimator or self.rule_record.estimator or "topk"


def _check_framework_fields(cfg: MaskConfig) -> None:
    from pdm_lab.framework_rules import BAND_RULES, SEQ_AGGREGATIONS

    one_of("mask.seq_agg", cfg.seq_agg, SEQ_AGGREGATIONS)
    if cfg.band_low is not None and cfg.band_high is not None and cfg.band_low > cfg.band_high:
        raise ConfigError(f"mask.band_low ({cfg.band_low}) > band_high ({cfg.band_high})")
    if cfg.rule in BAND_RULES and cfg.band_low is None and cfg.band_high is None:
        raise ConfigError(f"mask.rule {cfg.rule!r} rejects outside [band_low, band_high]: set at least one")
