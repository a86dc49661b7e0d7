"""Process group and rank layout of a run.

Under ``torchrun`` the usual environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) is
there; a plain single process gets a world of one with the same code path (vLLM's external
launcher reads the same variables). Backends: gloo on CPU; ``cpu:gloo,cuda:nccl`` on GPU so
metric reductions on CPU tensors and FSDP's collectives on GPU tensors both have a backend.

Layout: ranks form data-parallel groups of ``rollout.tensor_parallel_size`` consecutive ranks.
Group ``dp_rank`` rolls out its slice of the step's prompts; inside a group the engines run the
same requests (tensor parallel) and each rank trains on its ``tp_rank``-th part of the sequences.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import socket

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Layout:
    rank: int
    world: int
    local_rank: int
    tp: int
    device: torch.device
    local_world: int = 1

    @property
    def dp(self) -> int:
        return self.world // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: str, tensor_parallel_size: int) -> Layout:
    """Initialise the default process group (idempotent) and return the rank layout."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        if backend == "auto":
            backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tensor_parallel_size:
        raise ValueError(f"world size {world} is not a multiple of rollout.tensor_parallel_size "
                         f"{tensor_parallel_size}")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return Layout(rank=rank, world=world, local_rank=local_rank, tp=tensor_parallel_size, device=device,
                  local_world=local_world)


def default_ranks() -> int:
    """Ranks per node when ``launch.nproc_per_node`` is 0: one per GPU; one on a CPU host.

    CPU ranks on one host would share its cores and memory bandwidth, and each rank adds
    collectives to every step (vLLM's data-parallel sync per decode step, FSDP's gathers, the
    weight sync): measured on 2 cores, 2 ranks took 1.7× the step time of one rank. One process
    uses all the cores through threads instead.
    """
    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1


def threads_per_rank(requested: int, hidden_size: int, ranks_here: int) -> int:
    """Intra-op threads of each rank: ``requested``, or (0) the cores per rank, capped at one
    thread per 256 hidden units.

    The cap: a matmul over a few dozen features is done before threads can be woken, and an
    OpenMP team that waits on a busy core stalls the whole decode step (on a shared 2-core
    machine the tiny model generated 25× slower with 2 threads than with 1).
    """
    if requested > 0:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores // max(1, ranks_here), hidden_size // 256))


def _many() -> bool:
    """More than one rank (a world of one needs no collective)."""
    return dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(values: list[float]) -> list[float]:
    if not _many():
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(values: list[float]) -> list[float]:
    if not _many():
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s `obj` on every rank (collective); `obj` itself without a process group."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
