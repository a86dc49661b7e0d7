"""vLLM's top-K log-probs → the tensors ``support_from_topk`` takes: the one parser every caller uses.

Asked for ``logprobs=K`` (``logprobs_mode="processed_logprobs"``: after temperature and
top-k/top-p, the distribution sampled), vLLM answers each generated position with μ's K most
probable tokens and the sampled token — first in the flat layout (``flat_logprobs=True``: K + 1
entries, the sampled one possibly repeated), or one more dict entry when it is outside the top-K.
TRL hands the same on as lists sorted by rank, verl as the ``{token_id: Logprob}`` dicts. The
three readers below only lay their layout out as [T, M] entries; ``topk_from_entries`` decides:

    log μ_k   the log-prob of the entry whose id is the sampled token (none: an error naming it)
    TopK      the K largest log-probs among the entries' distinct ids, ties to the lower id (SPEC §2)
    padding   fewer than K distinct ids: id −1 at log-prob −inf (``pdm_lab.padding``)

A processed log-prob is finite or −inf (a token cut by top-k/top-p); NaN, +inf or a missing value
(TRL passes vLLM's NaN on as None) is bad input and raises, naming the response and position.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from pdm_lab.errors import PDMInputError
from pdm_lab.fast.rowops import order_rows
from pdm_lab.padding import PAD_ID, PAD_LOGP, PAD_SAMPLED, PAD_SAMPLED_LOGP, pad_to_length

_FILL = {"ids": PAD_ID, "logp": PAD_LOGP, "sampled": PAD_SAMPLED, "sampled_logp": PAD_SAMPLED_LOGP}


@dataclass(frozen=True)
class EngineTopK:
    """μ's top-K at the positions of one response ([T, …]) or of a padded batch ([B, T, …]).

    Attributes:
        ids: [..., K] int64 TopK ids by log-prob descending (ties: lower id), −1 at padding.
        logp: [..., K] float32 their processed log μ, −inf at padding.
        sampled: [...] int64 the sampled tokens k (0 past a response's end).
        sampled_logp: [...] float32 log μ_k (0 past a response's end).
    """

    ids: Tensor
    logp: Tensor
    sampled: Tensor
    sampled_logp: Tensor

    def rows(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(topk_ids [N, K], topk_logp [N, K], sampled [N], sampled_logp [N]), N = B·T: the first
        four arguments of ``support_from_topk``."""
        k = self.ids.shape[-1]
        return (self.ids.reshape(-1, k), self.logp.reshape(-1, k), self.sampled.reshape(-1),
                self.sampled_logp.reshape(-1))


def _where(response: int | None) -> str:
    return "vLLM log-probs" if response is None else f"vLLM log-probs of response {response}"


def topk_from_entries(ids: Any, logp: Any, sampled: Any, k: int, *, response: int | None = None) -> EngineTopK:
    """[T, M] entries of T positions (ids −1 where a position has fewer than M) and the [T]
    sampled tokens → ``EngineTopK`` of the response ([T, K]). See the module docstring."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    logp = torch.as_tensor(logp, dtype=torch.float32)
    sampled = torch.as_tensor(sampled, dtype=torch.long).reshape(-1)
    t = sampled.shape[0]
    if t == 0:
        return EngineTopK(ids=torch.full((0, k), PAD_ID), logp=torch.full((0, k), PAD_LOGP), sampled=sampled,
                          sampled_logp=torch.zeros(0))
    ids, logp = ids.reshape(t, -1), logp.reshape(t, -1)
    if ids.shape != logp.shape:
        raise PDMInputError(f"{_where(response)}: {tuple(ids.shape)} ids but {tuple(logp.shape)} log-probs")
    pad = ids < 0
    logp = logp.masked_fill(pad, PAD_LOGP)
    bad = torch.isnan(logp) | (logp == math.inf)
    if bool(bad.any()):
        j, c = (int(i) for i in torch.nonzero(bad)[0])
        raise PDMInputError(f"{_where(response)}, position {j}: token {int(ids[j, c])} has log-prob "
                            f"{float(logp[j, c])} (NaN, +inf or missing); a processed log-prob is finite or −inf")
    match = ids == sampled[:, None]
    found = match.any(dim=1)
    if not bool(found.all()):
        j = int(torch.nonzero(~found)[0, 0])
        raise PDMInputError(f"{_where(response)}, position {j}: no entry for the sampled token {int(sampled[j])} "
                            f"(ids {ids[j].tolist()})")
    sampled_logp = logp.gather(1, match.to(torch.uint8).argmax(dim=1, keepdim=True))[:, 0]
    if bool((sampled_logp == PAD_LOGP).any()):
        j = int(torch.nonzero(sampled_logp == PAD_LOGP)[0, 0])
        raise PDMInputError(f"{_where(response)}, position {j}: the sampled token {int(sampled[j])} has "
                            "log-prob −inf (μ sampled it, so μ_k > 0)")
    # an id seen earlier in the row is a repeat (the flat layout lists k twice when k ∈ TopK)
    m = ids.shape[1]
    earlier = torch.ones(m, m, dtype=torch.bool).tril(-1)
    repeat = ((ids[:, :, None] == ids[:, None, :]) & earlier & ~pad[:, :, None]).any(dim=2)
    ids, logp = ids.masked_fill(repeat, PAD_ID), logp.masked_fill(repeat, PAD_LOGP)
    ids, logp = order_rows(ids, logp)  # μ's top-K order: log-prob descending, ties to the lower id
    ids, logp = ids[:, :k], logp[:, :k]
    if ids.shape[1] < k:
        ids = torch.cat([ids, ids.new_full((t, k - ids.shape[1]), PAD_ID)], dim=1)
        logp = torch.cat([logp, logp.new_full((t, k - logp.shape[1]), PAD_LOGP)], dim=1)
    return EngineTopK(ids=ids, logp=logp, sampled=sampled, sampled_logp=sampled_logp)


def _ragged(rows: Sequence[tuple[Sequence[int], Sequence[Any]]]) -> tuple[np.ndarray, np.ndarray]:
    """T (ids, log-probs) lists of any lengths → [T, M] arrays, −1 / −inf after each row's end.
    A missing log-prob (None) becomes NaN, which ``topk_from_entries`` refuses."""
    width = max([len(r[0]) for r in rows] + [0])
    ids = np.full((len(rows), width), PAD_ID, dtype=np.int64)
    logp = np.full((len(rows), width), PAD_LOGP, dtype=np.float32)
    for j, (row_ids, row_logp) in enumerate(rows):
        ids[j, : len(row_ids)] = row_ids
        logp[j, : len(row_logp)] = [math.nan if v is None else v for v in row_logp]
    return ids, logp


def topk_from_dicts(positions: Sequence[Mapping[int, Any]], sampled: Any, k: int, *,
                    response: int | None = None) -> EngineTopK:
    """vLLM's ``CompletionOutput.logprobs`` of one response: per position ``{token_id: Logprob}``
    (or ``{token_id: float}``), and its [T] sampled tokens (the first T positions are read)."""
    sampled = torch.as_tensor(sampled, dtype=torch.long).reshape(-1)
    rows = [(list(entry), [getattr(v, "logprob", v) for v in entry.values()])
            for entry in list(positions)[: sampled.shape[0]]]
    if len(rows) < sampled.shape[0]:
        raise PDMInputError(f"{_where(response)}: {len(rows)} positions for {sampled.shape[0]} sampled tokens")
    return topk_from_entries(*_ragged(rows), sampled, k, response=response)


def topk_from_ranked(logprobs: Sequence[Sequence[float | None]], token_ids: Sequence[Sequence[int]],
                     sampled: Any, k: int, *, response: int | None = None) -> EngineTopK:
    """One response as TRL hands vLLM's answer on: per position, log-probs and ids sorted by
    rank (``trl.generation.vllm_generation.extract_logprobs``), and the [T] sampled tokens."""
    sampled = torch.as_tensor(sampled, dtype=torch.long).reshape(-1)
    if not len(logprobs) == len(token_ids) == sampled.shape[0]:
        raise PDMInputError(f"{_where(response)}: {len(logprobs)} log-prob rows, {len(token_ids)} id rows, "
                            f"{sampled.shape[0]} sampled tokens")
    return topk_from_entries(*_ragged(list(zip(token_ids, logprobs))), sampled, k, response=response)


def topk_from_flat(flat: Any, sampled: Any, k: int, *, response: int | None = None) -> EngineTopK:
    """vLLM's ``FlatLogprobs`` of one response (``flat_logprobs=True``): K + 1 entries per
    position (``token_ids``, ``logprobs``), and its [T] sampled tokens."""
    sampled = torch.as_tensor(sampled, dtype=torch.long).reshape(-1)
    t = sampled.shape[0]
    ids = np.asarray(flat.token_ids, dtype=np.int64)
    logp = np.asarray([math.nan if v is None else v for v in flat.logprobs], dtype=np.float32) \
        if any(v is None for v in flat.logprobs) else np.asarray(flat.logprobs, dtype=np.float32)
    if ids.size != t * (k + 1) or logp.size != ids.size:
        raise PDMInputError(f"{_where(response)}: {ids.size} entries for {t} tokens, expected {k + 1} per "
                            f"token (is max_logprobs ≥ {k}?)")
    return topk_from_entries(torch.from_numpy(ids.reshape(t, k + 1)), torch.from_numpy(logp.reshape(t, k + 1)),
                             sampled, k, response=response)


def pad_responses(responses: Sequence[EngineTopK], length: int) -> EngineTopK:
    """B responses ([T_b, …] each) → one [B, length, …] batch, each cut after `length` positions
    or filled past its end with the padding of ``pdm_lab.padding``."""
    if not responses:
        raise PDMInputError("pad_responses: no responses")
    return EngineTopK(**{f.name: torch.stack([pad_to_length(getattr(r, f.name), length, _FILL[f.name])
                                              for r in responses]) for f in fields(EngineTopK)})


__all__ = ["EngineTopK", "pad_responses", "topk_from_dicts", "topk_from_entries", "topk_from_flat",
           "topk_from_ranked"]
