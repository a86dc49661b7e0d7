"""Random distributions for the core tests (float64, seeded)."""
import torch


def random_logp(n_rows: int, n: int, seed: int, *, scale: float = 2.0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(n_rows, n, generator=gen, dtype=dtype) * scale, dim=-1)


def mismatched_pair(n_rows: int, n: int, seed: int, *, scale: float = 2.0, noise: float = 0.5):
    """(μ, π) log-probs: π = μ's logits + Gaussian noise, renormalised."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n_rows, n, generator=gen, dtype=torch.float64) * scale
    mu = torch.log_softmax(z, dim=-1)
    pi = torch.log_softmax(z + noise * torch.randn(n_rows, n, generator=gen, dtype=torch.float64), dim=-1)
    return mu, pi


def sample_from(logp, seed: int):
    gen = torch.Generator().manual_seed(seed + 7)
    return torch.multinomial(torch.exp(logp), 1, generator=gen)[:, 0]


def kl_along(mu_row, z_row, v_row, eta):
    """KL(μ ‖ softmax(z + ηv)) for one row, float64."""
    lq = torch.log_softmax(z_row + eta * v_row, dim=-1)
    p = torch.exp(mu_row)
    return torch.where(p > 0, p * (mu_row - lq), torch.zeros_like(p)).sum()
