"""What the verl adapters share without importing verl: the loss-name prefix, the switch of the
top-K patch set, and the mask section of a verl actor config (``verl``, ``verl_topk`` and
``verl_patches`` all read it; kept apart so they import it, not each other)."""
from __future__ import annotations

from typing import Any

from ..config import MaskConfig, from_dict
from .launch_files import VERL_TOPK_ENV

#: verl ``loss_mode`` names of pdm_lab's rules: ``pdm_lab.<rule>``.
LOSS_PREFIX = "pdm_lab."
#: Environment variable: K of μ's top-K; when set, importing the plugin applies the top-K patch set.
TOPK_ENV = VERL_TOPK_ENV


def mask_config(config: Any, rule: str) -> MaskConfig:
    """The ``MaskConfig`` of `rule` from a verl actor config's ``policy_loss.mask`` section."""
    section = {}
    policy_loss = getattr(config, "policy_loss", None)
    if policy_loss is not None:
        raw = policy_loss.get("mask", None) if hasattr(policy_loss, "get") else getattr(policy_loss, "mask", None)
        section = dict(raw or {})
    if "rule" in section and section["rule"] != rule:
        raise ValueError(f"policy_loss.mask.rule={section['rule']!r} contradicts loss_mode {LOSS_PREFIX}{rule}")
    section["rule"] = rule
    return from_dict(MaskConfig, section, where="policy_loss.mask")
