"""The masked policy loss (SPEC §5): the one loss tail the toys, the scaling loop, TRL and verl
call (``pdm_lab.reference_loss`` is the same loss in plain eager torch, top to bottom)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from pdm_lab.aggregation import DPInfo, aggregate
from pdm_lab.fast.compiled import compile_default, maybe_compiled, one_thread
from pdm_lab.mask_config import MaskConfig
from pdm_lab.errors import PDMInputError, check_same, check_tensor
from pdm_lab.loss_checks import check_loss_finite, check_loss_inputs
from pdm_lab.masks import compute_mask, get_mask_rule, outside_region
from pdm_lab.metrics import MetricSums, finalize, step_metric_sums
from pdm_lab.policy_side import PolicyOnSupport
from pdm_lab.tokenwise import TokenStats, token_stats
from pdm_lab.support import Support


@dataclass(frozen=True)
class LossOutput:
    """loss: scalar (differentiable); keep: [B, T] mask; stats: per-token [N]; metrics: namespaced
    0-d tensors (NaN where no token counted); metric_sums: the same as mergeable sums
    (``pdm_lab.metrics.merge_metrics`` over mini-batches, ranks, seeds)."""

    loss: Tensor
    keep: Tensor
    stats: TokenStats
    metrics: dict[str, Tensor]
    metric_sums: MetricSums


def token_surrogate(logp_k: Tensor, mu_logp_k: Tensor, advantages: Tensor, keep: Tensor,
                    clip_ratio_c: float | Tensor | None = None) -> Tensor:
    """Per-token loss whose gradient is −M·min(r, c)·Â·∇log π_k (M, the cap: constants).

    Value −M·Â·min(r, c), computed as exp(log r + sg(min(0, log c − log r))) so the cap never
    forms r itself (r = e^{110} overflows; min(r, c)/r was 0/0) and r still carries the gradient.
    Dropped tokens (M = 0) and Â = 0 are *selected* to exactly 0 before any exponential, never
    multiplied by 0: 0·inf = NaN, and a dropped token's log r may be anything finite.
    A kept, uncapped token whose r overflows the dtype (log r > ~88 in float32) is +inf: that is
    the true value, which only a cap (``clip_ratio_c``) or the mask bounds. The cap c is a number,
    or a 0-d tensor (the compiled loss passes it so: a new c is then an input, not a recompile).
    """
    log_ratio = logp_k - mu_logp_k.detach()
    active = keep.detach().bool() & (advantages.detach() != 0)
    # select before exp: the unselected branch gets an exactly-zero gradient, not 0·inf
    log_ratio = torch.where(active, log_ratio, 0.0)
    if clip_ratio_c is not None:  # TIS cap in log space: log min(r, c) = log r + min(0, log c − log r)
        log_cap = clip_ratio_c.log() if isinstance(clip_ratio_c, Tensor) else math.log(clip_ratio_c)
        log_scale = torch.clamp(log_cap - log_ratio.detach(), max=0.0)
        log_ratio = log_ratio + log_scale
    value = -advantages.detach() * torch.exp(log_ratio)
    return torch.where(active, value, 0.0)


def pdm_policy_loss(pi: PolicyOnSupport, support: Support, advantages: Tensor,
                    response_mask: Tensor, cfg: MaskConfig, *, mu_full: Tensor | None = None,
                    pi_full: Tensor | None = None, compiled: bool | None = None,
                    coupled: Tensor | None = None, kernel: Tensor | None = None,
                    dp: DPInfo | None = None) -> LossOutput:
    """Masked, optionally capped, aggregated policy-gradient loss with its per-step metrics.

    Args:
        pi: π on the support, from ``policy_on_support`` (``logp`` carries the gradient).
        support: μ's reduced support; N = B·T rows, row-major over [B, T].
        advantages: [B, T] Â per token (group-normalised upstream).
        response_mask: [B, T] bool/0-1, padding = 0.
        cfg: the mask section (rule, δ, K, convention, estimator, cap, aggregation).
        mu_full, pi_full: [N, n] full log-probabilities (toys): enable ``exact`` and full KL.
        compiled: the compiled stats path (see ``token_stats``) and the surrogate, aggregation and
            metrics as one compiled graph; default from ``PDM_LAB_COMPILE``. Tested equal to eager.
        coupled: [N] c_t of SPEC §3b (``pdm_lab.coupled.coupled_scores``), for ``pdm_coupled``.
        kernel: [N] h_t = ⟨Wᵀg, Wᵀv⟩ (``pdm_lab.kernel_direction.kernel_scores``), for ``pdm_kernel``.
        dp: this batch is a part (micro-batch, rank) of a larger one: the loss is this part's
            share of the whole batch's aggregate (``pdm_lab.aggregation``); the metric sums stay
            this part's own, to be merged (``merge_metrics``, ``all_reduce_metrics``).
    """
    check_tensor("advantages", advantages, ndim=2, floating=True)
    check_same(("advantages", "response_mask"), advantages, response_mask)
    check_loss_inputs(support, response_mask, cfg, coupled, kernel)
    n_tokens = advantages.numel()
    if support.ids.shape[0] != n_tokens:
        raise PDMInputError(f"support has {support.ids.shape[0]} rows but advantages {tuple(advantages.shape)} "
                            f"has {n_tokens} tokens (N must equal B·T)")
    stats = token_stats(support, pi, mu_full=mu_full, pi_full=pi_full, compiled=compiled,
                        binary=get_mask_rule(cfg.rule).binary_stats)
    if coupled is not None:
        stats = dataclasses.replace(stats, coupled=coupled.detach().reshape(-1).to(stats.ratio.dtype))
    if kernel is not None:
        stats = dataclasses.replace(stats, kernel=kernel.detach().reshape(-1).to(stats.ratio.dtype))
    compile_tail = (compile_default() if compiled is None else compiled) and n_tokens > 0
    with one_thread(stats.ratio.device):  # [N] vectors: see compiled.one_thread
        adv = advantages.reshape(-1).to(stats.ratio.dtype)
        resp = response_mask.reshape(-1).bool()
        adv = torch.where(resp, adv, 0.0)  # padding carries no advantage
        keep = compute_mask(cfg, stats, adv, response_mask)  # validates; reads δ (never compiled)
        outside = outside_region(stats.topk_kl, adv, cfg) & resp
        if not compile_tail:
            loss, sums = _surrogate_and_metrics(pi.logp, support.mu_logp, support.k_index, adv, keep,
                                                response_mask, stats, outside, cfg.clip_ratio_c, cfg.aggregation,
                                                cfg.horizon, cfg.direction_estimator, dp)
    if compile_tail:  # one graph forward, one backward, on torch's threads (few kernels, few joins)
        # Torch 2.13's guard builder fails ("sources must not be empty for symbol …") on inputs
        # that alias (resp, a view of response_mask: ``compiled.unaliased`` would copy it) and on
        # a number that changed between calls: so resp is derived inside, and the cap and horizon
        # go in as tensors (a new value is then an input, not a recompile).
        cap = None if cfg.clip_ratio_c is None else torch.tensor(float(cfg.clip_ratio_c), dtype=torch.float64)
        horizon = torch.tensor(float(cfg.horizon if cfg.horizon is not None else response_mask.shape[1]),
                               dtype=torch.float64)
        loss, sums = maybe_compiled(_surrogate_and_metrics, True)(
            pi.logp, support.mu_logp, support.k_index, adv, keep, response_mask, stats, outside, cap,
            cfg.aggregation, horizon, cfg.direction_estimator, _as_tensors(dp))
    if not bool(torch.isfinite(loss.detach()).all()):  # located only on failure
        logp_k = pi.logp.gather(1, support.k_index[:, None])[:, 0]
        mu_k = support.mu_logp.gather(1, support.k_index[:, None])[:, 0].to(logp_k.dtype)
        per_token = token_surrogate(logp_k, mu_k, adv, keep, cfg.clip_ratio_c)
        check_loss_finite(loss, per_token.reshape(advantages.shape), adv, (logp_k - mu_k).detach())
    return LossOutput(loss=loss, keep=keep.reshape(advantages.shape), stats=stats, metrics=finalize(sums),
                      metric_sums=sums)


def _surrogate_and_metrics(pi_logp: Tensor, mu_logp: Tensor, k_index: Tensor, adv: Tensor, keep: Tensor,
                           response_mask: Tensor, stats: TokenStats, outside: Tensor,
                           clip_ratio_c: float | Tensor | None, aggregation: str, horizon: int | Tensor | None,
                           estimator: str, dp: DPInfo | None = None) -> tuple[Tensor, MetricSums]:
    """The per-token tail of ``pdm_policy_loss`` after the mask: surrogate, aggregation, metric
    sums. Eager, or one compiled graph (with its backward). It reads the cap, the aggregation,
    the horizon and the direction estimator, never δ (the mask and `outside` come in decided),
    so a schedule of δ does not recompile it."""
    logp_k = pi_logp.gather(1, k_index[:, None])[:, 0]
    mu_logp_k = mu_logp.gather(1, k_index[:, None])[:, 0].to(logp_k.dtype)
    per_token = token_surrogate(logp_k, mu_logp_k, adv, keep, clip_ratio_c)
    loss = aggregate(per_token.reshape(response_mask.shape), response_mask, aggregation, horizon, dp=dp)
    resp = response_mask.reshape(-1).bool()
    return loss, step_metric_sums(stats, keep, adv, resp, None, outside=outside, estimator=estimator,
                                  cap=clip_ratio_c, layout=tuple(response_mask.shape))


def _as_tensors(dp: DPInfo | None) -> DPInfo | None:
    """`dp` with its counts as 0-d float64 tensors: the compiled tail takes a new count as an
    input instead of recompiling for it (the counts change every step)."""
    if dp is None:
        return None
    as_t = lambda x: None if x is None else torch.as_tensor(x, dtype=torch.float64)  # noqa: E731
    return DPInfo(tokens=as_t(dp.tokens), sequences=as_t(dp.sequences), world=as_t(dp.world))
