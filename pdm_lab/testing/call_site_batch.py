"""One batch as a rollout engine and a trainer hand it to a loss, for the call-site equality tests.

The scaling loop, the TRL trainer and the verl losses each take μ's top-K in their own layout of
vLLM's answer and the trainer's logits in their own layout. ``call_site_batch`` draws one batch
and writes it in every layout, so that a test in each environment (core, TRL, verl) feeds its
call site the same numbers and compares the loss, its gradient and the parsed top-K with the
core's on the same tensors (``core_loss``).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from pdm_lab.aggregation import DPInfo
from pdm_lab.mask_config import MaskConfig
from pdm_lab.engine_topk import EngineTopK
from pdm_lab.loss import LossOutput, pdm_policy_loss
from pdm_lab.padding import PAD_ID, PAD_LOGP, PAD_SAMPLED, PAD_SAMPLED_LOGP
from pdm_lab.policy_side import policy_on_support
from pdm_lab.support import support_from_topk, topk_lower_id_ties


@dataclass
class CallSiteBatch:
    """B responses of lengths ``lengths`` (≤ T) over a vocabulary of n tokens, μ's top-K.

    Attributes:
        logits: [B·T, n] float64 leaf (requires grad): the trainer's logits predicting each
            response position (rows past a response's end are never read).
        mu_logp: [B·T, n] float32 μ's processed log-probs, as the engine reports them.
        topk: ``EngineTopK`` [B, T, K] / [B, T]: μ's top-K (ties: lower id), padded by
            ``pdm_lab.padding``'s rule, taken straight from ``mu_logp`` (what a parser must give).
        advantages: [B, T] float64 (float32 values), one Â per response; response_mask: [B, T] bool.
    """

    logits: Tensor
    mu_logp: Tensor
    topk: EngineTopK
    advantages: Tensor
    response_mask: Tensor
    lengths: list[int]
    k: int

    @property
    def vocab_size(self) -> int:
        return self.logits.shape[1]

    def completions(self) -> list[list[int]]:
        """Each response's sampled tokens."""
        return [self.topk.sampled[b, :n].tolist() for b, n in enumerate(self.lengths)]

    def _entries(self, b: int, j: int) -> list[tuple[int, float]]:
        """vLLM's entries of response b, position j: the top-K by rank, then k if outside it."""
        ids, logp = self.topk.ids[b, j].tolist(), self.topk.logp[b, j].tolist()
        entries = [(i, lp) for i, lp in zip(ids, logp) if i != PAD_ID]
        tok = int(self.topk.sampled[b, j])
        if tok not in ids:
            entries.append((tok, float(self.topk.sampled_logp[b, j])))
        return entries

    def vllm_dicts(self) -> list[list[dict[int, Any]]]:
        """Per response, per position ``{token_id: Logprob}`` (``CompletionOutput.logprobs``)."""
        return [[{i: SimpleNamespace(logprob=lp, rank=r + 1) for r, (i, lp) in enumerate(self._entries(b, j))}
                 for j in range(n)] for b, n in enumerate(self.lengths)]

    def vllm_ranked(self) -> tuple[list, list]:
        """(log-probs, ids) per response and position sorted by rank, as TRL hands them on."""
        rows = [[self._entries(b, j) for j in range(n)] for b, n in enumerate(self.lengths)]
        return ([[[lp for _, lp in pos] for pos in seq] for seq in rows],
                [[[i for i, _ in pos] for pos in seq] for seq in rows])

    def vllm_flat(self) -> list[SimpleNamespace]:
        """Per response the fields of vLLM's ``FlatLogprobs``: K + 1 entries per position, the
        sampled token first (again in its top-K slot when it is there)."""
        out = []
        for b, n in enumerate(self.lengths):
            ids, logp = [], []
            for j in range(n):
                ids += [int(self.topk.sampled[b, j])] + self.topk.ids[b, j].tolist()
                logp += [float(self.topk.sampled_logp[b, j])] + self.topk.logp[b, j].tolist()
            out.append(SimpleNamespace(token_ids=ids, logprobs=logp))
        return out

    def core_loss(self, cfg: MaskConfig, *, rows: Tensor | None = None, dp: DPInfo | None = None,
                  compiled: bool = False) -> LossOutput:
        """The core's loss on the sequences `rows` (all by default): ``support_from_topk``,
        ``policy_on_support`` on the logits' rows, ``pdm_policy_loss``."""
        rows = torch.arange(len(self.lengths)) if rows is None else rows
        t, k = self.response_mask.shape[1], self.k
        resp = self.response_mask[rows]
        flat = (rows[:, None] * t + torch.arange(t)).reshape(-1)
        support = support_from_topk(self.topk.ids[rows].reshape(-1, k), self.topk.logp[rows].reshape(-1, k),
                                    self.topk.sampled[rows].reshape(-1), self.topk.sampled_logp[rows].reshape(-1),
                                    vocab_size=self.vocab_size, k=k, convention=cfg.convention,
                                    row_mask=resp.reshape(-1))
        pi = policy_on_support(self.logits[flat], support.ids)
        return pdm_policy_loss(pi, support, self.advantages[rows], resp, cfg, dp=dp, compiled=compiled)


def call_site_batch(seed: int = 0, *, b: int = 4, t: int = 6, n: int = 48, k: int = 5,
                    mismatch: float = 0.6) -> CallSiteBatch:
    """A batch whose μ and π differ enough that every rule drops some tokens (LLM-like peaked
    rows; one response stops after a single token, one fills T)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(b * t, n, generator=gen, dtype=torch.float64) * 2.5
    mu_logp = torch.log_softmax(z, -1).float()
    logits = (z + mismatch * torch.randn(b * t, n, generator=gen, dtype=torch.float64)).requires_grad_()
    sampled = torch.multinomial(mu_logp.double().exp(), 1, generator=gen)[:, 0]
    lengths = ([t, 1] + torch.randint(1, t + 1, (b - 2,), generator=gen).tolist())[:b]
    resp = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    ids, logp = topk_lower_id_ties(mu_logp, k)
    flat_resp = resp.reshape(-1)
    topk = EngineTopK(
        ids=torch.where(flat_resp[:, None], ids, PAD_ID).reshape(b, t, k),
        logp=torch.where(flat_resp[:, None], logp, PAD_LOGP).reshape(b, t, k),
        sampled=torch.where(flat_resp, sampled, PAD_SAMPLED).reshape(b, t),
        sampled_logp=torch.where(flat_resp, mu_logp.gather(1, sampled[:, None])[:, 0],
                                 PAD_SAMPLED_LOGP).reshape(b, t))
    sign = torch.tensor([1.0, -1.0] * b, dtype=torch.float64)[:b]
    # float32 values (in float64): a caller that carries Â in float32, as TRL does, loses nothing
    adv = (sign * (0.5 + torch.rand(b, generator=gen))).double()[:, None].expand(b, t) * resp
    return CallSiteBatch(logits=logits, mu_logp=mu_logp, topk=topk, advantages=adv.contiguous(),
                         response_mask=resp, lengths=lengths, k=k)


__all__ = ["CallSiteBatch", "call_site_batch"]
