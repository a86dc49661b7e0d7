"""What the verl adapters share without importing verl: the loss-name prefix, the switch of the
top-K patch set, and the mask and sampling-mask sections of a verl actor config (``verl``,
``verl_topk`` and ``verl_patches`` all read them; kept apart so they import it, not each other).

Each process logs the resolved mask config (every field, convention included) and sampling mask
once, at the first loss it computes (logger ``pdm_lab``), and with ``PDM_LAB_RECORD_DIR`` set
writes them to ``pdm_config.json`` there."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from pdm_lab.aggregation import DPInfo
from pdm_lab.config import from_dict, to_dict
from pdm_lab.mask_config import MaskConfig
from pdm_lab.sampling_mask import SamplingMask
from pdm_lab.integrations.launch_files import VERL_TOPK_ENV

#: verl ``loss_mode`` names of pdm_lab's rules: ``pdm_lab.<rule>``.
LOSS_PREFIX = "pdm_lab."
#: Environment variable: K of μ's top-K; when set, importing the plugin applies the top-K patch set.
TOPK_ENV = VERL_TOPK_ENV


#: Environment variable: a directory where each verl process writes its resolved ``pdm_config.json``.
RECORD_ENV = "PDM_LAB_RECORD_DIR"
_RECORDED: set[str] = set()


def _section(config: Any, name: str) -> dict:
    policy_loss = getattr(config, "policy_loss", None)
    if policy_loss is None:
        return {}
    raw = policy_loss.get(name, None) if hasattr(policy_loss, "get") else getattr(policy_loss, name, None)
    return dict(raw or {})


def sampling_setup(config: Any) -> SamplingMask | None:
    """The engine's sampling mask from ``policy_loss.sampling_mask`` ({top_k, top_p, min_p}: the
    rollout's own values, ``actor_rollout_ref.rollout.top_k/top_p``), or None when it cuts nothing."""
    section = _section(config, "sampling_mask")
    unknown = set(section) - {"top_k", "top_p", "min_p"}
    if unknown:
        raise ValueError(f"policy_loss.sampling_mask: unknown key(s) {sorted(unknown)}; valid: top_k, top_p, min_p")
    mask = SamplingMask.from_mapping(section)
    return mask if mask.active else None


def record_once(cfg: MaskConfig, sampling: SamplingMask | None, path: str) -> dict:
    """The resolved record of this process's loss (logged once per rule and path; written to
    ``$PDM_LAB_RECORD_DIR/pdm_config.json`` when that is set)."""
    record = {"mask": to_dict(cfg), "sampling_mask": None if sampling is None else sampling.as_dict(), "path": path}
    key = json.dumps(record, sort_keys=True)
    if key not in _RECORDED:
        _RECORDED.add(key)
        logging.getLogger("pdm_lab").info("pdm_lab verl loss, resolved: %s", key)
        folder = os.environ.get(RECORD_ENV, "").strip()
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / "pdm_config.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def mask_config(config: Any, rule: str) -> MaskConfig:
    """The ``MaskConfig`` of `rule` from a verl actor config's ``policy_loss.mask`` section."""
    section = _section(config, "mask")
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
    asked = _section(config, "mask").get("aggregation")
    if asked is not None and asked != loss_agg_mode:
        raise ValueError(f"policy_loss.mask.aggregation={asked!r} contradicts verl's loss_agg_mode={loss_agg_mode!r} "
                         "(verl's knob decides: set actor_rollout_ref.actor.loss_agg_mode)")
    info = dict(getattr(config, "global_batch_info", None) or {})
    horizon = info.get("loss_scale_factor")
    cfg = dataclasses.replace(cfg, aggregation=loss_agg_mode,
                              horizon=cfg.horizon if horizon is None else int(horizon))
    world = int(info.get("dp_size") or 1)
    tokens, sequences = info.get("batch_num_tokens"), info.get("global_batch_size")
    if (tokens if loss_agg_mode == "token-mean" else sequences) is None and world == 1:
        return cfg, None
    return cfg, DPInfo(tokens=tokens, sequences=sequences, world=world)
