"""From a rollout batch to the core's inputs, and one masked policy-gradient loss.

Every divergence, Ḋ, mask and loss below comes from ``pdm_lab`` (support, policy_side, stats,
loss); this module only flattens [B, T] batches into the core's [N] token rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pdm_lab.config import ConfigError
from pdm_lab.kernel_direction import kernel_scores
from pdm_lab.mask_config import MaskConfig
from pdm_lab.loss import LossOutput, pdm_policy_loss
from pdm_lab.policy_side import policy_on_support
from pdm_lab.tokenwise import TokenStats, token_stats
from pdm_lab.support import Support, support_from_full

from pdm_lab.envs.problems.rollout import RolloutBatch


@dataclass(frozen=True)
class TokenBatch:
    """A (mini-)batch flattened for the core: N = B·T token rows, row-major over [B, T].

    Attributes:
        obs: [N, D] int64 observations (what π conditions on).
        support: μ's reduced support (``support_from_full``), N rows.
        mu_full: [N, n] float32 μ's full log-probabilities (enables ``exact`` and full KL).
        advantages: [B, T] float32 Â per token (0 on padding).
        response_mask: [B, T] bool.
    """

    obs: Tensor
    support: Support
    mu_full: Tensor
    advantages: Tensor
    response_mask: Tensor

    def select(self, rows: Tensor) -> "TokenBatch":
        """Sequences ``rows`` ([b] int64) of this batch, with their T token rows each."""
        horizon = self.advantages.shape[1]
        tok = (rows[:, None] * horizon + torch.arange(horizon)).reshape(-1)
        return TokenBatch(obs=self.obs[tok], support=self.support.take_rows(tok), mu_full=self.mu_full[tok],
                          advantages=self.advantages[rows], response_mask=self.response_mask[rows])

    def rows(self, tokens: Tensor) -> "TokenBatch":
        """Token rows ``tokens`` ([M] int64) alone, as an [M, 1] batch (one token per sequence)."""
        m = tokens.numel()
        return TokenBatch(obs=self.obs[tokens], support=self.support.take_rows(tokens), mu_full=self.mu_full[tokens],
                          advantages=self.advantages.reshape(-1)[tokens].view(m, 1),
                          response_mask=self.response_mask.reshape(-1)[tokens].view(m, 1))

    def single(self, token: int) -> "TokenBatch":
        """Token row ``token`` alone, as a [1, 1] batch."""
        return self.rows(torch.tensor([token]))

    @property
    def num_tokens(self) -> int:
        return self.obs.shape[0]


@torch.no_grad()
def token_batch(batch: RolloutBatch, advantages: Tensor, cfg: MaskConfig) -> TokenBatch:
    """Flatten a rollout batch and build μ's support with ``cfg.k`` and ``cfg.convention``.

    Args:
        batch: the rollout.
        advantages: [B] sequence advantages, broadcast to every response token.
        cfg: the mask config (K, convention).
    """
    b, t, n = batch.mu_logp.shape
    mu_full = batch.mu_logp.reshape(b * t, n)
    support = support_from_full(mu_full, batch.tokens.reshape(-1), k=cfg.k, convention=cfg.convention)
    adv = advantages[:, None] * batch.response_mask
    return TokenBatch(obs=batch.obs.reshape(b * t, -1), support=support, mu_full=mu_full,
                      advantages=adv.float(), response_mask=batch.response_mask)


def policy_unembedding(policy, rule: str = "pdm_kernel") -> Tensor:
    """W [n, d] of a toy policy whose logits are h Wᵀ + b: the transformer's ``unembedding()``, the
    neural policy's output layer ``w2`` [d, n] transposed. A tabular policy has none: its logits
    are the parameters (K = I, where ``pdm_topk`` is already the exact rule)."""
    if hasattr(policy, "unembedding"):
        return policy.unembedding().detach()
    if isinstance(getattr(policy, "w2", None), Tensor):
        return policy.w2.detach().T
    raise ConfigError(f"mask.rule: {rule!r} needs the policy's unembedding W, which the {type(policy).__name__} "
                      "has none of (policy: tabular); use policy neural or transformer")


def needs_full(cfg: MaskConfig) -> bool:
    """True if the rule or the direction metric uses the ``exact`` Ḋ (full distributions)."""
    return "full" in cfg.rule_record.needs or cfg.direction_estimator == "exact"


def masked_loss(policy, tokens: TokenBatch, cfg: MaskConfig, *, full: bool | None = None,
                optimizer=None) -> LossOutput:
    """π's forward pass on the batch and the core's masked loss (``pdm_policy_loss``).

    ``full`` passes both full distributions to the core (``exact`` Ḋ, full-KL metrics); by
    default only when the rule needs them, since they cost two extra [N, n] passes. A rule that
    needs ``coupled`` (``pdm_coupled``) gets c_t from ``envs/train/coupled_jvp.py``, preconditioned by
    ``optimizer``'s state (None: the identity). A rule that needs ``kernel`` (``pdm_kernel``) gets
    h_t = ⟨Wᵀg, Wᵀv⟩ from the policy's unembedding (``policy_unembedding``) and the core's
    ``kernel_scores``.
    """
    coupled = kernel = None
    if "coupled" in cfg.rule_record.needs:
        from pdm_lab.envs.train.coupled_jvp import toy_coupled_scores  # SPEC §3b: u by backward, g by JVP
        coupled = toy_coupled_scores(policy, tokens, cfg, optimizer).c
    logits = policy(tokens.obs)
    if "kernel" in cfg.rule_record.needs:  # SPEC §6d: the head kernel's term, from W and π
        kernel = kernel_scores(logits.detach(), policy_unembedding(policy, cfg.rule), tokens.support)
    pi = policy_on_support(logits, tokens.support.ids)
    if full is None:
        full = needs_full(cfg)
    pi_full = torch.log_softmax(logits.detach(), dim=-1) if full else None
    return pdm_policy_loss(pi, tokens.support, tokens.advantages, tokens.response_mask, cfg,
                           mu_full=tokens.mu_full if full else None, pi_full=pi_full, coupled=coupled,
                           kernel=kernel)


@torch.no_grad()
def current_stats(policy, tokens: TokenBatch, *, full: bool = True, binary: bool = False) -> TokenStats:
    """The core's per-token statistics (D, Ḋ, r, tails; full KL and exact Ḋ if ``full``; DPPO's
    binary divergences if ``binary``)."""
    logits = policy(tokens.obs)
    pi = policy_on_support(logits, tokens.support.ids)
    if not full:
        return token_stats(tokens.support, pi, binary=binary)
    return token_stats(tokens.support, pi, mu_full=tokens.mu_full,
                       pi_full=torch.log_softmax(logits, dim=-1), binary=binary)


