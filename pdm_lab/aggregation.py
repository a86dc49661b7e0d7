"""SPEC §5's aggregations of a per-token loss, on one rank or across data-parallel ranks.

A rank holds part of the batch the aggregate is defined over (a micro-batch of a mini-batch, one
rank's share of a data-parallel batch). Given the whole batch's counts once (``DPInfo``), each
part's loss is its share of the whole batch's aggregate, so no caller rescales a loss:

    Σ over parts of aggregate(part, dp=DPInfo(tokens, sequences, world=1)) = aggregate(whole)

and with ``world = W`` ranks whose gradients are averaged (FSDP, DDP) each part is multiplied by
W, so that the average is the whole batch's aggregate (verl's ``agg_loss`` does the same).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pdm_lab.errors import PDMInputError, check_same, check_tensor

#: the loss aggregations (SPEC §5); ``MaskConfig.aggregation`` is one of them.
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class DPInfo:
    """The counts of the whole batch that each part's loss is normalised by.

    Attributes:
        tokens: response tokens of the whole batch (every rank, every micro-batch); needed by
            ``token-mean``.
        sequences: sequences of the whole batch with at least one response token; needed by the
            ``seq-mean-*`` aggregations.
        world: ranks whose gradients are averaged after the backward (1: summed, or one rank).
    Numbers, or 0-d tensors (as the compiled loss passes them: a new count is then an input).
    """

    tokens: float | Tensor | None = None
    sequences: float | Tensor | None = None
    world: int | Tensor = 1

    @classmethod
    def all_reduce(cls, tokens: int, sequences: int, *, group=None, average_gradients: bool = True) -> "DPInfo":
        """This rank's counts (response tokens; sequences with one or more) summed over the
        ranks of `group`, in one collective; ``world`` is the group's size when the ranks'
        gradients are averaged. Without an initialised process group: these counts, world 1."""
        import torch.distributed as dist

        counts = torch.tensor([float(tokens), float(sequences)], dtype=torch.float64)
        world = 1
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
            world = dist.get_world_size(group) if average_gradients else 1
        total_tokens, total_sequences = counts.tolist()
        return cls(tokens=total_tokens, sequences=total_sequences, world=world)

    def count(self, mode: str) -> float | Tensor:
        """The whole batch's normaliser of aggregation `mode` (tokens or sequences)."""
        value = self.tokens if mode == "token-mean" else self.sequences
        if value is None:
            field = "tokens" if mode == "token-mean" else "sequences"
            raise PDMInputError(f"dp: aggregation {mode!r} needs DPInfo.{field}, the whole batch's count")
        return value


def aggregate(loss_mat: Tensor, response_mask: Tensor, mode: str = "token-mean",
              horizon: int | Tensor | None = None, *, dp: DPInfo | None = None) -> Tensor:
    """Reduce a [B, T] per-token loss over the response tokens.

    token-mean: Σ l·m / Σ m (DAPO). seq-mean-token-mean: mean over sequences of each one's token
    mean. seq-mean-token-sum: mean over sequences of token sums. seq-mean-token-sum-norm: mean
    over sequences of token sums / horizon (Dr. GRPO; horizon default T). Padding never counts;
    sequences with no response token are left out of the sequence means. `horizon` may be a 0-d
    tensor (as the compiled loss passes it).

    dp: this batch is a part of a larger one: the sums above are divided by the whole batch's
    count (``dp.tokens`` or ``dp.sequences``) instead of this part's, and multiplied by
    ``dp.world`` (module docstring).
    """
    if mode not in AGGREGATIONS:
        raise PDMInputError(f"aggregation: unknown {mode!r}; valid: {', '.join(AGGREGATIONS)}")
    check_tensor("loss_mat", loss_mat, ndim=2)
    check_same(("loss_mat", "response_mask"), loss_mat, response_mask)
    mask = response_mask.to(loss_mat.dtype)
    # select, don't multiply: a padding slot's loss may be inf, and inf·0 = NaN
    masked = torch.where(response_mask.bool(), loss_mat, 0.0)
    if mode == "token-mean":
        total, count = masked.sum(), mask.sum()
    else:
        counts = mask.sum(dim=1)
        has_tokens = counts > 0
        sums = masked.sum(dim=1)
        if mode == "seq-mean-token-mean":
            per_seq = sums / counts.clamp(min=1)
        elif mode == "seq-mean-token-sum":
            per_seq = sums
        else:
            if not isinstance(horizon, Tensor):
                horizon = float(horizon if horizon is not None else loss_mat.shape[1])
            per_seq = sums / horizon
        total, count = (per_seq * has_tokens).sum(), has_tokens.sum()
    if dp is None:
        return total / count.clamp(min=1)
    whole = dp.count(mode)
    whole = whole.clamp(min=1) if isinstance(whole, Tensor) else max(float(whole), 1.0)
    return total / whole * dp.world


__all__ = ["DPInfo", "aggregate"]
