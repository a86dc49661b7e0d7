"""FP8 (e4m3) quantisation of what the rollout engine computes with: weights, and optionally the
activations entering each quantised Linear (W8A8).

``quantize_dequantize(w, block)`` reproduces what an FP8 rollout engine computes with (DeepSeek-V3
style 128×128 blocks, one float32 scale per block, scale = amax/448), returned at a higher
precision so any engine — vLLM on CPU included — runs the FP8-rounded weights. On GPU the native
route (``rollout.fp8_mode: native``) lets vLLM quantise and run real FP8 kernels instead.

Only the decoder's Linear weights are quantised; embeddings, the output layer and norms stay in
the engine dtype, as in common FP8 checkpoints.

``rollout.fp8_activations`` adds the other half of W8A8: the input of every quantised Linear is
rounded to e4m3 with a dynamic scale (amax/448) per token row (``per_token``, as vLLM's
per-token dynamic FP8) or one per call over the whole batch of tokens (``per_tensor``, vLLM's
default dynamic scheme; μ then depends on which tokens share the forward pass). The rounding is the
core's (``pdm_lab.lab.quantize.quantize_dequantize_groups``); ``install_activation_quant`` puts it in
forward pre-hooks on the Linear modules of a model (vLLM's merged ``qkv_proj``/``gate_up_proj``
or Hugging Face's separate projections — one per-token scale serves q, k and v alike, since they
share the input row).
"""
from __future__ import annotations

from torch import Tensor, nn

from pdm_lab.lab.quantize import (FP8_MAX, dequantize_blockwise, quantize_blockwise,  # noqa: F401  (one formula, in the core)
                              quantize_dequantize, quantize_dequantize_groups)

_LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                    "gate_proj.weight", "up_proj.weight", "down_proj.weight")
# the Linear modules whose weights ``is_quantised_param`` selects, by module name: Hugging Face's
# separate projections and vLLM's merged ones (its loader fuses q/k/v and gate/up)
_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj",
                   "gate_up_proj", "down_proj")

ACTIVATION_MODES = ("none", "per_token", "per_tensor")
_HOOK_ATTR = "_pdm_fp8_activation_hook"


def is_quantised_param(name: str, tensor: Tensor) -> bool:
    """Decoder Linear weights (2-D, inside ``layers``), including MoE experts' projections."""
    return tensor.dim() == 2 and ".layers." in name and name.endswith(_LINEAR_SUFFIXES)


def is_quantised_linear(name: str) -> bool:
    """A decoder Linear module (inside ``layers``) whose weight fp8 quantises. vLLM's fused MoE
    experts are one module with 3-D weights, not matched: their activations stay unquantised."""
    return ".layers." in f".{name}" and name.rsplit(".", 1)[-1] in _LINEAR_MODULES


def quantize_activations(x: Tensor, mode: str) -> Tensor:
    """e4m3 round trip of a Linear's input ``[..., features]`` in ``x``'s dtype: one scale
    (amax/448) per row of the last dimension (``per_token``) or over the whole tensor
    (``per_tensor``); ``none`` returns ``x``."""
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"quantize_activations: unknown mode {mode!r} (valid: {', '.join(ACTIVATION_MODES)})")
    if mode == "none" or x.numel() == 0:
        return x
    if mode == "per_token":
        return quantize_dequantize_groups(x, group=x.shape[-1])
    return quantize_dequantize_groups(x.reshape(-1), group=x.numel()).reshape(x.shape)


def install_activation_quant(model: nn.Module, mode: str) -> int:
    """Quantise-dequantise the input of every decoder Linear of ``model`` (forward pre-hooks);
    ``none`` removes them. Idempotent (a module holds at most one such hook). Returns the number of
    modules hooked; raises if ``mode`` is not ``none`` and the model has no such module."""
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"install_activation_quant: unknown mode {mode!r} (valid: {', '.join(ACTIVATION_MODES)})")

    def hook(_module, args):
        return (quantize_activations(args[0], mode), *args[1:])

    hooked = 0
    for name, module in model.named_modules():
        if not is_quantised_linear(name):
            continue
        old = getattr(module, _HOOK_ATTR, None)
        if old is not None:
            old.remove()
            delattr(module, _HOOK_ATTR)
        if mode != "none":
            setattr(module, _HOOK_ATTR, module.register_forward_pre_hook(hook))
            hooked += 1
    if mode != "none" and hooked == 0:
        raise RuntimeError(f"fp8 activations ({mode}): the model has no decoder Linear module "
                           f"({', '.join(_LINEAR_MODULES)}) to quantise the input of")
    return hooked


def _install_in_worker(worker, mode: str) -> int:
    """Runs inside a vLLM worker (``collective_rpc``): hooks on the engine's own model."""
    return install_activation_quant(worker.model_runner.get_model(), mode)


def install_engine_activation_quant(llm, mode: str) -> list[int]:
    """Hook every worker's model of an in-process vLLM engine; returns modules hooked per worker.
    The hooks sit on the modules, which an in-place weight sync (``weight_sync.push_weights``)
    writes into without replacing."""
    counts = list(llm.collective_rpc(_install_in_worker, args=(mode,)))
    if mode != "none" and (not counts or min(counts) == 0):
        raise RuntimeError(f"fp8 activations ({mode}): no engine Linear module hooked ({counts})")
    return counts
