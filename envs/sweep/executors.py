"""Run independent jobs in parallel and yield results as they finish: local processes or Ray.

An executor maps a picklable top-level function over picklable jobs and yields
``(job, result)`` pairs in completion order. Nothing is written here: the caller stores each
result as it arrives, so a crash loses only the jobs still in flight.
"""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any, Callable, Iterable, Iterator

EXECUTORS = ("local", "ray")


def _init_worker() -> None:
    import torch

    from pdm_lab.lab.lifetime import die_with_parent

    die_with_parent()  # a killed sweep leaves no worker writing into --out
    torch.set_num_threads(1)


class LocalExecutor:
    """A spawn-context process pool (one torch thread per process; ``workers=1`` runs inline)."""

    def __init__(self, workers: int | None = None):
        self.workers = max(1, workers or os.cpu_count() or 1)

    def run(self, fn: Callable[[Any], Any], jobs: Iterable[Any]) -> Iterator[tuple[Any, Any]]:
        jobs = list(jobs)
        if self.workers == 1:  # inline, one torch thread, the caller's setting restored after
            import torch

            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                for job in jobs:
                    yield job, fn(job)
            finally:
                torch.set_num_threads(threads)
            return
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx,
                                 initializer=_init_worker) as pool:
            pending = {pool.submit(fn, job): job for job in jobs}
            try:
                while pending:
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        job = pending.pop(future)
                        yield job, future.result()
            finally:
                for future in pending:
                    future.cancel()


class RayExecutor:
    """Ray tasks (``pip install 'pdm_lab[ray]'``): a local instance, or the cluster at ``address``.

    Results return to this process, which writes them, so workers need no shared filesystem
    for the results table (per-step JSONL logs are written where the worker runs).
    """

    def __init__(self, workers: int | None = None, address: str | None = None):
        try:
            import ray
        except ImportError as err:  # optional dependency
            raise RuntimeError("--executor ray needs Ray: pip install 'pdm_lab[ray]'") from err
        self.ray = ray
        self.workers = workers
        self.address = address or os.environ.get("RAY_ADDRESS")

    def run(self, fn: Callable[[Any], Any], jobs: Iterable[Any]) -> Iterator[tuple[Any, Any]]:
        ray = self.ray
        started_here = not ray.is_initialized()
        if started_here:
            kwargs = {"address": self.address} if self.address else {"num_cpus": self.workers}
            ray.init(include_dashboard=False, log_to_driver=False, **kwargs)
        try:
            remote = ray.remote(num_cpus=1)(fn)
            pending = {remote.remote(job): job for job in jobs}
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    job = pending.pop(ref)
                    yield job, ray.get(ref)
        finally:
            for ref in list(locals().get("pending", {})):
                ray.cancel(ref, force=True)
            if started_here:
                ray.shutdown()


def make_executor(name: str = "local", workers: int | None = None, address: str | None = None):
    """``local`` (default) or ``ray``."""
    if name == "local":
        return LocalExecutor(workers)
    if name == "ray":
        return RayExecutor(workers, address)
    raise ValueError(f"executor: unknown {name!r}; valid: {', '.join(EXECUTORS)}")
