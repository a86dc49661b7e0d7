"""pdm_lab as a verl plugin: every sampled-token rule as a verl policy loss (bypass mode).

Installed with pdm_lab, the ``verl.plugins`` entry point ``pdm_lab`` makes ``import verl`` (in
every worker) import this module, which registers ``pdm_lab.<rule>`` for each rule that decides
from the sampled token's log-probs (``sampled_token_rules()``) through verl's public
``register_policy_loss``. Select one and give its mask section through the config class::

    actor_rollout_ref.actor.policy_loss._target_=pdm_lab.integrations.verl.PDMPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=pdm_lab.dppo_binary_kl
    +actor_rollout_ref.actor.policy_loss.mask={delta:0.15}
    algorithm.rollout_correction.bypass_mode=true        # old_log_prob = μ (the rollout's)

verl 0.9.1's ``apply_bypass_mode`` overwrites ``loss_mode`` with its own ``bypass_mode`` loss;
``patch_bypass_mode()`` (applied on import, version-checked) keeps a ``pdm_lab.*`` loss_mode
while still substituting the rollout log-probs. Top-K rules need μ's top-K carried from the
rollout: with ``PDM_LAB_VERL_TOPK=K`` in every verl process, this module also applies the
versioned runtime patch set (``pdm_lab.integrations.verl_patches``), which registers them.

A registration that fails (an untested verl version, a verl internal that moved, a broken
install) is logged at WARNING with its cause on logger ``pdm_lab.integrations.verl``, then
re-raised: verl's own plugin loader catches it and logs it only at DEBUG, so without this the
``pdm_lab.*`` loss modes would just be unknown later; re-raising keeps a direct import (and
verl's loader) seeing the real error, and leaves no half-registered plugin behind.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any

import torch

LOG = logging.getLogger(__name__)


def _registration_failed(err: BaseException) -> None:
    """The WARNING a failed registration leaves (verl's plugin loader logs it only at DEBUG)."""
    LOG.warning("pdm_lab's verl plugin (%s) failed to load: %s: %s; what it had not registered yet (pdm_lab.* "
                "loss modes, the bypass-mode patch, the top-K patch set) is unknown to verl", __name__,
                type(err).__name__, err)


try:
    from pdm_lab.loss import pdm_policy_loss
    from pdm_lab.integrations.sampled_token import sampled_token_rules, sampled_token_view
    from pdm_lab.integrations.verl_config import LOSS_PREFIX, TOPK_ENV, loss_setup, mask_config, record_once, sampling_setup  # noqa: F401
    from pdm_lab.integrations.verl_rollout_correction import verl_rollout_correction
    from pdm_lab.integrations.versions import require_version

    VERL_VERSION = require_version("verl")

    from verl.trainer.ppo.core_algos import register_policy_loss  # noqa: E402
    from verl.workers.config.actor import PolicyLossConfig  # noqa: E402
except Exception as _err:
    _registration_failed(_err)
    raise


@dataclasses.dataclass
class PDMPolicyLossConfig(PolicyLossConfig):
    """verl's policy-loss section plus pdm_lab's mask section (``MaskConfig`` fields, minus rule).

    ``mask`` is checked like every pdm_lab config: an unknown key is an error naming the nearest.
    The rule comes from ``loss_mode`` (``pdm_lab.<rule>``).
    """

    mask: dict = dataclasses.field(default_factory=dict)
    sampling_mask: dict = dataclasses.field(default_factory=dict)
    """The rollout's top_k/top_p/min_p (``pdm_lab.sampling_mask``): the top-K rules take π over
    the tokens the engine could sample. Sampled-token rules refuse a cutting one (verl hands them
    log π_k of the full softmax, with no cut mass to renormalise by)."""


def pdm_verl_loss(rule: str, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                  response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                  rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``PolicyLossFn`` for `rule`: [B, T] log μ_k (bypass mode: the rollout's), log π_k.

    The core's loss (``pdm_policy_loss``) on the one-slot support S = {k}
    (``sampled_token_view``), aggregated by ``loss_agg_mode`` with verl's global batch counts
    (``loss_setup``: the normalisation verl's ``agg_loss`` applies). Tested equal, value and
    gradient, to ``pdm_policy_loss`` on μ's top-K support (tests_frameworks/verl).
    """
    if rollout_is_weights is not None:
        raise ValueError(f"{LOSS_PREFIX}{rule}: rollout_is_weights given; pdm_lab's rules replace IS "
                         "weighting and compute neither sequence-level TIS (rollout_is=sequence) nor "
                         "two-sided thresholds (rollout_is_threshold='lower_upper'): set "
                         "algorithm.rollout_correction.rollout_is=null; pdm_lab's only cap is the "
                         "token-level upper one, mask.clip_ratio_c")
    response_mask, corr_metrics = verl_rollout_correction(rule, config, old_log_prob, log_prob, response_mask)
    cfg, dp = loss_setup(config, rule, loss_agg_mode)
    if sampling_setup(config) is not None:
        raise ValueError(f"{LOSS_PREFIX}{rule}: policy_loss.sampling_mask cuts, but a sampled-token loss sees log π_k "
                         "of verl's full softmax; use a top-K rule with PDM_LAB_VERL_TOPK to renormalise π over the "
                         "engine's sampling set")
    record_once(cfg, None, "sampled_token")
    support, pi = sampled_token_view(old_log_prob.reshape(-1).to(log_prob.dtype), log_prob.reshape(-1))
    out = pdm_policy_loss(pi, support, advantages.to(log_prob.dtype), response_mask.bool(), cfg, dp=dp)
    # one-slot support: the top-K and Ḋ metrics would describe S = {k}, so only these are reported
    # (corr/*: verl's rollout-correction metrics, functions of log r alone); on S = {k} the top-K
    # KL is the binary KL (μ_T = 1 − μ_k, π_T = 1 − π_k)
    shown = {k: v for k, v in out.metrics.items()
             if k.startswith(("mask/frac_dropped", "ratio/", "tokens/", "corr/"))}
    shown["div/binary_kl_mean"] = out.metrics["div/topk_kl_mean"]
    metrics = {f"actor/pdm/{k}": float(v) for k, v in shown.items()}
    metrics.update(verl_pg_metrics(old_log_prob, log_prob, response_mask, out.keep.reshape(log_prob.shape),
                                   cfg.clip_ratio_c))
    metrics.update(corr_metrics)
    return out.loss, metrics


@torch.no_grad()
def verl_pg_metrics(old_log_prob: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor,
                    keep: torch.Tensor, clip_ratio_c: float | None) -> dict[str, float]:
    """verl's own ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower`` for a mask
    loss, as verl 0.9.1's mask losses (``compute_policy_loss_dppo_tv`` / ``_dppo_kl``) define
    them, with pdm_lab's mask M as their ``valid_mask`` and ``mask.clip_ratio_c`` as their
    ``clip_ratio_c`` (the TIS cap on r; none: nothing is truncated, so 0):

    - ``ppo_kl`` = masked_mean(−clamp(log π − log μ, ±20)) over response tokens;
    - ``pg_clipfrac`` = masked_mean(1 − M): the fraction of response tokens the mask drops;
    - ``pg_clipfrac_lower`` = masked_mean((r > c)·M): kept tokens whose ratio the cap truncates.
    """
    from verl.utils.torch_functional import masked_mean

    mask = response_mask.to(log_prob.dtype)
    neg_kl = torch.clamp(log_prob.detach() - old_log_prob.detach(), min=-20.0, max=20.0)
    valid = keep.detach().to(log_prob.dtype)
    ratio = torch.exp(neg_kl)
    lower = (torch.zeros_like(valid) if clip_ratio_c is None else (ratio > clip_ratio_c).to(valid.dtype) * valid)
    return {"actor/pg_clipfrac": masked_mean(1.0 - valid, mask).item(),
            "actor/ppo_kl": masked_mean(-neg_kl, mask).item(),
            "actor/pg_clipfrac_lower": masked_mean(lower, mask).item()}


def register_all() -> tuple[str, ...]:
    """Register ``pdm_lab.<rule>`` for every sampled-token rule; returns the loss_mode names."""
    names = []
    for rule in sampled_token_rules():
        name = f"{LOSS_PREFIX}{rule}"
        register_policy_loss(name)(functools.partial(pdm_verl_loss, rule))
        names.append(name)
    return tuple(names)


def patch_bypass_mode() -> bool:
    """Keep a ``pdm_lab.*`` loss_mode through verl 0.9.1's ``apply_bypass_mode`` (which sets
    old_log_probs = rollout_log_probs, then forces its own loss). Idempotent; returns True if
    applied now."""
    from verl.trainer.ppo import rollout_corr_helper

    original = rollout_corr_helper.apply_bypass_mode
    if getattr(original, "_pdm_lab", False):
        return False

    @functools.wraps(original)
    def apply_bypass_mode(batch, rollout_corr_config=None, policy_loss_config=None):
        mode = policy_loss_config.get("loss_mode", None) if policy_loss_config is not None else None
        original(batch, rollout_corr_config=rollout_corr_config, policy_loss_config=policy_loss_config)
        if isinstance(mode, str) and mode.startswith(LOSS_PREFIX):
            from omegaconf import open_dict

            with open_dict(policy_loss_config):
                policy_loss_config["loss_mode"] = mode

    apply_bypass_mode._pdm_lab = True
    rollout_corr_helper.apply_bypass_mode = apply_bypass_mode
    return True


try:
    LOSS_MODES = register_all()
    patch_bypass_mode()
    if os.environ.get(TOPK_ENV, "").strip():  # the top-K patch set, K from the environment
        from pdm_lab.integrations.verl_patches import apply_from_env  # noqa: E402

        apply_from_env()
except Exception as _err:
    _registration_failed(_err)
    raise
