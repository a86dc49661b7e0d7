"""pdm_lab: Predictive Divergence Masks for LLM RL — one mask library for proofs, toys and scale.

The mask library is this package's top level and pure torch (SPEC §2–5, docs/spec.md): supports,
divergences, Ḋ estimators, the mask registry, the policy loss and its metrics. The SPEC §6 audit
lives in ``pdm_lab.audit``, what the lab's stages share in ``pdm_lab.lab``; ``pdm_lab.proofs``,
``pdm_lab.envs`` and ``pdm_lab.scaling`` all call the library.

The names below load on first use (as TRL's top level does): ``import pdm_lab`` costs nothing
beyond torch, and loads no audit, probe or snapshot module (``pdm-lab bench`` measures it).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "DPInfo": "pdm_lab.aggregation",
    "LiveAuditConfig": "pdm_lab.audit.live",
    "ConfigError": "pdm_lab.config",
    "MaskConfig": "pdm_lab.mask_config",
    "diagnose": "pdm_lab.diagnosis",
    "DDOT_ESTIMATORS": "pdm_lab.direction",
    "register_ddot_estimator": "pdm_lab.direction",
    "PDMInputError": "pdm_lab.errors",
    "LossOutput": "pdm_lab.loss",
    "aggregate": "pdm_lab.loss",
    "pdm_policy_loss": "pdm_lab.loss",
    "MASK_RULES": "pdm_lab.masks",
    "compute_mask": "pdm_lab.masks",
    "register_mask": "pdm_lab.masks",
    "PolicyOnSupport": "pdm_lab.policy_side",
    "policy_on_support": "pdm_lab.policy_side",
    "policy_on_support_reference": "pdm_lab.policy_side",
    "pdm_policy_loss_reference": "pdm_lab.reference_loss",
    "TokenStats": "pdm_lab.tokenwise",
    "token_stats": "pdm_lab.tokenwise",
    "Support": "pdm_lab.support",
    "support_from_full": "pdm_lab.support",
    "support_from_slots": "pdm_lab.support",
    "support_from_topk": "pdm_lab.support",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:  # a submodule (``pdm_lab.masks``) or a typo
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'pdm_lab' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, eagerly
    from pdm_lab.aggregation import DPInfo
    from pdm_lab.audit.live import LiveAuditConfig
    from pdm_lab.config import ConfigError
    from pdm_lab.diagnosis import diagnose
    from pdm_lab.direction import DDOT_ESTIMATORS, register_ddot_estimator
    from pdm_lab.errors import PDMInputError
    from pdm_lab.loss import LossOutput, aggregate, pdm_policy_loss
    from pdm_lab.mask_config import MaskConfig
    from pdm_lab.masks import MASK_RULES, compute_mask, register_mask
    from pdm_lab.policy_side import PolicyOnSupport, policy_on_support, policy_on_support_reference
    from pdm_lab.reference_loss import pdm_policy_loss_reference
    from pdm_lab.support import Support, support_from_full, support_from_slots, support_from_topk
    from pdm_lab.tokenwise import TokenStats, token_stats
