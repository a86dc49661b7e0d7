"""Row primitives over [N, m] blocks that support construction runs, each beside its naive reference.

The same pure function runs eagerly or under ``torch.compile`` (``compiled.py``). Eager torch
pays once per pass over memory, so it wants few passes and skips work the data does not need;
inductor fuses elementwise work into one loop over each row, but writes a few ops (``cat``,
``argmax``, ``sort``) as their own buffer or a scalar loop. Each primitive below picks its form
with ``torch.compiler.is_compiling()``; ``*_reference`` is the plain definition, and
``tests/test_core_rowops.py`` checks eager, compiled and reference agree.
"""
from __future__ import annotations

import torch
from torch import Tensor

_NEG_INF = float("-inf")


def when(flag: Tensor) -> bool:
    """Whether to run a step that is a no-op wherever the 0-d bool `flag` is False.

    Eager reads the flag and skips the pass; compiled code always runs the step (fused into the
    same loop, and a branch on data would break the graph), so the step must be harmless then.
    """
    return torch.compiler.is_compiling() or bool(flag)


def any_true(mask: Tensor) -> Tensor:
    """0-d bool: some entry of the bool tensor is True. Eager: a max over its bytes (torch's bool
    ``any`` is a scalar loop, ~30× slower on a [65536, 20] block); compiled: ``any``."""
    if torch.compiler.is_compiling():
        return mask.any()
    if mask.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=mask.device)
    return mask.view(torch.uint8).amax() > 0


def all_true(mask: Tensor) -> Tensor:
    """0-d bool: every entry of the bool tensor is True (True when empty); see ``any_true``."""
    if torch.compiler.is_compiling():
        return mask.all()
    if mask.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=mask.device)
    return mask.view(torch.uint8).amin() > 0


def append_column(x: Tensor, column: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """[N, m] and [N] → [N, m + 1] in `dtype` (default x's). Eager: one write into a fresh buffer.
    Compiled: a pad plus a select, which fuses with what follows; inductor's ``cat`` writes its
    own buffer first (measured ~25% slower)."""
    dtype = x.dtype if dtype is None else dtype
    m = x.shape[1]
    if not torch.compiler.is_compiling():
        out = torch.empty(x.shape[0], m + 1, dtype=dtype, device=x.device)
        out[:, :m] = x  # casts in the same pass
        out[:, m] = column
        return out
    last = torch.arange(m + 1, device=x.device) == m
    return torch.where(last, column[:, None], torch.nn.functional.pad(x, (0, 1))).to(dtype)


def append_column_reference(x: Tensor, column: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    return torch.cat([x, column[:, None].to(x.dtype)], dim=1).to(x.dtype if dtype is None else dtype)


def first_true(mask: Tensor) -> tuple[Tensor, Tensor]:
    """[N, m] bool → (any [N] bool, the first True column [N] int64, 0 where none).

    Eager: one ``max`` over the row gives both. Compiled: inductor's CPU ``argmax`` is a scalar
    loop; ``any`` and a masked ``amin`` of column numbers vectorise."""
    if mask.shape[1] == 0:
        return mask.any(dim=1), torch.zeros(mask.shape[0], dtype=torch.int64, device=mask.device)
    if not torch.compiler.is_compiling():
        found, index = mask.max(dim=1)  # max returns the first maximal index
        return found, index
    m = mask.shape[1]
    col = torch.arange(m, device=mask.device)
    return mask.any(dim=1), torch.where(mask, col, m).amin(dim=1) % m  # none → m → 0


def first_true_reference(mask: Tensor) -> tuple[Tensor, Tensor]:
    index = [int(row.nonzero()[0, 0]) if bool(row.any()) else 0 for row in mask]
    return mask.any(dim=1), torch.tensor(index, dtype=torch.int64, device=mask.device)


def head_log_mass(logp: Tensor, *, for_tail: bool = False) -> Tensor:
    """log Σ_j exp(logp_j) per row ([N, m] → [N]), −inf for an empty row.

    log(Σ exp) is exact enough while the sum is far from underflow (a head holding μ's top token
    has mass ≥ 1/n); rows below e⁻⁶⁰ fall back to ``logsumexp``: eagerly only when a row needs
    it, compiled always (fused into the same pass, at a second exp per entry). With `for_tail`
    the caller wants only log μ_T = log1mexp(head), which is −e^head there, within 1e-26 of 0
    whatever the head's rounding: no fallback (eager and compiled alike), and a sum that
    underflowed (log → −inf) gives log μ_T = 0 exactly. Compiled code keeps log(Σ exp) too,
    though ``logsumexp`` alone would save an exp: μ_T = 1 − e^head is ill-conditioned where the
    head holds nearly all the mass, and a different rounding of the head moves log μ_T by up to
    log 2 there (measured), so both paths round the head alike."""
    if logp.shape[1] == 0:
        return logp.new_full((logp.shape[0],), _NEG_INF)
    head = torch.log(torch.exp(logp).sum(dim=1))
    if for_tail:
        return head
    small = head < -60.0  # also catches a sum that underflowed to 0 (log → −inf)
    if when(any_true(small)):
        head = torch.where(small, torch.logsumexp(logp, dim=1), head)
    return head


def head_log_mass_reference(logp: Tensor) -> Tensor:
    return torch.logsumexp(logp, dim=1)


#: Rows per chunk of the eager duplicate check: the transposed chunk and its compare buffer
#: ([m, rows] int32 each, ~0.65 MB at m = 20) stay in a core's L2 cache.
DUPLICATE_CHUNK_ROWS = 8192


def any_duplicate(ids: Tensor) -> Tensor:
    """0-d bool: some row of ids ([N, m] integer, negative = padding) holds a real id twice.

    Each column j is compared with column j + s for every shift s = 1 … m − 1 (all m(m − 1)/2
    pairs), with a negative entry of column j mapped to −1 − j so that two pads never match and
    each pair test stays one compare. Eager: on the transposed block, chunk by chunk of
    ``DUPLICATE_CHUNK_ROWS`` rows, so that each shift is one compare over contiguous memory in
    cache, written as the ids' own integer type: torch vectorises a compare whose output has its
    inputs' dtype, not one into bool (measured on [65536, 20] int32, one thread: 3.6 ms, against
    10.6 ms for whole-block compares into bool and 17.7 ms for a sort of each row). Compiled: the
    pairs fused into one pass."""
    m = ids.shape[1]
    if m < 2 or ids.shape[0] == 0:
        return torch.zeros((), dtype=torch.bool, device=ids.device)
    if not torch.compiler.is_compiling():
        # an accelerator runs the whole block at once (a chunk is a kernel launch per compare)
        chunk = DUPLICATE_CHUNK_ROWS if ids.device.type == "cpu" else ids.shape[0]
        # one 0/1 result per chunk and shift: read once at the end (no host sync per compare)
        found = torch.zeros(-(-ids.shape[0] // chunk), m - 1, dtype=ids.dtype, device=ids.device)
        equal = torch.empty(m - 1, min(chunk, ids.shape[0]), dtype=ids.dtype, device=ids.device)
        pad = None
        for c, lo in enumerate(range(0, ids.shape[0], chunk)):
            cols = ids[lo:lo + chunk].T.contiguous()
            if int(cols.min()) < 0:
                pad = -1 - torch.arange(m, device=ids.device, dtype=cols.dtype) if pad is None else pad
                cols = torch.where(cols < 0, pad[:, None], cols)
            rows = cols.shape[1]
            for s in range(1, m):
                out = equal[:m - s, :rows]
                torch.eq(cols[s:], cols[:-s], out=out)
                torch.amax(out, out=found[c, s - 1])
        return found.amax() > 0
    cols = [torch.where(ids[:, j] >= 0, ids[:, j], -1 - j) for j in range(m)]
    dup = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for i in range(m - 1):
        for j in range(i + 1, m):
            dup = dup | (cols[i] == cols[j])
    return dup.any()


def any_duplicate_reference(ids: Tensor) -> Tensor:
    dup = any(len(set(real)) < len(real) for real in ([i for i in row if i >= 0] for row in ids.tolist()))
    return torch.tensor(dup, device=ids.device)


def rows_ordered(ids: Tensor, logp: Tensor) -> Tensor:
    """0-d bool: every row ([N, m] ids, logp; padding id < 0 with logp −inf) is ordered by logp
    descending, ties to the lower id, padding last: the order of μ's top-K (SPEC §2)."""
    return ~any_true(rows_out_of_order(ids, logp))


def _pairs_in_order(a: Tensor, b: Tensor, left: Tensor, right: Tensor) -> Tensor:
    """Neighbours (logp a, b; ids left, right) in μ's top-K order: descending logp, ties to the
    lower id, padding (id < 0) only after padding or at the end."""
    return ((a > b) | ((a == b) & (left < right)) | (right < 0)) & ~((left < 0) & (right >= 0))


def rows_out_of_order(ids: Tensor, logp: Tensor) -> Tensor:
    """[N] bool: the rows not in μ's top-K order (see ``rows_ordered``).

    Eager: only rows where strict descent fails somewhere (a tie, padding, or a rise; the usual
    engine row has none) can be out of order, and the full test runs on those alone. Compiled:
    the full test on every row, fused."""
    if logp.shape[1] < 2:
        return torch.zeros(logp.shape[0], dtype=torch.bool, device=logp.device)
    if torch.compiler.is_compiling():
        return ~_pairs_in_order(logp[:, :-1], logp[:, 1:], ids[:, :-1], ids[:, 1:]).all(dim=1)
    out = torch.zeros(logp.shape[0], dtype=torch.bool, device=logp.device)
    # 1.0 where a step descends strictly (a tie, a rise, padding's −inf vs −inf or a NaN: 0.0),
    # into logp's dtype: torch vectorises that compare, not one into bool (float32 for a half
    # dtype, whose sums of ones are exact only to 256)
    steps = logp.shape[1] - 1
    dtype = logp.dtype if logp.dtype in (torch.float32, torch.float64) else torch.float32
    descends = torch.gt(logp[:, :-1], logp[:, 1:], out=torch.empty(logp.shape[0], steps, dtype=dtype,
                                                                    device=logp.device))
    # each row's count of strict steps by a matrix-vector product, exact in floats: BLAS is ~7× a
    # row-wise amin over 19 columns (torch reduces so narrow a row one scalar at a time)
    rows = torch.nonzero(torch.mv(descends, descends.new_ones(steps)) < steps)[:, 0]
    if rows.numel() > 0:
        ids, logp = ids[rows], logp[rows]
        out[rows] = ~_pairs_in_order(logp[:, :-1], logp[:, 1:], ids[:, :-1], ids[:, 1:]).all(dim=1)
    return out


def rows_ordered_reference(ids: Tensor, logp: Tensor) -> Tensor:
    srt_ids, _ = order_rows_reference(ids, logp)
    return torch.tensor(bool(torch.equal(srt_ids, ids)), device=ids.device)


def order_rows(ids: Tensor, logp: Tensor) -> tuple[Tensor, Tensor]:
    """Each row ([N, m]) ordered by logp descending, ties to the lower id, padding (id < 0) last.
    Two stable sorts: by id, then by logp (pads carry −inf and the largest key, so stay last)."""
    pad = ids < 0
    by_id = torch.argsort(ids.masked_fill(pad, torch.iinfo(ids.dtype).max), dim=1, stable=True)
    ids, logp = ids.gather(1, by_id), logp.gather(1, by_id)
    by_logp = torch.argsort(logp, dim=1, descending=True, stable=True)
    return ids.gather(1, by_logp), logp.gather(1, by_logp)


def order_rows_reference(ids: Tensor, logp: Tensor) -> tuple[Tensor, Tensor]:
    out_ids, out_logp = [], []
    for row_ids, row_lp in zip(ids.tolist(), logp.tolist()):
        # real ids by logp descending then id; padding last, in its original order
        key = lambda p: (True, 0.0, p[2]) if p[0] < 0 else (False, -p[1], p[0])
        pairs = sorted(zip(row_ids, row_lp, range(len(row_ids))), key=key)
        out_ids.append([p[0] for p in pairs])
        out_logp.append([p[1] for p in pairs])
    return (torch.tensor(out_ids, dtype=ids.dtype).reshape(ids.shape),
            torch.tensor(out_logp, dtype=logp.dtype).reshape(logp.shape))
