"""FP8 (e4m3) block-wise quantisation, as FP8 inference engines store weights.

DeepSeek-V3-style square blocks (default 128×128), one float32 scale per block, scale =
amax/448 (448 = ``torch.finfo(torch.float8_e4m3fn).max``). The scaling stage rounds the weights
it pushes to the rollout engine with it; the toys' ``fp8_engine`` mismatch rounds the behaviour
policy's weights with the same formula.
"""
from __future__ import annotations

import torch
from torch import Tensor

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quantize_blockwise(w: Tensor, block: int = 128) -> tuple[Tensor, Tensor]:
    """[R, C] → (fp8 [R, C] float8_e4m3fn, scales [ceil(R/b), ceil(C/b)] float32)."""
    if w.dim() != 2:
        raise ValueError(f"quantize_blockwise: expected a 2-D weight, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    br, bc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(br * block, bc * block, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w.float()
    tiles = padded.reshape(br, block, bc, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(br * block, bc * block)[:rows, :cols].contiguous(), scale


def dequantize_blockwise(q: Tensor, scale: Tensor, block: int = 128) -> Tensor:
    """Inverse of ``quantize_blockwise`` (float32)."""
    rows, cols = q.shape
    expand = scale.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)[:rows, :cols]
    return q.float() * expand


def quantize_dequantize(w: Tensor, block: int = 128) -> Tensor:
    """FP8-rounded copy of ``w`` in ``w``'s dtype."""
    q, s = quantize_blockwise(w, block)
    return dequantize_blockwise(q, s, block).to(w.dtype)


def quantize_dequantize_groups(x: Tensor, group: int = 128) -> Tensor:
    """FP8 e4m3 round trip with one scale per contiguous group of ``group`` values along the last
    dimension (amax/448): how FP8 engines quantise activations (DeepSeek-V3: 1×128 per token)."""
    if x.dim() == 0:
        raise ValueError("quantize_dequantize_groups: expected at least one dimension")
    cols = x.shape[-1]
    groups = -(-cols // group)
    padded = torch.zeros(*x.shape[:-1], groups * group, dtype=torch.float32, device=x.device)
    padded[..., :cols] = x.float()
    tiles = padded.reshape(*x.shape[:-1], groups, group)
    amax = tiles.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    return q.reshape(*x.shape[:-1], groups * group)[..., :cols].to(x.dtype)
