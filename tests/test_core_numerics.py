"""No NaN or inf from finite input, at the edges of the simplex (SPEC §8)."""
import torch
from hypothesis import given, strategies as st

from pdm_lab import diagnose
from pdm_lab.numerics import log1mexp


def _check_finite(out):
    for key, value in out.items():
        if value.is_floating_point():
            assert torch.isfinite(value).all(), key


def _edge_logps(kind: str, n: int, gen):
    if kind == "tiny":  # probabilities down to 1e-40
        z = torch.rand(2, n, generator=gen, dtype=torch.float64) * -92.0
        z[:, 0] = 0.0
    elif kind == "onehot":  # one-hot up to float64 rounding: the rest at −inf
        z = torch.full((2, n), float("-inf"), dtype=torch.float64)
        z[:, 0] = 0.0
    elif kind == "uniform":
        z = torch.zeros(2, n, dtype=torch.float64)
    else:
        z = torch.randn(2, n, generator=gen, dtype=torch.float64) * 3
    return torch.log_softmax(z, dim=-1)


@given(kind_mu=st.sampled_from(["tiny", "uniform", "random", "onehot"]),
       kind_pi=st.sampled_from(["tiny", "uniform", "random"]), n=st.integers(1, 300),
       k=st.integers(1, 400), seed=st.integers(0, 10**6), same=st.booleans(),
       dtype=st.sampled_from([torch.float64, torch.float32]))
def test_finite_everywhere(kind_mu, kind_pi, n, k, seed, same, dtype):
    gen = torch.Generator().manual_seed(seed)
    mu = _edge_logps(kind_mu, n, gen).to(dtype)
    pi = mu.clone() if same else _edge_logps(kind_pi, n, gen).to(dtype)
    sampled = torch.argmax(mu, dim=1)
    out = diagnose(mu, pi, sampled, torch.tensor([1.0, -1.0], dtype=dtype), k=k)
    _check_finite(out)
    if same:
        assert torch.allclose(out["topk_kl"], torch.zeros_like(out["topk_kl"]), atol=1e-6)
        assert torch.allclose(out["ddot_exact"], torch.zeros_like(out["ddot_exact"]), atol=1e-6)


def test_log1mexp_accuracy_at_both_ends():
    x = torch.tensor([-1e-20, -1e-8, -0.5, -0.7, -40.0, -800.0], dtype=torch.float64)
    import mpmath
    with mpmath.workdps(60):
        ref = [float(mpmath.log(1 - mpmath.exp(mpmath.mpf(v)))) for v in x.tolist()]
    ref = torch.tensor(ref, dtype=torch.float64)
    torch.testing.assert_close(log1mexp(x), ref, rtol=1e-14, atol=0)
    assert log1mexp(torch.tensor([0.0])).item() == float("-inf")
    assert log1mexp(torch.tensor([float("-inf")])).item() == 0.0
