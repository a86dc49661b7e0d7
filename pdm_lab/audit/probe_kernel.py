"""The logit kernel K of SPEC §6d, as the own-update probe asks for it (``pdm_lab.audit.probe``).

A step on token t moves θ along ∇_θ log π_t(k) = J_tᵀ v_t (v_t = e_k − π_t, J_t = ∂z_t/∂θ), which
moves the token's own processed logits along K v_t = J_t J_tᵀ v_t (the empirical NTK; with a
diagonal preconditioner P: J_t P J_tᵀ v_t). ``LogitKernel`` is what a stage supplies;
``FunctionalKernel`` implements it for any single-process model written as a function of its
parameters: per probed row one backward (J_tᵀ v_t) and one forward-mode JVP or central difference
of the logits (J_t of that vector).
"""
from __future__ import annotations

from typing import Callable, Mapping, Protocol, runtime_checkable

import torch
from torch import Tensor

from pdm_lab.errors import PDMInputError, check_tensor


@runtime_checkable
class LogitKernel(Protocol):
    """What a stage (toy, loop, TRL) supplies for the own-update probe."""

    def kernel_v(self, rows: Tensor, v: Tensor, *, precondition: bool = False) -> Tensor:
        """K v [M, V] float64 for rows [M] (batch token rows) and v [M, V] float64: d z_t/dη when θ
        moves along P·∇_θ ⟨z_t, v_t⟩ (P = I, or the optimiser's diagonal preconditioner when
        ``precondition``), for each probed row t separately."""
        ...

    def head_kernel_v(self, rows: Tensor, v: Tensor) -> Tensor | None:
        """The output layer's own part of K v [M, V] (‖h_t‖²·v_t for a bias-free head), or None."""
        ...

    def unembedding(self) -> Tensor | None:
        """W [V, d] float64 (the kernel-aware test's a·I + b·W Wᵀ), or None."""
        ...


def _rows_and_v(rows: Tensor, v: Tensor, n: int, vocab: int) -> list[int]:
    check_tensor("rows", rows, ndim=1, integer=True)
    check_tensor("v", v, ndim=2, floating=True)
    if v.shape != (rows.numel(), vocab):
        raise PDMInputError(f"v has shape {tuple(v.shape)}, expected {(rows.numel(), vocab)} (one row per probed row)")
    bad = (rows < 0) | (rows >= n)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise PDMInputError(f"rows: position {i} is {int(rows[i])}, outside the batch's {n} token rows")
    return [int(r) for r in rows]


class FunctionalKernel:
    """``LogitKernel`` of a model given as ``logits_fn(params) -> [N, V]`` processed logits (float64).

    Args:
        logits_fn: the batch's processed logits (after temperature) as a function of a parameter
            dict (e.g. ``torch.func.functional_call(model, params, inputs) / T``).
        params: name → tensor (float64 for a float64 probe), the point θ.
        preconditioner: name → diagonal P (same shapes), for ``precondition=True`` (Adam:
            1/(√v̂ + ε)); None: P = I.
        head_names: the output layer's parameters (``head_kernel_v``: K restricted to them).
        unembedding_name: the parameter holding W [V, d] (``unembedding``), or None.
        method: ``"jvp"`` (forward-mode AD) or ``"central"`` ((z(θ + εu) − z(θ − εu))/2ε).
        eps: the central difference's ε; None: τ·max(‖θ‖, 1)/‖u‖ with τ = eps_dtype^(1/3).
    """

    def __init__(self, logits_fn: Callable[[dict[str, Tensor]], Tensor], params: Mapping[str, Tensor], *,
                 preconditioner: Mapping[str, Tensor] | None = None, head_names: tuple[str, ...] = (),
                 unembedding_name: str | None = None, method: str = "jvp", eps: float | None = None):
        if method not in ("jvp", "central"):
            raise PDMInputError(f"method: 'jvp' or 'central', got {method!r}")
        self.logits_fn = logits_fn
        self.params = {k: p.detach() for k, p in params.items()}
        for name in (*head_names, *([unembedding_name] if unembedding_name else [])):
            if name not in self.params:
                raise PDMInputError(f"{name!r}: not a parameter name; valid: {', '.join(self.params)}")
        if preconditioner is not None and set(preconditioner) != set(self.params):
            raise PDMInputError("preconditioner: needs one tensor per parameter name, "
                                f"missing {sorted(set(self.params) - set(preconditioner))}")
        self.preconditioner = None if preconditioner is None else {k: q.detach() for k, q in preconditioner.items()}
        self.head_names = tuple(head_names)
        self.unembedding_name = unembedding_name
        self.method, self.eps = method, eps

    def _pullbacks(self, rows: Tensor, v: Tensor) -> tuple[Tensor, list[dict[str, Tensor]]]:
        z, pull = torch.func.vjp(self.logits_fn, self.params)
        index = _rows_and_v(rows, v, z.shape[0], z.shape[1])
        grads = []
        for i, t in enumerate(index):
            cot = torch.zeros_like(z)
            cot[t] = v[i].to(z.dtype)
            (g,) = pull(cot)  # J_tᵀ v_t = ∇_θ ⟨z_t, v_t⟩
            grads.append(g)
        return z.detach(), grads

    def directional(self, u: Mapping[str, Tensor]) -> Tensor:
        """[N, V] J u: the change of every row's processed logits along the parameter direction u."""
        u = {k: u.get(k, torch.zeros_like(p)) for k, p in self.params.items()}
        if self.method == "jvp":
            _, out = torch.func.jvp(self.logits_fn, (self.params,), (u,))
            return out.double()
        eps = self.eps
        if eps is None:
            norm = lambda d: float(torch.sqrt(sum((x.double() ** 2).sum() for x in d.values())))  # noqa: E731
            u_norm = norm(u)
            if u_norm == 0.0:
                return torch.zeros_like(self.logits_fn(self.params)).double()
            tau = torch.finfo(next(iter(self.params.values())).dtype).eps ** (1.0 / 3.0)
            eps = tau * max(norm(self.params), 1.0) / u_norm
        plus = self.logits_fn({k: p + eps * u[k] for k, p in self.params.items()})
        minus = self.logits_fn({k: p - eps * u[k] for k, p in self.params.items()})
        return ((plus - minus) / (2.0 * eps)).double()

    def kernel_v(self, rows: Tensor, v: Tensor, *, precondition: bool = False) -> Tensor:
        if precondition and self.preconditioner is None:
            raise PDMInputError("precondition=True: this kernel was given no preconditioner")
        _, grads = self._pullbacks(rows, v)
        out = []
        for t, g in zip(rows.tolist(), grads):
            if precondition:
                g = {k: x * self.preconditioner[k] for k, x in g.items()}
            out.append(self.directional(g)[t])
        return torch.stack(out) if out else v.new_zeros(v.shape, dtype=torch.float64)

    def head_kernel_v(self, rows: Tensor, v: Tensor) -> Tensor | None:
        if not self.head_names:
            return None
        _, grads = self._pullbacks(rows, v)
        out = [self.directional({k: g[k] for k in self.head_names})[t] for t, g in zip(rows.tolist(), grads)]
        return torch.stack(out) if out else v.new_zeros(v.shape, dtype=torch.float64)

    def unembedding(self) -> Tensor | None:
        return None if self.unembedding_name is None else self.params[self.unembedding_name].double()


class InPlaceKernel:
    """``LogitKernel`` of any model, FSDP2 shards included, by central differences of forward passes
    at θ ± εu (``pdm_lab.audit.central_difference``; parameters perturbed in place, restored bit-exactly).

    Args:
        params: the model's parameters (plain or DTensor shards).
        logits_fn: ``() -> [M, V]`` processed logits (after temperature, float64 head) of this
            rank's probed rows at the current θ, differentiable w.r.t. the parameters. Collective.
        preconditioner: per-parameter diagonal P (``adam_preconditioner``), or None (P = I).
        head_fn: ``(rows, v) -> [M, V]`` the output layer's own part of K v (e.g. ‖h_t‖²·v_t/T²), or None.
        unembedding: W [V, d] float64, or None.
        compute_dtype: the forward's dtype (sets the central difference's τ).

    Collective: every rank calls ``kernel_v``/``directional`` at once (with its own rows, possibly
    none). A backward under FSDP averages the ranks' gradients, so J_tᵀv_t is taken one rank's row
    at a time (the others pass v = 0) and multiplied by the world size.
    """

    def __init__(self, params: list[Tensor], logits_fn: Callable[[], Tensor], *,
                 preconditioner: list[Tensor] | None = None, head_fn=None, unembedding: Tensor | None = None,
                 compute_dtype: torch.dtype = torch.float32):
        self.params, self.logits_fn = params, logits_fn
        self.preconditioner, self.head_fn, self._unembedding = preconditioner, head_fn, unembedding
        self.compute_dtype = compute_dtype

    def directional(self, u: list[Tensor]) -> Tensor:
        """[M, V] J u for this rank's probed rows along the parameter direction u (collective)."""
        from pdm_lab.audit.central_difference import central_difference, choose_eps

        with torch.no_grad():
            base = self.logits_fn().double()
        eps = choose_eps(self.params, u, self.logits_fn, base, self.compute_dtype)
        if eps == 0.0:
            return torch.zeros_like(base)
        return central_difference(self.params, u, self.logits_fn, eps)

    def _pullback(self, row: int | None, v_row: Tensor | None) -> list[Tensor]:
        from pdm_lab.audit.central_difference import _world

        for p in self.params:
            p.grad = None
        z = self.logits_fn()
        target = (z[row] * v_row.to(z.dtype)).sum() if row is not None else (z * 0.0).sum()
        (target * _world()).backward()  # FSDP averages over ranks: ×world gives this rank's row alone
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in self.params]
        for p in self.params:
            p.grad = None
        return grads

    def kernel_v(self, rows: Tensor, v: Tensor, *, precondition: bool | list[Tensor] = False) -> Tensor:
        """As ``LogitKernel.kernel_v``; ``precondition`` may also be an explicit per-parameter P."""
        from pdm_lab.audit.central_difference import _world

        scale = self.preconditioner if precondition is True else (precondition or None)
        if precondition is True and scale is None:
            raise PDMInputError("precondition=True: this kernel was given no preconditioner")
        counts = torch.zeros(max(_world(), 1), dtype=torch.int64)
        rank = torch.distributed.get_rank() if _world() > 1 else 0
        counts[rank] = rows.numel()
        if _world() > 1:
            torch.distributed.all_reduce(counts)
        out = torch.zeros(rows.numel(), v.shape[-1], dtype=torch.float64)
        for owner in range(counts.numel()):
            for i in range(int(counts[owner])):
                mine = owner == rank
                g = self._pullback(int(rows[i]) if mine else None, v[i] if mine else None)
                u = g if scale is None else [x * q for x, q in zip(g, scale)]
                moved = self.directional(u)
                if mine:
                    out[i] = moved[int(rows[i])].cpu()
        return out

    def head_kernel_v(self, rows: Tensor, v: Tensor) -> Tensor | None:
        return None if self.head_fn is None else self.head_fn(rows, v)

    def unembedding(self) -> Tensor | None:
        return self._unembedding
