"""pdm_lab: Predictive Divergence Masks for LLM RL — one mask library for proofs, toys and scale.

The core is pure torch (SPEC.md §2–5): supports, divergences, Ḋ estimators, the mask registry,
the policy loss and its metrics. ``pdm_lab.proofs``, ``pdm_lab.envs`` and ``pdm_lab.scaling``
all call these functions.
"""
from .aggregation import DPInfo
from .audit_live import LiveAuditConfig
from .config import ConfigError
from pdm_lab.mask_config import MaskConfig
from .diagnose import diagnose
from .direction import DDOT_ESTIMATORS, register_ddot_estimator
from .errors import PDMInputError
from . import framework_rules  # noqa: F401  (registers the SPEC §4b rules)
from .loss import LossOutput, aggregate, pdm_policy_loss
from .masks import MASK_RULES, compute_mask, register_mask
from .policy_side import PolicyOnSupport, policy_on_support, policy_on_support_reference
from .reference_loss import pdm_policy_loss_reference
from .stats import TokenStats, token_stats
from .support import Support, support_from_full, support_from_slots, support_from_topk

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "DDOT_ESTIMATORS", "DPInfo", "LiveAuditConfig", "LossOutput", "MASK_RULES", "MaskConfig", "PDMInputError",
    "PolicyOnSupport", "Support", "TokenStats", "aggregate", "compute_mask", "diagnose",
    "pdm_policy_loss", "pdm_policy_loss_reference", "policy_on_support", "policy_on_support_reference",
    "register_ddot_estimator",
    "register_mask", "support_from_full", "support_from_slots", "support_from_topk", "token_stats",
]
