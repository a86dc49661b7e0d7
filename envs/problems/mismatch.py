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
| ``bf16_engine`` | m ≥ 0 | the network run like a bf16 engine: weights, buffers, hidden activations and logits (at magnitude m) rounded to bf16 |
| ``fp8_engine`` | m ≥ 0 | as an FP8 (W8A8) engine: hidden matmul weights e4m3 with 128×128 block scales, hidden activations e4m3 with 1×128 group scales; output layer, prior and logits bf16 |
| ``lognormal`` | σ ≥ 0 (``lognormal:σ:s``) | z + σ_c·ξ_c, σ_c = σ·exp(s·Z_c): per-context error scale log-normal, heavy tail knob s (default ``LOGNORMAL_TAIL``) |
| ``outlier`` | σ ≥ 0 (``outlier:σ:s``) | z + σ·exp(s·Z(h))·ĥE: the engine's output-layer error, a function of the hidden activations h (neural policy only) |

``<dtype>`` ∈ {bf16, fp16, fp8_e4m3, fp8_e5m2}; q is a real torch cast there and back
(``torch.bfloat16``, ``torch.float16``, ``torch.float8_e4m3fn``, ``torch.float8_e5m2``). FP8
casts saturate at the format's largest finite value and use a per-tensor (weights) or per-row
(logits) scale amax/max, as FP8 inference engines do. The strength m is the magnitude at which
values are rounded: floats keep a fixed number of mantissa bits, so the absolute error grows
like m·2^(−p) — an engine whose logits sit near 20–30 loses far more than one near 0. m = 0
is a plain cast. The realised mismatch grows with m once m exceeds the values' own magnitude
(below that, shifting can move values into finer binades); fp8_e5m2 saturates near m ≈ 64 on
Zipf logits (μ becomes nearly uniform on its head).

Realistic kinds (SPEC §6b: μ is a deterministic function of the context, the same state gives the
same μ). ``*_engine`` rounds what a low-precision engine rounds — the weights and the activations
of the network policy — so the error grows with the magnitude of the values, as in a real engine
(FP8 through the same block-wise formula as the scaling stage, ``pdm_lab.lab.quantize``).
``lognormal`` is a parametric heavy-tailed family: the context (the whole observation row) is
hashed; the hash picks a fixed N(0, 1) error vector ξ_c over the vocabulary and a standard normal
Z_c; μ's logits are z + σ·exp(s·Z_c)·ξ_c. σ is the median error scale, s the tail knob: D scales
like σ_c², so log D has spread ≈ 2s and p99.9/p50 of D grows like exp(6.2·s) (s = 0: every
context equally perturbed, a light tail; s = 1: three orders of magnitude between median and
p99.9). ``outlier`` is the same family correlated across contexts the way an engine's error is:
ξ and Z are functions of the shared hidden activations h instead of a hash, ĥ = h/‖h‖,
ξ(h) = ĥE with E a fixed N(0, 1) [H, n] matrix (an output-layer rounding error; each entry of
ξ is N(0, 1), and contexts with similar activations get similar errors), and
Z(h) = √H·⟨ĥ, u⟩ for a fixed unit vector u (an activation-outlier direction that scales the
error). The noise kinds ``noise``/``tail_noise`` (fresh per row) are kept as stress settings.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pdm_lab.config import ConfigError, config_dataclass, one_of  # field checks: a NaN strength is an error
from pdm_lab.lab.quantize import quantize_dequantize, quantize_dequantize_groups

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
ENGINE_KINDS = ("bf16_engine", "fp8_engine")
CONTEXT_KINDS = ("lognormal",)
ACTIVATION_KINDS = ("outlier",)
MISMATCH_KINDS = ("none", *LOGIT_KINDS, *WEIGHT_KINDS, *ENGINE_KINDS, *CONTEXT_KINDS, *ACTIVATION_KINDS, "stale")
STOCHASTIC_KINDS = ("noise", "tail_noise")

#: default tail knob s of ``lognormal`` (σ_c = σ·exp(s·Z_c)).
LOGNORMAL_TAIL = 1.0
#: rows of the fixed error table ξ that context hashes index (collisions share ξ, not Z_c).
LOGNORMAL_ROWS = 8192
_HASH_MOD = 2_147_483_647  # 2^31 − 1, as ``encoders.context_hash``


_XI: dict[int, Tensor] = {}


def _error_table(n: int) -> Tensor:
    """[LOGNORMAL_ROWS, n] fixed N(0, 1) errors (seeded once per vocabulary size)."""
    if n not in _XI:
        _XI[n] = torch.randn(LOGNORMAL_ROWS, n, generator=torch.Generator().manual_seed(20_260_707))
    return _XI[n]


def lognormal_error(context: Tensor, n: int, sigma: float, tail: float) -> Tensor:
    """[B, n] per-context logit error σ·exp(s·Z_c)·ξ_c (see the module docstring).

    ``context``: [B] int64 ``encoders.context_hash`` of each row's observation."""
    u = ((context * 16_807 + 7) % _HASH_MOD).double().add(0.5) / _HASH_MOD
    z = torch.special.ndtri(u)
    scale = sigma * torch.exp(tail * z)
    return (scale[:, None] * _error_table(n)[context % LOGNORMAL_ROWS].double()).float()


def outlier_error(hidden: int, n: int, sigma: float, tail: float):
    """The ``outlier`` kind's h → [B, n] logit error σ·exp(s·Z(h))·ĥE (module docstring)."""
    gen = torch.Generator().manual_seed(20_261_202)
    table = torch.randn(hidden, n, generator=gen, dtype=torch.float64)
    direction = torch.randn(hidden, generator=gen, dtype=torch.float64)
    direction = direction / direction.norm()

    def error(h: Tensor) -> Tensor:
        unit = h.double() / h.double().norm(dim=1, keepdim=True).clamp(min=1e-30)
        z = hidden ** 0.5 * (unit @ direction)
        return (sigma * torch.exp(tail * z)[:, None] * (unit @ table)).to(h.dtype)
    return error


def engine_round(kind: str, magnitude: float = 0.0):
    """The activation rounding of a ``*_engine`` kind, x → q(x + m) − m (m on the logits only).

    bf16: every activation cast to bf16. fp8 (W8A8): hidden activations e4m3 with 1×128 group
    scales; the logits bf16, as FP8 engines keep the output layer in bf16."""
    def act(x: Tensor, *, logits: bool = False) -> Tensor:
        m = magnitude if logits else 0.0
        shifted = x.float() + m
        if kind == "fp8_engine" and not logits:
            q = quantize_dequantize_groups(shifted)
        else:
            q = shifted.to(torch.bfloat16).float()
        return (q - m).to(x.dtype)
    return act


def _engine_weight(kind: str, name: str, w: Tensor, fp8_names: tuple[str, ...]) -> Tensor:
    """bf16 everywhere, except ``fp8_engine``'s hidden matmul weights (the policy's
    ``FP8_WEIGHTS``): e4m3 with 128×128 block scales, the scaling stage's formula."""
    if kind == "fp8_engine" and name in fp8_names and w.dim() == 2:
        return quantize_dequantize(w)
    return w.to(torch.bfloat16).to(w.dtype)


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
    tail: float | None = None
    """``lognormal`` only: the tail knob s (None: ``LOGNORMAL_TAIL``)."""

    def __post_init__(self) -> None:
        one_of("mismatch kind", self.kind, MISMATCH_KINDS)
        if self.kind == "temperature" and self.strength <= -1:
            raise ConfigError(f"temperature mismatch: strength must be > −1, got {self.strength}")
        if self.kind == "stale" and (self.strength < 1 or self.strength != int(self.strength)):
            raise ConfigError(f"stale: strength is an optimiser-step count ≥ 1, got {self.strength}")
        if self.kind not in ("temperature",) and self.strength < 0:
            raise ConfigError(f"{self.kind}: strength must be ≥ 0, got {self.strength}")
        if self.tail is not None and (self.kind not in CONTEXT_KINDS + ACTIVATION_KINDS or self.tail < 0):
            raise ConfigError(f"{self.kind}: a tail knob is for lognormal and outlier only, and must be ≥ 0")

    def __str__(self) -> str:
        tail = "" if self.tail is None else f":{self.tail:g}"
        return f"{self.kind}:{self.strength:g}{tail}"


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
            value, _, tail = value.partition(":")
            try:
                strength = float(value) if value else (1.0 if kind == "stale" else 0.0)
                tail_knob = float(tail) if tail else None
            except ValueError:
                raise ValueError(f"mismatch {part!r}: strength must be a number") from None
            if kind != "none":
                sources.append(MismatchSource(kind, strength, tail_knob))
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
        weight_sources = [s for s in self.sources if s.kind in WEIGHT_KINDS + ENGINE_KINDS + ACTIVATION_KINDS]
        if not weight_sources:
            return policy
        engine = copy.deepcopy(policy)
        for source in weight_sources:
            if source.kind in ACTIVATION_KINDS:
                if not hasattr(engine, "w2"):
                    raise ConfigError(f"{source}: needs the neural policy's hidden activations (policy=neural)")
                tail = LOGNORMAL_TAIL if source.tail is None else source.tail
                engine.output_error = outlier_error(engine.w2.shape[0], engine.w2.shape[1], source.strength, tail)
                continue
            named = [(n, t) for n, t in [*engine.named_parameters(), *engine.named_buffers()]
                     if t.is_floating_point()]
            tensors = [t for _, t in named]
            if source.kind in ENGINE_KINDS:
                fp8_names = getattr(engine, "FP8_WEIGHTS", ())
                for name, tensor in named:
                    tensor.copy_(_engine_weight(source.kind, name, tensor, fp8_names))
                engine.activation_round = engine_round(source.kind, source.strength)
                continue
            dtype = DTYPES[source.kind.removesuffix("_weights")]
            for tensor in tensors:
                tensor.copy_(round_through(tensor, dtype, source.strength, per_row=False))
        return engine

    @torch.no_grad()
    def behaviour_logits(self, logits: Tensor, generator: torch.Generator,
                         context: Tensor | None = None) -> Tensor:
        """Apply the logit-level sources to the engine copy's logits.

        Args:
            logits: [B, n] float32 logits of ``behaviour_copy(policy)``.
            generator: seeded generator for the noise kinds.
            context: [B] int64 ``context_hash`` of each row's observation (context kinds).

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
            elif kind == "lognormal" and s > 0:
                if context is None:
                    raise ValueError("lognormal mismatch: needs each row's context hash")
                tail = LOGNORMAL_TAIL if source.tail is None else source.tail
                z = z + lognormal_error(context, z.shape[-1], s, tail)
        return z
