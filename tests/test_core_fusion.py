"""What the compiled graphs write to memory: the fused paths stay fused.

On CPU, inductor writes an ``exp`` with several users to memory as its own buffer, so a shared
μ = exp(log μ) over [N, m] costs a fresh allocation and a pass on every call
(``numerics.exp_per_use``). These tests read the code inductor generates and list the 2-D buffers
each graph allocates: the stats graph must allocate none, and a planted shared ``exp`` shows the
check can fail.
"""
from __future__ import annotations

import re

import pytest
import torch

from core_helpers import mismatched_pair, sample_from

pytestmark = pytest.mark.compile


def buffers_2d(fn, *args) -> list[tuple[str, str]]:
    """The 2-D buffers (shapes as inductor writes them) that compiling `fn` allocates."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):  # a cache hit generates no code
        _, codes = run_and_get_code(torch.compile(fn, dynamic=True), *args)
    assert codes, "inductor generated no code"
    return re.findall(r"empty_strided_cpu\(\((\w+), (\w+)\)", "\n".join(codes))


def _stats_args(binary: bool):
    from pdm_lab.policy_side import policy_on_support
    from pdm_lab.support import support_from_full

    mu, pi = mismatched_pair(40, 200, 3, noise=1.0)
    mu, pi = mu.float(), pi.float()
    support = support_from_full(mu, sample_from(mu, 0), k=20)
    pol = policy_on_support(pi, support.ids)
    return (support.mu_logp, pol.logp.detach(), support.mu_tail_logp, pol.tail_logp, pol.tail_log_sumsq,
            support.k_index, support.tail_count, support.mu_kth_logp, None, binary)


@pytest.mark.parametrize("binary", [False, True])
def test_compiled_stats_write_no_row_by_support_buffer(binary):
    from pdm_lab.tokenwise import _token_stats_math

    assert buffers_2d(_token_stats_math, *_stats_args(binary)) == []


def test_a_shared_exp_is_written_as_a_buffer_planted():
    """The planted form: μ, π exponentiated once and shared by three row sums."""

    def shared(mu_logp, pi_logp):
        mu, pi = torch.exp(mu_logp), torch.exp(pi_logp)
        diff = mu - pi
        return (torch.where(mu > 0, mu * (mu_logp - pi_logp), 0.0).sum(1), diff.abs().sum(1),
                (pi * diff).sum(1))

    mu_logp, pi_logp = _stats_args(False)[:2]
    assert len(buffers_2d(shared, mu_logp, pi_logp)) == 2


def test_compiling_under_a_lowered_isa_falls_back_to_eager_with_one_warning(monkeypatch):
    """ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU: torch 2.13's inductor miscomputes int64 selects
    there, so ``maybe_compiled`` hands back the eager function and says why, once."""
    import warnings

    from pdm_lab.fast import compiled as fc

    def fn(x):
        return x + 1

    monkeypatch.setattr(fc, "_cpu_flags", lambda: {"avx2", "avx512f"})
    monkeypatch.setattr(fc, "_WARNED", [])
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert fc.maybe_compiled(fn, True) is fn and fc.maybe_compiled(fn, True) is fn
    assert len([w for w in seen if "ATEN_CPU_CAPABILITY=avx2" in str(w.message)]) == 1
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    assert fc.lowered_isa() is None
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert fc.lowered_isa() is None
    monkeypatch.setattr(fc, "_cpu_flags", lambda: {"avx2"})  # an AVX2 CPU: nothing is lowered
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert fc.lowered_isa() is None
