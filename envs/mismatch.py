"""Mismatch injection: the behaviour policy μ as a perturbed copy of the current policy π.

A mismatch is a ``+``-joined list of ``kind:strength`` sources, applied in order, e.g.
``"fp8_e4m3_weights:0+noise:0.3+stale:4"``. Kinds (one strength knob each):

| kind | strength | μ's logits |
| --- | --- | --- |
| ``none`` | ignored | z (μ = π at rollout) |
| ``noise`` | σ ≥ 0 | z + σ·ε, ε ~ N(0, 1) i.i.d. per token and position |
| ``temperature`` | s > −1 | z / (1 + s): the engine samples at temperature 1 + s |
| ``tail_noise`` | σ ≥ 0 | z + σ·ε on the tokens outside z's top ``TAIL_NOISE_TOP`` only |
| ``<dtype>`` | m ≥ 0 | q(z + m) − m: logits rounded at magnitude m |
| ``<dtype>_weights`` | m ≥ 0 | every weight w of the behaviour copy becomes q(w + m) − m |
| ``stale`` | s ≥ 1 | none at rollout; the trainer takes s optimiser steps per rollout batch |

``<dtype>`` ∈ {bf16, fp16, fp8_e4m3, fp8_e5m2}; q is a real torch cast there and back
(``torch.bfloat16``, ``torch.float16``, ``torch.float8_e4m3fn``, ``torch.float8_e5m2``). FP8
casts saturate at the format's largest finite value and use a per-tensor (weights) or per-row
(logits) scale amax/max, as FP8 inference engines do. The strength m is the magnitude at which
values are rounded: floats keep a fixed number of mantissa bits, so the absolute error grows
like m·2^(−p) — an engine whose logits sit near 20–30 loses far more than one near 0. m = 0
is a plain cast. The realised mismatch grows with m once m exceeds the values' own magnitude
(below that, shifting can move values into finer binades); fp8_e5m2 saturates near m ≈ 64 on
Zipf logits (μ becomes nearly uniform on its head).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pdm_lab.config import ConfigError, config_dataclass, one_of  # field checks: a NaN strength is an error

#: tail_noise perturbs the tokens outside π's top this-many.
TAIL_NOISE_TOP = 20

DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
LOGIT_KINDS = ("noise", "temperature", "tail_noise", *DTYPES)
WEIGHT_KINDS = tuple(f"{name}_weights" for name in DTYPES)
MISMATCH_KINDS = ("none", *LOGIT_KINDS, *WEIGHT_KINDS, "stale")
STOCHASTIC_KINDS = ("noise", "tail_noise")


def round_through(x: Tensor, dtype: torch.dtype, magnitude: float = 0.0, *, per_row: bool) -> Tensor:
    """q(x + m) − m with q a real cast to `dtype` and back to x's dtype.

    Args:
        x: float tensor ([B, n] logits when ``per_row``, any weight tensor otherwise).
        dtype: the low-precision format.
        magnitude: m ≥ 0.
        per_row: FP8 scale per row (logits) instead of per tensor (weights).
    """
    shifted = x.float() + magnitude
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        fmax = torch.finfo(dtype).max
        amax = shifted.abs().amax(dim=-1, keepdim=True) if per_row else shifted.abs().max()
        scale = torch.clamp(amax / fmax, min=torch.finfo(torch.float32).tiny)
        q = (shifted / scale).clamp(-fmax, fmax).to(dtype).float() * scale
    else:
        fmax = torch.finfo(dtype).max
        q = shifted.clamp(-fmax, fmax).to(dtype).float()
    return (q - magnitude).to(x.dtype)


@config_dataclass("mismatch")
class MismatchSource:
    """One named source of mismatch and its strength (see the module table)."""

    kind: str
    strength: float = 0.0

    def __post_init__(self) -> None:
        one_of("mismatch kind", self.kind, MISMATCH_KINDS)
        if self.kind == "temperature" and self.strength <= -1:
            raise ConfigError(f"temperature mismatch: strength must be > −1, got {self.strength}")
        if self.kind == "stale" and (self.strength < 1 or self.strength != int(self.strength)):
            raise ConfigError(f"stale: strength is an optimiser-step count ≥ 1, got {self.strength}")
        if self.kind not in ("temperature",) and self.strength < 0:
            raise ConfigError(f"{self.kind}: strength must be ≥ 0, got {self.strength}")

    def __str__(self) -> str:
        return f"{self.kind}:{self.strength:g}"


@dataclass(frozen=True)
class Mismatch:
    """A composition of sources, applied in order (weights first, logits in listed order)."""

    sources: tuple[MismatchSource, ...] = ()

    @classmethod
    def parse(cls, spec: "str | Mismatch | None") -> "Mismatch":
        """``"noise:0.3+stale:2"`` → Mismatch; ``""``/``"none"``/None → no mismatch."""
        if isinstance(spec, Mismatch):
            return spec
        if spec is None or spec.strip() in ("", "none"):
            return cls()
        sources = []
        for part in spec.split("+"):
            kind, _, value = part.strip().partition(":")
            strength = float(value) if value else (1.0 if kind == "stale" else 0.0)
            if kind != "none":
                sources.append(MismatchSource(kind, strength))
        return cls(tuple(sources))

    def __str__(self) -> str:
        return "+".join(str(s) for s in self.sources) or "none"

    @property
    def stale_steps(self) -> int:
        """Optimiser steps per rollout batch requested by ``stale`` (1 if absent)."""
        steps = [int(s.strength) for s in self.sources if s.kind == "stale"]
        return max(steps) if steps else 1

    @property
    def stochastic(self) -> bool:
        """True if μ's logits get fresh noise per row (so rows of one state differ)."""
        return any(s.kind in STOCHASTIC_KINDS and s.strength > 0 for s in self.sources)

    @torch.no_grad()
    def behaviour_copy(self, policy: nn.Module) -> nn.Module:
        """The rollout engine's copy of π: the policy itself, or a deep copy with rounded weights."""
        weight_sources = [s for s in self.sources if s.kind in WEIGHT_KINDS]
        if not weight_sources:
            return policy
        engine = copy.deepcopy(policy)
        for source in weight_sources:
            dtype = DTYPES[source.kind.removesuffix("_weights")]
            for tensor in [*engine.parameters(), *engine.buffers()]:
                if tensor.is_floating_point():
                    tensor.copy_(round_through(tensor, dtype, source.strength, per_row=False))
        return engine

    @torch.no_grad()
    def behaviour_logits(self, logits: Tensor, generator: torch.Generator) -> Tensor:
        """Apply the logit-level sources to the engine copy's logits.

        Args:
            logits: [B, n] float32 logits of ``behaviour_copy(policy)``.
            generator: seeded generator for the noise kinds.

        Returns:
            [B, n] float32 behaviour logits (finite).
        """
        z = logits
        for source in self.sources:
            kind, s = source.kind, source.strength
            if kind == "noise" and s > 0:
                z = z + s * torch.randn(z.shape, generator=generator)
            elif kind == "temperature":
                z = z / (1.0 + s)
            elif kind == "tail_noise" and s > 0:
                top = min(TAIL_NOISE_TOP, z.shape[-1])
                threshold = torch.topk(z, top, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
                tail = z < threshold
                z = z + s * torch.randn(z.shape, generator=generator) * tail
            elif kind in DTYPES:
                z = round_through(z, DTYPES[kind], s, per_row=True)
        return z
