"""The mask-rule registry (SPEC §4): ``MaskRule`` records, ``register_mask`` and the lookup.

Kept apart from the rules themselves (``pdm_lab.masks``, ``pdm_lab.framework_rules``) so that
both rule modules register here without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pdm_lab.errors import PDMInputError
from pdm_lab.rule_check import DropFn, RuleRecordError, observe, signature_level
from pdm_lab.rule_record import FIELDS, check_declaration, check_level, resolve_declaration
from pdm_lab.tokenwise import TokenStats


@dataclass(frozen=True)
class MaskRule:
    """One registered rule and its declared record (``pdm_lab.rule_record`` says how each field
    is checked at registration)."""

    name: str
    drop: DropFn
    """``(stats, advantages, cfg) -> [N] bool`` drop tensor (cfg: a ``MaskConfig``)."""
    divergence: str | None = None
    """the ``TokenStats`` divergence the rule thresholds (``topk_kl``, …), or None (no trust region)."""
    estimator: str | None = None
    """the Ḋ estimator whose sign decides the direction (``pdm_*``), or None (ratio test / none)."""
    support: str = "slot"
    """``topk``: reads μ's reduced top-K support; ``slot``: the sampled token's one slot decides."""
    uses_delta: bool = False
    """reads δ (and δ_neg): a sweep over δ is meaningful for this rule."""
    uses_k: bool = False
    """its drops change with K or the convention: a sweep over them is meaningful."""
    level: str = "token"
    """``token`` or ``sequence`` (drops whole responses; sees the [B, T] layout)."""
    needs: tuple[str, ...] = ()
    """inputs beyond token stats: ``full`` (full distributions), ``coupled`` (c_t from the model),
    ``kernel`` (h_t = ⟨Wᵀg, Wᵀv⟩ from the unembedding W)."""
    binary_stats: bool = False
    """reads ``stats.binary_kl`` / ``binary_tv``: ``pdm_policy_loss`` computes them only then."""
    doc: str = ""
    said: frozenset = frozenset()
    """the record fields the registration stated (the rest are defaults): the check reads them."""

    @property
    def uses_support(self) -> bool:
        """Reads μ's top-K support (``support == "topk"``): the top-K path, never the one slot."""
        return self.support == "topk"

    def record(self) -> dict[str, Any]:
        """The declared record, as ``register_mask``'s keywords."""
        return {field: getattr(self, field) for field in FIELDS}

    def __call__(self, stats: TokenStats, advantages: Tensor, cfg: Any) -> Tensor:
        return self.drop(stats, advantages, cfg)


MASK_RULES: dict[str, MaskRule] = {}


_LEFT_OUT: Any = object()  # a keyword left out of register_mask: ``like``'s value, else the default


def register_mask(name: str, *, like: str | None = None, divergence: str | None = _LEFT_OUT,
                  estimator: str | None = _LEFT_OUT, support: str = _LEFT_OUT, uses_delta: bool = _LEFT_OUT,
                  uses_k: bool = _LEFT_OUT, level: str = _LEFT_OUT, needs: tuple[str, ...] = _LEFT_OUT,
                  binary_stats: bool | None = _LEFT_OUT, check: bool = True) -> Callable[[DropFn], DropFn]:
    """Decorator: register a drop function under ``name`` with the record its keywords declare.

    A keyword left out declares ``like``'s value (another registered rule's record, for a rule
    that delegates to it), else its default (``rule_record.DEFAULTS``: no divergence, no
    estimator, the one slot, no δ, no K, token level, nothing more; ``binary_stats`` follows the
    divergence). The function is then run over the check set (``rule_check``, the registration check): its signature
    must match ``level``, and what it reads and how its drops move with K must match every
    other field; a mismatch is refused with ``RuleRecordError`` (a ``ValueError``), one line
    naming the rule and the field. ``check=False`` skips that run (the built-in rules: the suite
    checks them with ``check_registered``).
    """
    keywords = {"divergence": divergence, "estimator": estimator, "support": support, "uses_delta": uses_delta,
                "uses_k": uses_k, "level": level, "needs": needs, "binary_stats": binary_stats}
    given = {key: value for key, value in keywords.items() if value is not _LEFT_OUT}
    if like is not None and like not in MASK_RULES:
        raise RuleRecordError(f"rule {name!r}: like: {like!r} is not a registered rule; valid: "
                              f"{', '.join(sorted(MASK_RULES))}")
    base = MASK_RULES[like].record() if like is not None else None
    declared = resolve_declaration(name, given, base)
    said = set(given) | (set(FIELDS) if like is not None else set())

    def wrap(fn: DropFn) -> DropFn:
        if name in MASK_RULES:
            raise RuleRecordError(f"rule {name!r}: name: already registered")
        if check:
            check_level(name, declared["level"], signature_level(name, fn), said)
            check_declaration(name, declared, said, observe(name, fn, declared["level"]))
        MASK_RULES[name] = MaskRule(name=name, drop=fn, doc=(fn.__doc__ or "").strip(), said=frozenset(said),
                                    **declared)
        return fn
    return wrap


def check_registered(rule: MaskRule) -> None:
    """Run the registration check (``pdm_lab.rule_check``) on an already registered rule: what
    ``register_mask`` does for a user's rule. The built-in rules are registered unchecked (every
    process would re-check them at import) and the suite checks each with this."""
    check_level(rule.name, rule.level, signature_level(rule.name, rule.drop), set(rule.said))
    check_declaration(rule.name, rule.record(), set(rule.said), observe(rule.name, rule.drop, rule.level))


def _register_builtin(name: str, **keywords: Any) -> Callable[[DropFn], DropFn]:
    """``register_mask`` for the rules this library ships: checked by the suite, not at import."""
    return register_mask(name, check=False, **keywords)


def get_mask_rule(name: str) -> MaskRule:
    """The record of rule `name`; an unknown name raises, listing the valid ones."""
    try:
        return MASK_RULES[name]
    except KeyError:
        raise PDMInputError(f"rule: unknown mask rule {name!r}; valid: {', '.join(sorted(MASK_RULES))}") from None
