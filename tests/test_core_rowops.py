"""Fast paths of support construction against their naive references: the row primitives (eager,
compiled, reference), eager row blocks against one whole-tensor call, int32 ids, and the checks
the fused validation pass adds."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from core_helpers import random_logp, sample_from
from pdm_lab.fast import compiled as compiled_mod
from pdm_lab.fast import rowops
from pdm_lab.tools.benchtools import rollout_like_inputs
from pdm_lab.errors import PDMInputError
from pdm_lab.support import support_from_full, support_from_slots, support_from_topk
from pdm_lab.support_checks import outside


def _rows(seed: int, n_rows: int = 40, width: int = 7, vocab: int = 12, distinct: bool = False):
    """Integer rows (with repeats unless `distinct`), padding (−1) at the end of some, and logps
    with ties."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n_rows, width), generator=gen)
    if distinct:  # the order of a top-K row is defined for distinct ids
        ids = torch.argsort(torch.rand(n_rows, vocab, generator=gen), dim=1)[:, :width]
    logp = -torch.randint(0, 4, (n_rows, width), generator=gen).double()
    pad = torch.arange(width) >= width - torch.randint(0, 3, (n_rows, 1), generator=gen)
    return ids.masked_fill(pad, -1), logp.masked_fill(pad, float("-inf"))


def _all_primitives(ids, logp, mask, top, top_logp):
    ordered_ids, ordered_logp = rowops.order_rows(top, top_logp)
    return {"append": rowops.append_column(ids, ids[:, 0], torch.int32),
            "first_true": torch.stack(rowops.first_true(mask)),
            "head": rowops.head_log_mass(logp),
            "dup": rowops.any_duplicate(ids), "ordered": rowops.rows_ordered(top, top_logp),
            "ordered_after": rowops.rows_ordered(ordered_ids, ordered_logp),
            "outside": torch.stack([outside(ids, -1, 10), outside(ids, 0)])}


def _references(ids, logp, mask, top, top_logp):
    return {"append": rowops.append_column_reference(ids, ids[:, 0], torch.int32),
            "first_true": torch.stack([t.long() for t in rowops.first_true_reference(mask)]),
            "head": rowops.head_log_mass_reference(logp),
            "dup": rowops.any_duplicate_reference(ids), "ordered": rowops.rows_ordered_reference(top, top_logp),
            "ordered_after": torch.tensor(True),
            "outside": torch.tensor([bool(((ids < -1) | (ids >= 10)).any()), bool((ids < 0).any())])}


def _case(seed):
    ids, logp = _rows(seed)
    top, top_logp = _rows(seed + 1, distinct=True)
    if seed % 2:  # half the cases already in order
        top, top_logp = rowops.order_rows_reference(top, top_logp)
    return ids, logp, ids == ids[:, :1].roll(1, 0), top, top_logp


@given(seed=st.integers(0, 10**6))
def test_primitives_match_references(seed):
    case = _case(seed)
    got, want = _all_primitives(*case), _references(*case)
    for key in want:
        torch.testing.assert_close(got[key].to(want[key].dtype), want[key], msg=key)
    srt_ids, srt_logp = rowops.order_rows(*case[3:])
    ref_ids, ref_logp = rowops.order_rows_reference(*case[3:])
    assert torch.equal(srt_ids, ref_ids) and torch.equal(srt_logp, ref_logp)


def test_head_log_mass_small_rows_fall_back_to_logsumexp():
    logp = torch.tensor([[-800.0, -801.0], [-0.1, -3.0]], dtype=torch.float64)
    torch.testing.assert_close(rowops.head_log_mass(logp), torch.logsumexp(logp, 1))


@pytest.mark.compile
def test_compiled_primitives_match_eager():
    """One compiled graph calls every primitive (one compile for all)."""
    fused = torch.compile(_all_primitives, dynamic=True)
    for seed in range(4):
        case = _case(seed)
        eager, comp = _all_primitives(*case), fused(*case)
        for key in eager:
            torch.testing.assert_close(comp[key], eager[key], msg=key)


@pytest.mark.parametrize("convention,threads", [("union", 1), ("kslot", 1), ("union", 2)])
def test_row_blocks_match_one_call(monkeypatch, convention, threads):
    """Eager row blocks (7 rows here) build the same support and stats as one whole-tensor call,
    on one thread or taken in turn by one-thread workers (threads > 1)."""
    from pdm_lab.tokenwise import token_stats
    from pdm_lab.policy_side import policy_on_support
    mu = random_logp(50, 30, 3)
    sampled = sample_from(mu, 3)
    vals, ids = torch.sort(mu, dim=1, descending=True, stable=True)
    ids, vals = ids[:, :6].clone(), vals[:, :6].clone()
    ids[::5, 4:], vals[::5, 4:] = -1, 0.0  # padding in some rows
    keep = torch.arange(50) % 9 != 4
    build = lambda: support_from_topk(ids, vals, sampled, mu.gather(1, sampled[:, None])[:, 0], vocab_size=30,
                                      k=4, convention=convention, row_mask=keep, compiled=False)
    slots = lambda s: support_from_slots(s.ids, s.mu_logp, s.sampled, vocab_size=30, compiled=False)
    whole = build()
    whole_slots = slots(whole)
    pi = policy_on_support(random_logp(50, 30, 4), whole.ids)
    whole_stats = token_stats(whole, pi, compiled=False)
    monkeypatch.setattr(compiled_mod, "BLOCK_ROWS", 7)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        blocked = build()
        blocked_slots = slots(blocked)
        stats = token_stats(blocked, pi, compiled=False)
        assert torch.get_num_threads() == threads  # the workers' one thread does not leak out
    finally:
        torch.set_num_threads(before)
    for part_whole, part in ((whole, blocked), (whole_slots, blocked_slots)):
        for f in ("ids", "k_index", "mu_logp", "mu_tail_logp", "mu_kth_logp", "tail_count"):
            assert torch.equal(getattr(part, f), getattr(part_whole, f)), f
    for f in ("topk_kl", "topk_tv", "ratio", "ddot_lower", "ddot_upper"):
        assert torch.equal(getattr(stats, f), getattr(whole_stats, f)), f
    assert all(torch.equal(stats.ddot[e], whole_stats.ddot[e]) for e in whole_stats.ddot)


@pytest.mark.parametrize("threads", [1, 2])
def test_row_blocks_raise_the_same_error(monkeypatch, threads):
    ids, vals, sampled = torch.tensor([[1, 2]] * 20), torch.full((20, 2), -2.0), torch.tensor([1] * 20)
    ids[13, 1] = 1
    monkeypatch.setattr(compiled_mod, "BLOCK_ROWS", 4)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with pytest.raises(PDMInputError, match="duplicate token id 1 in row 13; 1 rows affected"):
            support_from_topk(ids, vals, sampled, torch.full((20,), -2.0), vocab_size=5, compiled=False)
    finally:
        torch.set_num_threads(before)


def test_ids_are_int32_when_the_vocabulary_allows():
    inp = rollout_like_inputs(64, 5, vocab=1000)
    args = (inp["topk_ids"], inp["topk_logp"], inp["sampled"], inp["sampled_logp"])
    s = support_from_topk(*args, vocab_size=1000)
    assert s.ids.dtype == torch.int32 and s.sampled.dtype == torch.int64
    assert torch.equal(s.sampled, inp["sampled"])
    assert support_from_topk(*args, vocab_size=2**31).ids.dtype == torch.int64
    full = support_from_full(random_logp(4, 9, 0), torch.tensor([0, 1, 2, 3]), k=3)
    assert full.ids.dtype == torch.int32


def test_an_id_that_would_wrap_in_int32_is_out_of_range():
    ids = torch.tensor([[1, 2**32 + 2]])
    with pytest.raises(PDMInputError, match=r"support ids: id out of range \[0, 5\).*position \[0, 1\]"):
        support_from_topk(ids, torch.tensor([[-1.0, -2.0]]), torch.tensor([1]), torch.tensor([-1.0]), vocab_size=5)


def test_sampled_logp_contradicting_its_topk_entry():
    ids, logp = torch.tensor([[1, 2], [3, 4]]), torch.tensor([[-0.5, -1.5], [-0.7, -1.0]])
    ok = support_from_topk(ids, logp, torch.tensor([2, 4]), torch.tensor([-1.5, -1.0 - 5e-4]), vocab_size=5)
    assert ok.mu_logp_k.tolist() == [-1.5, -1.0]  # k's top-K entry is log μ_k
    with pytest.raises(PDMInputError, match=r"sampled_logp: contradicts topk_logp at the sampled token "
                                            r"\(row index; value shown\) at position \[1\]"):
        support_from_topk(ids, logp, torch.tensor([2, 4]), torch.tensor([-1.5, -0.7]), vocab_size=5)


@given(seed=st.integers(0, 10**6))
@settings(max_examples=30, deadline=None)
def test_rows_out_of_order_flags_exactly_the_rows_the_reference_rejects(seed):
    *_, top, top_logp = _case(seed)
    flags = rowops.rows_out_of_order(top, top_logp)
    expected = [not bool(rowops.rows_ordered_reference(top[i:i + 1], top_logp[i:i + 1])) for i in range(top.shape[0])]
    assert flags.tolist() == expected
    assert bool(rowops.rows_ordered(top, top_logp)) == (not any(expected))


def test_support_with_a_row_out_of_order_equals_the_ordered_rows():
    # a tie broken to the higher id in one row: the support equals the one built from rows the
    # reference ordered, and the in-order rows are untouched
    from pdm_lab.support import support_from_topk

    inp = rollout_like_inputs(64, 5, vocab=1000)
    ids, logp = inp["topk_ids"].clone(), inp["topk_logp"].clone()
    logp[3, 1] = logp[3, 2]  # a tie (mass only falls)
    lo, hi = sorted((int(ids[3, 1]), int(ids[3, 2])))
    ids[3, 1], ids[3, 2] = hi, lo  # broken to the higher id
    sampled_logp = inp["sampled_logp"].clone()
    hit = ids[3] == inp["sampled"][3]
    if bool(hit.any()):
        sampled_logp[3] = logp[3][hit][0]
    ref_ids, ref_logp = rowops.order_rows_reference(ids, logp)
    args = dict(vocab_size=1000, k=5)
    assert rowops.rows_out_of_order(ids, logp).nonzero()[:, 0].tolist() == [3]
    got = support_from_topk(ids, logp, inp["sampled"], sampled_logp, **args)
    want = support_from_topk(ref_ids, ref_logp, inp["sampled"], sampled_logp, **args)
    assert torch.equal(got.ids, want.ids) and torch.equal(got.mu_logp, want.mu_logp)
    assert torch.equal(got.k_index, want.k_index)


@given(seed=st.integers(0, 10**6), width=st.integers(2, 24), plant=st.booleans(), row=st.integers(0, 29),
       chunk=st.sampled_from([7, 30, 8192]), dtype=st.sampled_from([torch.int32, torch.int64]))
@settings(max_examples=80, deadline=None)
def test_any_duplicate_on_distinct_rows_with_padding(seed, width, plant, row, chunk, dtype):
    """Rows of distinct ids with padding (several pads per row never match each other): False
    until one real id is copied into another slot of its row; whatever the eager chunk of rows
    (7: five chunks, the last one short, pads in some chunks only)."""
    gen = torch.Generator().manual_seed(seed)
    n_rows = 30
    ids = torch.argsort(torch.rand(n_rows, 100, generator=gen), dim=1)[:, :width].int()
    ids[torch.rand(n_rows, width, generator=gen) < 0.3] = -1
    if plant:
        a, b = sorted(torch.randperm(width, generator=gen)[:2].tolist())
        ids[row, a] = ids[row, b] = 7 + width  # a real id twice (≥ 0, maybe already in the row)
    ids = ids.to(dtype)
    saved, rowops.DUPLICATE_CHUNK_ROWS = rowops.DUPLICATE_CHUNK_ROWS, chunk
    try:
        assert bool(rowops.any_duplicate(ids)) == bool(rowops.any_duplicate_reference(ids)) == plant
    finally:
        rowops.DUPLICATE_CHUNK_ROWS = saved


@pytest.mark.parametrize("chunk", [1, 7, 30, 31])
def test_any_duplicate_checks_every_row_of_every_chunk(chunk, monkeypatch):
    """A duplicate planted in any one row, at any pair of slots, is found whichever eager chunk
    holds it (the last chunk short, or the whole block in one)."""
    monkeypatch.setattr(rowops, "DUPLICATE_CHUNK_ROWS", chunk)
    ids = torch.arange(30 * 6, dtype=torch.int32).reshape(30, 6)
    ids[::4, -1] = -1
    assert not bool(rowops.any_duplicate(ids))
    for row in range(30):
        for a, b in ((0, 1), (0, 4), (3, 4)):
            planted = ids.clone()
            planted[row, b] = planted[row, a]
            assert bool(rowops.any_duplicate(planted)), (row, a, b)


def _partly_shuffled(seed: int, n_rows: int, width: int, vocab: int = 60, in_top: int | None = None):
    """Engine rows of μ's top-`width`, with ties, a fraction of them shuffled (out of order);
    `in_top`: k drawn from each row's first `in_top` tokens in order (else sampled from μ)."""
    gen = torch.Generator().manual_seed(seed)
    mu = torch.log_softmax(torch.randint(0, 5, (n_rows, vocab), generator=gen).double(), dim=1)  # ties
    vals, ids = torch.sort(mu, dim=1, descending=True, stable=True)
    ids, vals = ids[:, :width].clone(), vals[:, :width].clone()
    sampled = sample_from(mu, seed) if in_top is None else \
        ids.gather(1, torch.randint(0, in_top, (n_rows, 1), generator=gen))[:, 0]
    shuffled = torch.rand(n_rows, generator=gen) < 0.3
    perm = torch.argsort(torch.rand(n_rows, width, generator=gen), dim=1)
    ids = torch.where(shuffled[:, None], ids.gather(1, perm), ids)
    vals = torch.where(shuffled[:, None], vals.gather(1, perm), vals)
    return ids, vals, sampled, mu.gather(1, sampled[:, None])[:, 0], vocab


@given(seed=st.integers(0, 10**6), width=st.integers(2, 9), cut=st.integers(0, 3),
       convention=st.sampled_from(["union", "kslot"]), masked=st.booleans(), k_in_top=st.booleans())
@settings(max_examples=80, deadline=None)
def test_rows_out_of_order_are_redone_alone(seed, width, cut, convention, masked, k_in_top):
    """Some rows out of order (K' ≥ K, so the cut at K depends on the order): the support equals
    the one built from rows the reference ordered first, with the same extra slot (`k_in_top`: no
    row in order needs it, but a row out of order seems to before it is ordered)."""
    k = max(1, width - cut)
    ids, vals, sampled, sampled_logp, vocab = _partly_shuffled(seed, 40, width, in_top=k if k_in_top else None)
    keep = torch.rand(40, generator=torch.Generator().manual_seed(seed + 1)) < 0.9 if masked else None
    ref_ids, ref_vals = rowops.order_rows_reference(ids, vals)
    build = lambda i, v: support_from_topk(i, v, sampled, sampled_logp, vocab_size=vocab, k=k,
                                           convention=convention, row_mask=keep, compiled=False)
    got, want = build(ids, vals), build(ref_ids, ref_vals)
    for f in ("ids", "k_index", "tail_count", "mu_logp", "mu_tail_logp", "mu_kth_logp"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f


@pytest.mark.parametrize("bad_row", [0, 1])
def test_a_bad_row_beside_rows_out_of_order_names_the_same_position(bad_row):
    """A duplicate id in a row in order (0) or out of order (1), beside other rows out of order:
    the same message as for the batch given in order."""
    ids, vals, sampled, sampled_logp, vocab = _partly_shuffled(3, 40, 6)
    ref_ids, ref_vals = rowops.order_rows_reference(ids, vals)
    out_of_order = rowops.rows_out_of_order(ids, vals)
    row = int(torch.nonzero(out_of_order == bool(bad_row))[0, 0])
    messages = []
    dup = int(ref_ids[row][ref_ids[row] != sampled[row]][0])  # the same id repeated in both versions
    for i, v in ((ids.clone(), vals), (ref_ids.clone(), ref_vals)):
        i[row, i[row] != sampled[row]] = dup
        with pytest.raises(PDMInputError) as err:
            support_from_topk(i, v, sampled, sampled_logp, vocab_size=vocab, k=4, compiled=False)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and f"in row {row}" in messages[0]


def test_many_rows_out_of_order_are_redone_by_row_blocks(monkeypatch):
    """More rows out of order than a block holds: they are redone by the same row-block math
    (here 4-row blocks), with the same result as rows ordered first."""
    monkeypatch.setattr(compiled_mod, "BLOCK_ROWS", 4)
    ids, vals, sampled, sampled_logp, vocab = _partly_shuffled(11, 60, 7, in_top=5)
    assert int(rowops.rows_out_of_order(ids, vals).sum()) > 4
    ref_ids, ref_vals = rowops.order_rows_reference(ids, vals)
    for convention in ("union", "kslot"):
        build = lambda i, v: support_from_topk(i, v, sampled, sampled_logp, vocab_size=vocab, k=5,
                                               convention=convention, compiled=False)
        got, want = build(ids, vals), build(ref_ids, ref_vals)
        for f in ("ids", "k_index", "tail_count", "mu_logp", "mu_tail_logp", "mu_kth_logp"):
            assert torch.equal(getattr(got, f), getattr(want, f)), (convention, f)
