"""What the verl adapters share without importing verl: the loss-name prefix, the switch of the
top-K patch set, and the mask section of a verl actor config (``verl``, ``verl_topk`` and
``verl_patches`` all read it; kept apart so they import it, not each other)."""
from __future__ import annotations

import dataclasses
from typing import Any

from ..aggregation import DPInfo
from ..config import from_dict
from pdm_lab.mask_config import MaskConfig
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


def loss_setup(config: Any, rule: str, loss_agg_mode: str) -> tuple[MaskConfig, DPInfo | None]:
    """`rule`'s ``MaskConfig`` aggregated as verl asks (``loss_agg_mode``; the horizon of
    ``seq-mean-token-sum-norm`` from ``global_batch_info.loss_scale_factor``, else the mask
    section's), and the ``DPInfo`` of verl's ``global_batch_info`` (``dp_size``,
    ``batch_num_tokens``, ``global_batch_size``): the core's aggregate then normalises each
    micro-batch as verl's ``agg_loss`` does. None where verl normalises locally (one rank, no
    global count)."""
    cfg = mask_config(config, rule)
    info = dict(getattr(config, "global_batch_info", None) or {})
    horizon = info.get("loss_scale_factor")
    cfg = dataclasses.replace(cfg, aggregation=loss_agg_mode,
                              horizon=cfg.horizon if horizon is None else int(horizon))
    world = int(info.get("dp_size") or 1)
    tokens, sequences = info.get("batch_num_tokens"), info.get("global_batch_size")
    if (tokens if loss_agg_mode == "token-mean" else sequences) is None and world == 1:
        return cfg, None
    return cfg, DPInfo(tokens=tokens, sequences=sequences, world=world)
