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


def _local_bytes(p: Tensor) -> int:
    t = p.to_local() if hasattr(p, "to_local") else p
    return t.numel() * t.element_size()


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

    The kernel is a view at one θ (the audit's θ₀: every call leaves the parameters bit-exactly
    there), so the logits at θ and each row's pullback J_tᵀv_t are computed once and reused — the
    probe asks for K v and J P Jᵀ v, and the decomposition for J P' Jᵀ v with each rule's P', of
    the same v — as long as the pullbacks fit in ``pullback_cache_bytes`` (per rank).
    """

    def __init__(self, params: list[Tensor], logits_fn: Callable[[], Tensor], *,
                 preconditioner: list[Tensor] | None = None, head_fn=None, unembedding: Tensor | None = None,
                 compute_dtype: torch.dtype = torch.float32, pullback_cache_bytes: int = 2 ** 30,
                 row_logits_fn: Callable[[int | None], Tensor] | None = None):
        self.params, self.logits_fn = params, logits_fn
        self.preconditioner, self.head_fn, self._unembedding = preconditioner, head_fn, unembedding
        self.compute_dtype = compute_dtype
        self.pullback_cache_bytes = pullback_cache_bytes
        #: ``row_logits_fn(t) -> [1, V]``: probed row t's logits from a forward of its own sequence
        #: alone (None: any one sequence of this rank, for a rank that only joins the collective).
        #: ``kernel_v`` then forwards one sequence per pass instead of every probed one.
        self.row_logits_fn = row_logits_fn
        self._base: Tensor | None = None
        self._row_base: dict[tuple[int, int], tuple[int | None, Tensor]] = {}
        self._pullbacks: dict[tuple[int, int], tuple[int | None, Tensor | None, list[Tensor]]] = {}
        self.passes = {"forward": 0, "backward": 0}  # what the probe cost (forwards, backwards)

    def _logits_at_theta(self) -> Tensor:
        if self._base is None:
            with torch.no_grad():
                self._base = self.logits_fn().double()
            self.passes["forward"] += 1
        return self._base

    def _row_view(self, owner: int, i: int, row: int | None
                  ) -> tuple[Callable[[], Tensor], Callable[[], Tensor], int | None]:
        """(forward, its logits at θ, the row of ``row`` in the forward's output) for the owner's i-th
        probed row: a forward of its own sequence where ``row_logits_fn`` is given, else of every
        probed row. Collective: the logits at θ are cached per (owner, i), and every rank agrees on
        hit or miss, since under FSDP a forward on one rank is a forward on all."""
        if self.row_logits_fn is None:
            return self.logits_fn, self._logits_at_theta, row

        def forward() -> Tensor:
            return self.row_logits_fn(row)

        def base() -> Tensor:
            cached = self._row_base.get((owner, i))
            if self._all_agree(cached is not None and (row is None or cached[0] == row)):
                return cached[1]
            with torch.no_grad():
                z = forward().double()
            self.passes["forward"] += 1
            self._row_base[(owner, i)] = (row, z)
            return z

        return forward, base, None if row is None else 0

    def _all_agree(self, *flags: bool) -> bool | tuple[bool, ...]:
        """Each flag AND-ed over the ranks (one collective): a cache is used only where every rank has it."""
        from pdm_lab.audit.central_difference import _world

        device = (self.params[0].to_local() if hasattr(self.params[0], "to_local") else self.params[0]).device
        both = torch.tensor([int(f) for f in flags], dtype=torch.int64, device=device)  # nccl: device tensors
        if _world() > 1:
            torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MIN)
        out = tuple(bool(x) for x in both.cpu())
        return out[0] if len(out) == 1 else out

    def directional(self, u: list[Tensor]) -> Tensor:
        """[M, V] J u for this rank's probed rows along the parameter direction u (collective)."""
        return self._directional(self.logits_fn, self._logits_at_theta, u)

    def _directional(self, forward: Callable[[], Tensor], base_fn: Callable[[], Tensor], u: list[Tensor]) -> Tensor:
        from pdm_lab.audit.central_difference import central_difference, choose_eps

        base = base_fn()
        eps = choose_eps(self.params, u, forward, base, self.compute_dtype)
        self.passes["forward"] += 1 if eps == 0.0 else 3
        if eps == 0.0:
            return torch.zeros_like(base)
        return central_difference(self.params, u, forward, eps)

    def _pullback(self, row: int | None, v_row: Tensor | None, forward: Callable[[], Tensor] | None = None,
                  index: int | None = None) -> list[Tensor]:
        from pdm_lab.audit.central_difference import _world

        for p in self.params:
            p.grad = None
        self.passes["forward"] += 1
        self.passes["backward"] += 1
        z = (forward or self.logits_fn)()
        at = row if forward is None else index
        target = (z[at] * v_row.to(z.dtype)).sum() if row is not None else (z * 0.0).sum()
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
                row = int(rows[i]) if mine else None
                forward, base, at = self._row_view(owner, i, row)
                g = self._cached_pullback(owner, i, row, v[i] if mine else None, forward, at)
                u = g if scale is None else [x * q for x, q in zip(g, scale)]
                moved = self._directional(forward, base, u)
                if mine:
                    out[i] = moved[at].cpu()
        return out

    def _cached_pullback(self, owner: int, i: int, row: int | None, v_row: Tensor | None,
                         forward: Callable[[], Tensor] | None = None, at: int | None = None) -> list[Tensor]:
        """``_pullback`` of the owner's i-th row, from the cache when every rank holds it (the owner
        for the same row and v). Collective: the ranks agree on hit or miss, since under FSDP each
        holds its own shard of the owner's J_tᵀv_t."""
        key = (owner, i)
        cached = self._pullbacks.get(key)
        hit = cached is not None and (row is None or (cached[0] == row and torch.equal(cached[1], v_row)))
        room = (len(self._pullbacks) + 1) * sum(_local_bytes(p) for p in self.params) <= self.pullback_cache_bytes
        hit, room = self._all_agree(hit, room)
        if hit:
            return cached[2]
        grads = self._pullback(row, v_row, None if forward is self.logits_fn else forward, at)
        if room:
            self._pullbacks[key] = (row, None if v_row is None else v_row.clone(), grads)
        return grads

    def head_kernel_v(self, rows: Tensor, v: Tensor) -> Tensor | None:
        return None if self.head_fn is None else self.head_fn(rows, v)

    def unembedding(self) -> Tensor | None:
        return self._unembedding
