"""Where a flip comes from: a kept token's first-order ΔD split by whose update caused it (SPEC §6).

One SGD step on the token-sum loss moves θ by Δθ = Σ_groups Δθ_group, each group's part the
step of its tokens alone (the core's masked loss on those rows, with the rule's own keep
decisions). For a token t, the groups are

* ``own``     t itself;
* ``context`` the other tokens with the same context (the same observation row: the same μ, π);
* ``state``   the other tokens with the same trainable state but another context (the same input
              to the trainable part: the same table row, or the same network input);
* ``rest``    every other token of the batch (it reaches t only through shared weights),

and the first-order change of t's scored divergence from group g is ⟨∇_θ D_t, Δθ_g⟩, measured
as a float64 central difference of D_t along Δθ_g (D from the core, ``audit.measure``). ``rest``
is taken along Δθ − Δθ_own − Δθ_context − Δθ_state, so the four terms add up to the term along
the whole step (``total``), to the difference's third-order error.

SGD only: a fresh Adam step is a sign step, not a sum of the tokens' parts.
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from pdm_lab.audit.measure import FLIP_CAUSES
from pdm_lab.mask_config import MaskConfig

from pdm_lab.envs.policies.base import cached_input
from pdm_lab.envs.train.update import TokenBatch, masked_loss

#: the central difference is taken at ±this fraction of each group's step (third-order error
#: ~ this² relative to the first-order term; float64 rounding far below it).
DIFFERENCE_FRACTION = 0.1


#: fixed odd 62-bit multipliers of ``row_ids``'s hash (one per column, cycled).
_HASH_WEIGHTS = torch.randint(1, 2 ** 62, (4096,), generator=torch.Generator().manual_seed(20_261_202)) | 1


#: the integer type of each float width, to read a float row's exact bits
_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def row_hashes(flat: Tensor) -> Tensor:
    """[M, F] → [M] int64 hash of each row's bits (integer arithmetic wrapping mod 2⁶⁴, so equal rows
    hash equally whatever the summation order; every column has its own multiplier)."""
    bits = flat.contiguous().view(_BITS[flat.element_size()]) if flat.dtype.is_floating_point else flat
    columns = torch.arange(flat.shape[1])
    weights = _HASH_WEIGHTS[columns % _HASH_WEIGHTS.numel()] * (1 + columns // _HASH_WEIGHTS.numel())
    return (bits.long() * weights).sum(dim=1)


def row_ids(rows: Tensor) -> Tensor:
    """[M, F] → [M] int64 ids in 0…G−1, equal exactly when the rows are equal (G distinct rows).

    ``torch.unique(dim=0)`` sorts whole rows and takes seconds on an audit batch (10⁵ rows); this
    groups by ``row_hashes``, then checks every row against its group's first row and falls back
    to the row sort if two distinct rows ever share a hash."""
    m = rows.shape[0]
    if m == 0:
        return torch.zeros(0, dtype=torch.int64)
    flat = rows.reshape(m, -1)
    _, ids = torch.unique(row_hashes(flat), return_inverse=True)
    first = torch.full((int(ids.max()) + 1,), m, dtype=torch.int64).scatter_reduce(
        0, ids, torch.arange(m), reduce="amin")
    if not bool((flat == flat[first[ids]]).all()):
        return torch.unique(flat, dim=0, return_inverse=True)[1]
    return ids


def distinct_rows(rows: Tensor) -> int:
    """How many distinct rows [M, F] holds."""
    return int(row_ids(rows).max()) + 1 if rows.shape[0] else 0


def group_ids(model: nn.Module, tokens: TokenBatch) -> tuple[Tensor, Tensor]:
    """([N] context id, [N] trainable-state id) of each token row.

    The context is the whole observation row; the state is what the trainable part reads: the
    network's input (``input_key``), else the encoder's state index, else the row."""
    obs = tokens.obs
    context = cached_input(obs, ("context_ids",), row_ids)
    if hasattr(model, "input_key"):
        state = cached_input(obs, ("state_ids", type(model).__name__, getattr(model, "context_features", 0)),
                             lambda o: row_ids(model.input_key(o)))
    elif hasattr(model, "encoder"):
        state = model.encoder.state_index(obs)
    else:
        state = context
    return context, state


def step_of(model: nn.Module, tokens: TokenBatch, rows: Tensor, mask: MaskConfig, lr: float,
            keep: Tensor) -> list[Tensor]:
    """SGD's Δθ (−η ∇ of the token-sum loss) from the token `rows` alone; `keep`: the rule's
    decisions on the whole batch, which the sub-batch must reproduce (per-token rules)."""
    params = list(model.parameters())
    if rows.numel() == 0:
        return [torch.zeros_like(p) for p in params]
    sub = tokens.rows(rows)
    out = masked_loss(model, sub, mask)
    if not torch.equal(out.keep.reshape(-1) > 0, keep[rows]):
        raise RuntimeError(f"{mask.rule}: the keep decisions of a sub-batch differ from the batch's "
                           "(the flip decomposition needs a per-token rule)")
    grads = torch.autograd.grad(out.loss * sub.response_mask.sum(), params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else -lr * g for p, g in zip(params, grads)]


def _directional(model: nn.Module, measure, row: TokenBatch, step: list[Tensor], name: str) -> float:
    """Central difference of D_t along `step` (its first-order change), float64."""
    h = DIFFERENCE_FRACTION
    start = [p.detach().clone() for p in model.parameters()]
    values = []
    for sign in (1.0, -1.0):
        with torch.no_grad():
            for p, p0, d in zip(model.parameters(), start, step):
                p.copy_(p0 + sign * h * d)
        values.append(float(measure(model, row)[name][0]))
    with torch.no_grad():
        for p, p0 in zip(model.parameters(), start):
            p.copy_(p0)
    return (values[0] - values[1]) / (2 * h)


def decompose(model: nn.Module, tokens: TokenBatch, mask: MaskConfig, lr: float, keep: Tensor,
              targets: Tensor, name: str, measure, *, everything: list[Tensor] | None = None) -> list[dict]:
    """Per token in `targets` ([P] int64 rows): its first-order ΔD of divergence `name` from each
    cause of ``FLIP_CAUSES`` and in ``total``, under the rule's step (keep mask `keep`, SGD at
    `lr`, the token-sum loss).

    ``measure(model, tokens) -> {name: [M] D}`` is the audit's float64 measurement; ``everything``:
    the whole batch's Δθ if already taken (the rule's own SGD step), else computed here."""
    model = copy.deepcopy(model)
    context, state = group_ids(model, tokens)
    if everything is None:
        everything = step_of(model, tokens, torch.arange(tokens.num_tokens), mask, lr, keep)
    out = []
    for t in targets.tolist():
        others = torch.arange(tokens.num_tokens) != t
        groups = {"own": torch.tensor([t]),
                  "context": torch.nonzero(others & (context == context[t]))[:, 0],
                  "state": torch.nonzero(others & (context != context[t]) & (state == state[t]))[:, 0]}
        steps = {g: step_of(model, tokens, rows, mask, lr, keep) for g, rows in groups.items()}
        steps["rest"] = [a - sum(parts) for a, *parts in zip(everything, *steps.values())]
        row = tokens.single(t)
        terms = {g: _directional(model, measure, row, steps[g], name) for g in FLIP_CAUSES}
        terms["total"] = _directional(model, measure, row, everything, name)
        terms.update(row=t, context_tokens=int(groups["context"].numel()), state_tokens=int(groups["state"].numel()))
        out.append(terms)
    return out
