"""``HostSnapshot`` under FSDP2 with gradients accumulated before the audit (TRL's pending audit
runs just before the optimiser step): the audited steps free the sharded gradients
(``zero_grad(set_to_none=True)``), and the restore rebuilds them as DTensors in their parameter's
layout, so the real step that follows is the step of a run without the audit, bit for bit. Two
real gloo ranks."""
from __future__ import annotations

import torch

from loop_helpers import run_ranks


class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 5), torch.nn.Linear(5, 1)  # 5 rows: uneven shards (3 + 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _worker(rank: int, world: int, store_path: str, queue) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from pdm_lab.audit.snapshot import HostSnapshot

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))

    def run(audit: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = _Two()
        fully_shard(model)
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=1e-2)
        model(x).square().mean().backward()  # the trainer's accumulated gradients
        if audit:
            snap = HostSnapshot.take(params, opt)
            opt.zero_grad(set_to_none=True)  # an audited step, as the stage takes it
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            snap.restore(params, opt)
            assert all(type(p.grad) is type(p) and p.grad.placements == p.placements for p in params)
        opt.step()  # the real step
        return [p.to_local().detach().clone() for p in params]

    try:
        plain, audited = run(False), run(True)
        queue.put((rank, all(torch.equal(a, b) for a, b in zip(plain, audited))))
    except Exception as err:  # said to the test, not left to its timeout
        queue.put((rank, f"{type(err).__name__}: {err}"))
    dist.destroy_process_group()


def test_a_restore_rebuilds_freed_sharded_gradients_and_the_real_step_is_unchanged(tmp_path):
    results = run_ranks(_worker, str(tmp_path / "store"), timeout=180)
    assert results == [(0, True), (1, True)], results
