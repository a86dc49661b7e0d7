"""Push the trainer's weights into the running vLLM engine, in place (no restart).

Gather: every rank needs the full weights for its own engine. The FSDP2 shards of all parameters
are flattened into one buffer per dtype and all-gathered in one collective (not one
``full_tensor()`` per parameter); a single rank copies nothing.

Names: the stream carries every name the Hugging Face model answers to, aliases included
(``named_parameters(remove_duplicate=False)``). With tied embeddings (Qwen3 0.6B/1.7B/4B)
``lm_head.weight`` is an alias of ``model.embed_tokens.weight`` that plain ``named_parameters()``
drops; vLLM on CPU packs the output layer separately and repacks it only when ``lm_head.weight``
arrives, so without it the engine keeps stale logits (``docs/guide/cpu-notes.md``).

Load: on CPU the engine built by ``rollout.make_engine`` with ``rollout.inplace_sync`` computes
its linear layers from unpacked weights, so a sync is the model's own ``load_weights`` copying
into those tensors (fused q/k/v and gate/up shards, tensor-parallel slices: vLLM's weight
loaders) with no per-step repacking of oneDNN kernels and no meta-device round trip. Every
engine parameter must be written, or the sync raises naming the ones left stale. Otherwise
(GPU, native fp8, ``inplace_sync=false``) vLLM's ``reload_weights``.

Check: ``check_sync`` compares the engine's log-probs of a fixed sequence with the trainer's and
raises when they differ by more than a tolerance derived from the two compute dtypes.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .fp8 import is_quantised_param, quantize_dequantize

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


class SyncError(RuntimeError):
    """The engine does not compute with the trainer's weights."""


def parameter_aliases(model: nn.Module, prefix: str = "") -> list[tuple[list[str], nn.Parameter]]:
    """Each distinct parameter once, with every HF name it has (tied weights: several)."""
    groups: dict[int, tuple[list[str], nn.Parameter]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), ([], param))[0].append(name.removeprefix(prefix))
    return list(groups.values())


def _local(param: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    data = param.detach()
    return data.to_local() if isinstance(data, DTensor) else data


def _is_sharded(param: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor) and any(not p.is_replicate() for p in param.placements)


def gather_full(params: list[Tensor]) -> list[Tensor]:
    """Full tensors of FSDP2 parameters (``Shard(0)`` over the world), one all-gather per dtype.

    Collective: every rank calls it with the same parameters in the same order. A rank's shard
    of a parameter is ``torch.chunk(full, world)[rank]`` (possibly empty); shards are packed into
    one flat buffer per rank, padded to the longest rank's, gathered, and cut back out.
    """
    out: list[Tensor | None] = [None if _is_sharded(p) else _local(p) for p in params]
    sharded = [i for i, p in enumerate(params) if out[i] is None]
    world = dist.get_world_size() if sharded else 1
    if world == 1:  # a world of one holds every shard whole
        return [_local(p) for p in params]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i in sharded:
        by_dtype.setdefault(params[i].dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        # rows of each rank's chunk, as torch.chunk splits dim 0
        pieces = []  # [param][rank] -> (rows, numel)
        for i in idx:
            shape = params[i].shape
            per = math.ceil(shape[0] / world) if shape[0] else 0
            rows = [max(0, min(per, shape[0] - r * per)) for r in range(world)]
            inner = math.prod(shape[1:])
            pieces.append([(n, n * inner) for n in rows])
        totals = [sum(p[r][1] for p in pieces) for r in range(world)]
        width = max(totals)
        device = _local(params[idx[0]]).device
        mine = dist.get_rank()
        send = torch.zeros(width, dtype=dtype, device=device)
        offset = 0
        for i, p in zip(idx, pieces):
            n = p[mine][1]
            send[offset:offset + n].copy_(_local(params[i]).reshape(-1))
            offset += n
        flat = torch.empty(world * width, dtype=dtype, device=device)
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(flat, send)
        starts = [r * width for r in range(world)]
        for i, p in zip(idx, pieces):
            shape = params[i].shape
            parts = []
            for r in range(world):
                rows, n = p[r]
                parts.append(flat[starts[r]:starts[r] + n].view(rows, *shape[1:]))
                starts[r] += n
            out[i] = torch.cat(parts) if len(parts) > 1 else parts[0]
    return out  # type: ignore[return-value]


def to_rollout_precision(name: str, tensor: Tensor, precision: str, fp8_mode: str,
                         block: int) -> Tensor:
    """The tensor the engine should compute with for ``rollout.precision``."""
    dtype = _DTYPES[precision]
    if precision == "fp8" and fp8_mode == "simulate" and is_quantised_param(name, tensor):
        return quantize_dequantize(tensor.float(), block).to(dtype)
    return tensor.to(dtype)


def rollout_weights(model: nn.Module, rollout_cfg, prefix: str = "") -> list[tuple[str, Tensor]]:
    """The converted weight stream for one sync: every name of every parameter (aliases too).

    Collective under FSDP (one all-gather per parameter dtype).
    """
    groups = parameter_aliases(model, prefix)
    full = gather_full([p for _, p in groups])
    stream = []
    for (names, _), tensor in zip(groups, full):
        for name in names:
            stream.append((name, to_rollout_precision(name, tensor, rollout_cfg.precision,
                                                      rollout_cfg.fp8_mode, rollout_cfg.fp8_block)))
    return stream


def check_names(model: nn.Module, prefix: str) -> list[str]:
    """Names the sync will send; raises if ``lm_head.weight`` (tied or not) would be missing."""
    names = [n for group, _ in parameter_aliases(model, prefix) for n in group]
    if hasattr(getattr(model, "lm", model), "lm_head") and "lm_head.weight" not in names:
        raise SyncError("weight sync would not include lm_head.weight: vLLM on CPU would keep "
                        "stale logits (see docs/guide/cpu-notes.md)")
    return names


def _load_in_place(worker, weights: list[tuple[str, Tensor]]) -> list[str]:
    """Runs inside the engine's worker: copy the stream into the live parameters; returns the
    engine parameters the stream did not reach."""
    model = worker.model_runner.get_model()
    with torch.no_grad():
        loaded = model.load_weights(iter(weights))
    return sorted({n for n, _ in model.named_parameters()} - set(loaded or ()))


def push_weights(llm, weights: list[tuple[str, Tensor]], *, in_place: bool) -> None:
    """Load the stream into the engine, then drop the prefix cache (its KV used old weights).

    Raises SyncError naming any engine parameter the in-place load left unwritten.
    """
    if in_place:
        missing = [m for per_worker in llm.collective_rpc(_load_in_place, args=(weights,)) for m in per_worker]
        if missing:
            raise SyncError(f"weight sync left {len(missing)} engine parameter(s) stale: "
                            f"{', '.join(missing[:6])}")
    else:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    llm.reset_prefix_cache()


def sync_tolerance(engine_dtype: torch.dtype, trainer_dtype: torch.dtype, max_abs_logp: float) -> float:
    """Largest |log μ − log π| on the check sequence that rounding alone explains.

    32 units in the last place of the coarser compute dtype, scaled by the log-probs' magnitude
    (errors in logits carry into log-probs in proportion). fp32: ~3e-5 at |log p| ≈ 6, against
    ~1e-6 measured for a correct sync and ~2e-2 for a stale output layer after one step.
    """
    eps = max(torch.finfo(engine_dtype).eps, torch.finfo(trainer_dtype).eps)
    return 32.0 * eps * (1.0 + max_abs_logp)


def check_sync(error: float, tolerance: float, step: int) -> float:
    """``error`` (max |log μ − log π| over the check sequence), or SyncError beyond ``tolerance``."""
    if not math.isfinite(error) or error > tolerance:
        raise SyncError(f"sync check at step {step}: vLLM's log-probs differ from the trainer's by up "
                        f"to {error:.3g} (tolerance {tolerance:.3g}): the engine is not computing "
                        f"with the trainer's weights")
    return error
