"""The engine's sampling mask (SPEC §1): the tokens a rollout engine could sample, on the trainer.

With ``top_p < 1``, ``top_k > 0`` or ``min_p > 0`` the engine samples from a cut distribution and
returns its processed log-probs: μ is zero outside the set C it kept. Keeping the sampling mask
means π is taken over the same C and renormalised there (a cut token has π = 0), so the cut
itself is no mismatch; D, Ḋ and the tails of SPEC §2/§8 are then computed on that π.

C is reproduced from the same parameters on the trainer's own logits z = logits / T, in the
order and with the comparisons of vLLM 0.32's sampler (``Sampler.sample``: the argmax-invariant
``MinPLogitsProcessor``, then ``apply_top_k_top_p_pytorch``, its CPU path and the reference its
GPU kernels are tested against)::

    min_p   cut p_i < min_p · max_j p_j                     (p = softmax z)
    top_k   cut z_i < the k-th largest z left               (every token tied at it is kept)
    top_p   sort what is left ascending, cut each token whose cumulative probability, from the
            smallest up to and including itself, is ≤ 1 − top_p; the most probable token is
            always kept

Ties: vLLM sorts with torch's unstable sort, so which of several tokens tied exactly at the
top-p boundary it cuts is unspecified (the number cut is not); here the sort is stable (the
lower id is cut first). Tests compare with vLLM's own function: equal sets on untied logits,
equal set sizes with ties.

Hugging Face ``generate`` applies the same three cuts (top-k, then top-p, then min-p, all with
these comparisons); its result equals vLLM's except when min-p and top-p are both on.

Where the engine shows its cut, its answer wins: on the support S the processed log-probs say
which tokens were kept (finite μ_i) and which were cut (−inf), so there C is the engine's
(``engine_kept``); the sampled token is always kept. Off S the trainer's reproduction decides:
where the trainer's and the engine's logits put a token on opposite sides of the boundary, the
tail masses differ by that token's probability (a real mismatch, not the cut's).

The tail of π is then C ∖ S: its size t = |C ∖ S| replaces n − |S| (``on_sampling_set``), so the
``uniform`` estimator spreads the tail over the tokens that can carry mass, and an empty tail
(C ⊆ S) makes every tail term 0 on both sides, as SPEC §8 wants.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor

from pdm_lab.errors import PDMInputError
from pdm_lab.support import Support

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingMask:
    """The engine's sampling parameters that cut its distribution (vLLM's names and defaults).

    Attributes:
        top_k: keep the k most probable tokens (ties at the k-th value kept); 0 or −1: off, as in
            vLLM; k ≥ n is off too.
        top_p: nucleus mass in (0, 1]; 1: off.
        min_p: cut tokens below min_p times the most probable one's probability, in [0, 1]; 0: off.
    """

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < -1:
            raise PDMInputError(f"sampling mask top_k: must be an integer ≥ −1 (0 and −1: off), "
                                f"got {self.top_k!r}")
        for name, low_open in (("top_p", True), ("min_p", False)):
            value = getattr(self, name)
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) \
                and (0.0 < value if low_open else 0.0 <= value) and value <= 1.0
            if not ok:
                interval = "(0, 1]" if low_open else "[0, 1]"
                raise PDMInputError(f"sampling mask {name}: must be a number in {interval}, got {value!r}")

    @property
    def active(self) -> bool:
        """Whether any parameter cuts (the mask then changes π)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def as_dict(self) -> dict[str, Any]:
        """The parameters as a plain dict (what a run records)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any] | Any) -> "SamplingMask":
        """From anything holding ``top_k``/``top_p``/``min_p`` (a dict, vLLM's ``SamplingParams``,
        a generation config); a missing or None value is off. HF's ``top_k=None`` and vLLM's −1
        both mean off."""
        def get(name: str, default):
            value = params.get(name, None) if isinstance(params, Mapping) else getattr(params, name, None)
            return default if value is None else value

        return cls(top_k=int(get("top_k", 0)), top_p=float(get("top_p", 1.0)), min_p=float(get("min_p", 0.0)))


def sampling_keep(z: Tensor, mask: SamplingMask) -> Tensor:
    """[c, V] bool: the tokens the engine keeps from temperature-scaled logits z ([c, V] float).

    vLLM's cut, step for step (module docstring). Naive equivalent: ``apply_top_k_top_p_pytorch``
    after ``MinPLogitsProcessor.apply`` on the same logits, then ``> -inf``. −inf logits are cut.
    """
    keep = z > _NEG_INF
    if not mask.active:
        return keep
    zm = z
    if mask.min_p > 0.0:
        probs = torch.softmax(zm, dim=-1)
        keep = keep & ~(probs < probs.amax(dim=-1, keepdim=True) * mask.min_p)
        zm = zm.masked_fill(~keep, _NEG_INF)
    vocab = z.shape[-1]
    if 0 < mask.top_k < vocab:
        kth = torch.topk(zm, mask.top_k, dim=-1).values[:, -1:]
        keep = keep & ~(zm < kth)
        zm = zm.masked_fill(~keep, _NEG_INF)
    if mask.top_p < 1.0:
        z_sort, order = zm.sort(dim=-1, descending=False, stable=True)
        cumulative = torch.softmax(z_sort, dim=-1).cumsum(dim=-1)
        cut_sorted = cumulative <= 1.0 - mask.top_p
        cut_sorted[:, -1] = False  # at least one token
        cut = torch.zeros_like(keep).scatter_(1, order, cut_sorted)
        keep = keep & ~cut
    return keep


def engine_kept(support: Support) -> Tensor:
    """[N, m] bool: the support's tokens the engine kept (μ_i > 0; the sampled token always).

    Passed as ``policy_on_support(keep_on_support=...)``: on S the engine's own cut decides."""
    return (support.ids >= 0) & (support.mu_logp > _NEG_INF)


def on_sampling_set(support: Support, tail_count: Tensor | None) -> Support:
    """μ's support with the tail counted inside the sampling set: t = |C ∖ S| (from
    ``policy_on_support(sampling=...)``, ``PolicyOnSupport.tail_count``) and μ_T := 0 where the
    tail is empty (C ⊆ S: what is left of μ's mass there is the engine's rounding, and π has no
    tail to match it). None: the support unchanged (no sampling mask)."""
    if tail_count is None:
        return support
    if tail_count.shape != support.tail_count.shape:
        raise PDMInputError(f"tail_count: shape {tuple(tail_count.shape)}, the support has "
                            f"{tuple(support.tail_count.shape)} rows")
    count = tail_count.to(support.tail_count.device, torch.int64)
    mu_tail = torch.where(count == 0, _NEG_INF, support.mu_tail_logp)
    return dataclasses.replace(support, tail_count=count, mu_tail_logp=mu_tail)


def forced_keep(keep: Tensor, ids: Tensor, keep_on_support: Tensor | None) -> Tensor:
    """`keep` ([c, V] bool) with the support's tokens set by the engine's evidence: a valid slot
    of `ids` ([c, m], −1 pads) is kept iff ``keep_on_support`` ([c, m] bool; None: every valid
    slot kept). Pads change nothing (scatter by max: a pad writes 0, never over a real id)."""
    valid = ids >= 0
    want = valid if keep_on_support is None else valid & keep_on_support.bool()
    index = ids.clamp(min=0).long()
    shape = keep.shape
    into = torch.zeros(shape, dtype=torch.uint8, device=keep.device)
    put_in = into.scatter_reduce(1, index, want.to(torch.uint8), reduce="amax").bool()
    put_out = into.scatter_reduce(1, index, (valid & ~want).to(torch.uint8), reduce="amax").bool()
    return (keep | put_in) & ~put_out


__all__ = ["SamplingMask", "engine_kept", "forced_keep", "on_sampling_set", "sampling_keep"]
