"""Push the trainer's weights into the running vLLM engine, in place (no restart).

Every rank streams the full parameters one at a time (an FSDP all-gather per tensor, the same
order on every rank), converts each to the rollout precision, and feeds them to its own engine's
``reload_weights``. Then the prefix cache is reset, since cached KV was computed with old weights.

The ``lm_head.weight`` trap (``shared/notes/vllm-fsdp-cpu.md``): vLLM on CPU pre-packs the output
layer and repacks it only when that tensor is reloaded, so the stream must include it or logits
silently stay stale. ``check_names`` enforces it.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor, nn

from .fp8 import is_quantised_param, quantize_dequantize

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


def full_parameters(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
    """(HF name, full tensor) for each parameter; DTensor shards are all-gathered one by one.

    Collective: every rank must consume the iterator completely and in the same order.
    ``prefix`` is stripped from names (the trainer wraps the HF model as ``lm``).
    """
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        data = param.detach()
        if isinstance(data, DTensor):
            data = data.full_tensor()
        yield name.removeprefix(prefix), data


def to_rollout_precision(name: str, tensor: Tensor, precision: str, fp8_mode: str,
                         block: int) -> Tensor:
    """The tensor the engine should compute with for ``rollout.precision``."""
    dtype = _DTYPES[precision]
    if precision == "fp8" and fp8_mode == "simulate" and is_quantised_param(name, tensor):
        return quantize_dequantize(tensor.float(), block).to(dtype)
    return tensor.to(dtype)


def rollout_weights(model: nn.Module, rollout_cfg, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
    """The converted weight stream for one sync."""
    for name, tensor in full_parameters(model, prefix):
        yield name, to_rollout_precision(name, tensor, rollout_cfg.precision, rollout_cfg.fp8_mode,
                                         rollout_cfg.fp8_block)


def check_names(model: nn.Module, prefix: str, tied: bool) -> list[str]:
    """Parameter names the sync will send; raises if an untied model would omit lm_head.weight."""
    names = [n.removeprefix(prefix) for n, _ in model.named_parameters()]
    if not tied and "lm_head.weight" not in names:
        raise RuntimeError("weight sync would not include lm_head.weight: vLLM on CPU would keep "
                           "stale logits (see shared/notes/vllm-fsdp-cpu.md)")
    return names


def push_weights(llm, weights: Iterator[tuple[str, Tensor]]) -> None:
    """Reload the engine's weights from the stream, then drop the prefix cache."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    llm.reset_prefix_cache()
