"""FP8 (e4m3) block-wise quantisation of the weights pushed to the rollout engine.

``quantize_dequantize(w, block)`` reproduces what an FP8 rollout engine computes with (DeepSeek-V3
style 128×128 blocks, one float32 scale per block, scale = amax/448), returned at a higher
precision so any engine — vLLM on CPU included — runs the FP8-rounded weights. On GPU the native
route (``rollout.fp8_mode: native``) lets vLLM quantise and run real FP8 kernels instead.

Only the decoder's Linear weights are quantised; embeddings, the output layer and norms stay in
the engine dtype, as in common FP8 checkpoints.
"""
from __future__ import annotations

from torch import Tensor

from pdm_lab.quantize import FP8_MAX, dequantize_blockwise, quantize_blockwise, quantize_dequantize  # noqa: F401  (one formula, in the core)

_LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                    "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def is_quantised_param(name: str, tensor: Tensor) -> bool:
    """Decoder Linear weights (2-D, inside ``layers``), including MoE experts' projections."""
    return tensor.dim() == 2 and ".layers." in name and name.endswith(_LINEAR_SUFFIXES)
