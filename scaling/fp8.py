"""FP8 (e4m3) block-wise quantisation of the weights pushed to the rollout engine.

``quantize_dequantize(w, block)`` reproduces what an FP8 rollout engine computes with (DeepSeek-V3
style 128×128 blocks, one float32 scale per block, scale = amax/448), returned at a higher
precision so any engine — vLLM on CPU included — runs the FP8-rounded weights. On GPU the native
route (``rollout.fp8_mode: native``) lets vLLM quantise and run real FP8 kernels instead.

Only the decoder's Linear weights are quantised; embeddings, the output layer and norms stay in
the engine dtype, as in common FP8 checkpoints.
"""
from __future__ import annotations

import torch
from torch import Tensor

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max

_LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                    "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def is_quantised_param(name: str, tensor: Tensor) -> bool:
    """Decoder Linear weights (2-D, inside ``layers``), including MoE experts' projections."""
    return tensor.dim() == 2 and ".layers." in name and name.endswith(_LINEAR_SUFFIXES)


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
