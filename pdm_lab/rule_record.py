"""A mask rule's declared record, and its check against what the drop function does (SPEC §4).

The record is declared at registration (``register_mask``'s keywords; a keyword left out
declares its default, the plain ratio rule's value) and checked against ``rule_check.observe``:

====================  ============================================================  ==========
field                 what it says                                                  checked by
====================  ============================================================  ==========
``divergence``        the ``TokenStats`` divergence thresholded (or None)            reads
``estimator``         the Ḋ estimator whose sign decides the direction (or None)    reads
``support``           ``topk``: reads μ's reduced top-K support (its divergences,    reads
                      tails, Ḋ); ``slot``: decides from the sampled token's one
                      slot alone (r, binary divergences), exact under verl's bypass
``uses_delta``        reads δ (δ_neg): a sweep over δ means something                reads
``uses_k``            its drops change with K or the convention (the sweep's axes)   drops, reads
``level``             ``token``, or ``sequence`` (takes the [B, T] response mask)    signature
``needs``             inputs beyond token stats: ``full``, ``coupled`` (the model),  reads
                      ``kernel`` (the unembedding W, SPEC §6d)
``binary_stats``      reads DPPO's binary divergences (default: the divergence is    reads
                      one): the loss computes them only then
====================  ============================================================  ==========
"""
from __future__ import annotations

from typing import Any

from pdm_lab.direction import DDOT_ESTIMATORS
from pdm_lab.rule_check import DELTA_FIELDS, K_FIELDS, LEVELS, Observation, RuleRecordError

#: The per-token divergences a rule may threshold: attribute names of ``TokenStats``.
DIVERGENCES = ("topk_kl", "topk_tv", "binary_kl", "binary_tv")
#: Those that ``token_stats`` computes only when asked (``binary=True``).
BINARY_DIVERGENCES = ("binary_kl", "binary_tv")
#: ``TokenStats`` fields whose values are the reduced support S's (K, the convention); every Ḋ
#: estimator's too but ``exact`` (Ḋ_exact is the full Ḋ, whatever S is).
SUPPORT_FIELDS = ("topk_kl", "topk_tv", "mu_tail", "pi_tail", "ddot_lower", "ddot_upper")
SUPPORTS = ("topk", "slot")
NEEDS = ("full", "coupled", "kernel")
#: The record's fields in the order they are checked, and what leaving one out declares.
DEFAULTS: dict[str, Any] = {"divergence": None, "estimator": None, "support": "slot", "uses_delta": False,
                            "uses_k": False, "level": "token", "needs": (), "binary_stats": None}
FIELDS = tuple(DEFAULTS)


def resolve_declaration(name: str, given: dict[str, Any], like: dict[str, Any] | None) -> dict[str, Any]:
    """The full declaration: ``given`` over ``like`` (another rule's record) over ``DEFAULTS``;
    each value checked for its type and range (``RuleRecordError`` naming the field)."""
    record = {**DEFAULTS, **(like or {}), **given}
    if isinstance(record["needs"], str):
        raise RuleRecordError(f"rule {name!r}: needs: a tuple of names, got the string {record['needs']!r}")
    record["needs"] = tuple(record["needs"])
    choices = {"divergence": (None, *DIVERGENCES), "estimator": (None, *DDOT_ESTIMATORS), "support": SUPPORTS,
               "level": LEVELS}
    for field, valid in choices.items():
        if record[field] not in valid:
            raise RuleRecordError(f"rule {name!r}: {field}: {record[field]!r} is not one of "
                                  f"{', '.join(map(repr, valid))}")
    for field in ("uses_delta", "uses_k"):
        if not isinstance(record[field], bool):
            raise RuleRecordError(f"rule {name!r}: {field}: must be True or False, got {record[field]!r}")
    unknown = [n for n in record["needs"] if n not in NEEDS]
    if unknown:
        raise RuleRecordError(f"rule {name!r}: needs: unknown {unknown[0]!r}; valid: {', '.join(NEEDS)}")
    if record["binary_stats"] is None:
        record["binary_stats"] = record["divergence"] in BINARY_DIVERGENCES
    return record


def observed_facts(name: str, seen: Observation) -> dict[str, Any]:
    """The record's fields as the check set shows them (``level`` excepted: the signature's)."""
    reads = seen.stats_reads
    divergences = [d for d in DIVERGENCES if d in reads]
    estimators = sorted(r[len("ddot["):-1] for r in reads if r.startswith("ddot["))
    if len(divergences) > 1:
        raise RuleRecordError(f"rule {name!r}: divergence: it reads the divergences {', '.join(divergences)}, "
                              "but a record names the one divergence its rule thresholds")
    if len(estimators) > 1:
        raise RuleRecordError(f"rule {name!r}: estimator: it reads Ḋ of the estimators {', '.join(estimators)}, "
                              "but a record names the one estimator whose sign decides the direction")
    needs = tuple(need for need, fields in (("full", {"full_kl", "ddot[exact]"}), ("coupled", {"coupled"}),
                                            ("kernel", {"kernel"}))
                  if reads & fields)
    topk = bool(reads & set(SUPPORT_FIELDS)) or any(e != "exact" for e in estimators)
    return {
        "divergence": divergences[0] if divergences else None,
        "estimator": estimators[0] if estimators else None,
        "support": "topk" if topk else "slot",
        "uses_delta": bool(seen.cfg_reads & set(DELTA_FIELDS)),
        "uses_k": seen.varies_with_k or bool(seen.cfg_reads & set(K_FIELDS)),
        "needs": needs,
        "binary_stats": bool(reads & set(BINARY_DIVERGENCES)),
    }


def _evidence(field: str, seen: Observation) -> str:
    """Why the check set gives ``field`` its value, in a few words."""
    if field == "uses_k":
        if seen.cfg_reads & set(K_FIELDS):
            return f"its function reads {', '.join(f'cfg.{f}' for f in sorted(seen.cfg_reads & set(K_FIELDS)))}"
        return ("its drops change between the probe's K and conventions" if seen.varies_with_k
                else "its drops are the same for every K and convention on the check set")
    read = sorted(seen.stats_reads) + [f"cfg.{c}" for c in sorted(seen.cfg_reads)]
    return f"its function reads {', '.join(read) or 'nothing'}"


def check_declaration(name: str, declared: dict[str, Any], given: set[str], seen: Observation) -> None:
    """Refuse (``RuleRecordError``, one line naming the field) a declaration the check set contradicts."""
    facts = observed_facts(name, seen)
    for field in FIELDS:
        if field == "level" or declared[field] == facts[field]:
            continue
        how = "" if field in given else " (left out: the default)"
        raise RuleRecordError(f"rule {name!r}: {field}: declares {field}={declared[field]!r}{how}, but "
                              f"{_evidence(field, seen)}, which makes {field}={facts[field]!r}")
    if declared["uses_k"] and declared["support"] != "topk":  # e.g. a one-slot rule reading cfg.k
        raise RuleRecordError(f"rule {name!r}: uses_k: declares uses_k=True with support={declared['support']!r}: "
                              "drops that change with K come from the top-K support (support='topk')")


def check_level(name: str, declared: str, by_signature: str | None, given: set[str]) -> None:
    """The declared level against the function's signature (None: ``*args``, any level)."""
    if by_signature not in (None, declared):
        how = "" if "level" in given else " (left out: the default)"
        takes = ("(stats, advantages, cfg, response_mask), a sequence rule's" if by_signature == "sequence"
                 else "(stats, advantages, cfg), a token rule's")
        raise RuleRecordError(f"rule {name!r}: level: declares level={declared!r}{how}, but its function takes "
                              f"{takes} signature")
