"""A host copy of what one optimiser step changes, restored bit for bit (SPEC §6c's live audit).

``HostSnapshot`` — the parameters (each rank's local shard), the optimiser's per-parameter state,
its param-group settings, any gradients and the torch RNG, copied to host memory, and restored in
place (a DTensor shard keeps its placement; a sharded gradient the audit's steps freed is rebuilt in
its parameter's mesh and placements; state the audit's steps created is removed again).
Host memory: the snapshot's ``nbytes`` (AdamW: parameters + two moments).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pdm_lab.errors import PDMInputError


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor shard → its local tensor


def _host_copy(t: Tensor) -> Tensor:
    return _local(t).detach().to("cpu", copy=True)


def _holds_its_data(t: Tensor) -> bool:
    """Whether ``t``'s storage still covers every element it addresses. FSDP2 frees a gathered
    parameter's storage on reshard (resized to 0 bytes) while the tensor keeps its shape; a copy
    into it would write through freed memory (SIGSEGV)."""
    if t.numel() == 0:
        return True
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.untyped_storage().nbytes() >= (last + 1) * t.element_size()


def _copy_into(live: Tensor, saved: Tensor, what: str) -> None:
    target = _local(live)
    if not _holds_its_data(target):
        raise PDMInputError(f"{what}: its storage was freed since the snapshot (an FSDP module's gathered copy, "
                            "not the shard the optimiser holds? take the snapshot on the shards); cannot restore "
                            "in place")
    target.copy_(saved)


@dataclass
class HostSnapshot:
    """What one optimiser step changes, on the host: take before the audit, restore after it."""

    params: list[Tensor]
    """each parameter's local shard."""
    grads: list[Tensor | None]
    """each parameter's gradient (None where it had none)."""
    state: list[dict | None]
    """the optimiser's state per parameter (None: it had none, e.g. before AdamW's first step)."""
    groups: list[dict] = field(default_factory=list)
    """the param groups' settings (lr, betas, …), without their parameter lists."""
    rng: Tensor | None = None
    """torch's CPU generator state."""

    @classmethod
    @torch.no_grad()
    def take(cls, params: list[Tensor], optimizer: torch.optim.Optimizer) -> "HostSnapshot":
        state = []
        for p in params:
            st = optimizer.state.get(p)
            state.append(None if not st else {k: _host_copy(v) if torch.is_tensor(v) else copy.deepcopy(v)
                                              for k, v in st.items()})
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        return cls(params=[_host_copy(p) for p in params],
                   grads=[None if p.grad is None else _host_copy(p.grad) for p in params],
                   state=state, groups=groups, rng=torch.get_rng_state())

    @property
    def nbytes(self) -> int:
        """Host bytes held (parameters, gradients, optimiser state)."""
        total = sum(t.numel() * t.element_size() for t in self.params)
        total += sum(t.numel() * t.element_size() for t in self.grads if t is not None)
        for st in self.state:
            total += sum(v.numel() * v.element_size() for v in (st or {}).values() if torch.is_tensor(v))
        return total

    def restore(self, params: list[Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Everything back, bit for bit, in place."""
        if len(params) != len(self.params):
            raise PDMInputError(f"params: {len(params)} tensors, the snapshot holds {len(self.params)}")
        restore_params(self, params)
        restore_optimizer(self, params, optimizer)
        if self.rng is not None:
            torch.set_rng_state(self.rng)


@torch.no_grad()
def restore_params(snap: HostSnapshot, params: list[Tensor]) -> None:
    """Parameters and gradients back from the snapshot (in place: shards keep their placement)."""
    for i, (p, saved, grad) in enumerate(zip(params, snap.params, snap.grads)):
        _copy_into(p, saved, f"params[{i}]")
        if grad is None:
            p.grad = None
        elif p.grad is not None:
            _copy_into(p.grad, grad, f"params[{i}].grad")
        elif hasattr(p, "to_local"):  # a sharded gradient the audited step freed: the parameter's own layout
            p.grad = _sharded_like(p, grad)
        else:  # freed by a zero_grad(set_to_none=True) of the audited step
            p.grad = grad.to(p.device, copy=True)


def _sharded_like(param: Tensor, local: Tensor) -> Tensor:
    """A DTensor gradient for the DTensor ``param`` from this rank's saved shard (FSDP2 keeps a
    gradient in its parameter's mesh and placements, the shapes its shard's)."""
    from torch.distributed.tensor import DTensor

    if tuple(local.shape) != tuple(param.to_local().shape):
        raise PDMInputError(f"params: a saved gradient shard has shape {tuple(local.shape)}, its parameter's "
                            f"local shard {tuple(param.to_local().shape)}; cannot rebuild it")
    return DTensor.from_local(local.to(param.to_local().device, copy=True), param.device_mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())


@torch.no_grad()
def restore_optimizer(snap: HostSnapshot, params: list[Tensor], optimizer: torch.optim.Optimizer) -> None:
    """The optimiser's state and param-group settings back from the snapshot; state created since
    (the first step of a fresh AdamW) is removed, so the next real step is its first again."""
    for p, saved in zip(params, snap.state):
        if saved is None:
            optimizer.state.pop(p, None)
            continue
        live = optimizer.state[p]
        for key in list(live):
            if key not in saved:
                del live[key]
        for key, value in saved.items():
            current = live.get(key)
            if torch.is_tensor(value) and torch.is_tensor(current) and _local(current).shape == value.shape:
                _copy_into(current, value, f"optimizer state {key!r}")
            elif torch.is_tensor(value):
                raise PDMInputError(f"optimizer state {key!r}: its tensor was replaced; cannot restore in place")
            else:
                live[key] = copy.deepcopy(value)
    for group, saved in zip(optimizer.param_groups, snap.groups):
        group.update(copy.deepcopy(saved))
