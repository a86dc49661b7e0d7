"""Support construction: conventions, tie-breaking, engine-side vs full-side agreement, divergences."""
import pytest
import torch
from hypothesis import example, given, strategies as st

from core_helpers import mismatched_pair, random_logp, sample_from
from pdm_lab.divergence import full_kl
from pdm_lab.errors import PDMInputError
from pdm_lab.policy_side import policy_on_support
from pdm_lab.tokenwise import token_stats
from pdm_lab.support import support_from_full, support_from_slots, support_from_topk, topk_lower_id_ties


def test_ties_break_to_lower_id():
    logp = torch.log_softmax(torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0, 0.5]], dtype=torch.float64), dim=-1)
    s = support_from_full(logp, torch.tensor([5]), k=2)
    assert s.ids.tolist() == [[1, 2, 5]]
    s = support_from_full(logp, torch.tensor([5]), k=2, convention="kslot")
    assert s.ids.tolist() == [[1, 5]]


@given(n=st.integers(1, 300), k=st.integers(1, 40), seed=st.integers(0, 10**6), levels=st.integers(1, 6))
def test_topk_with_ties_equals_stable_sort(n, k, seed, levels):
    gen = torch.Generator().manual_seed(seed)
    logp = torch.randint(0, levels, (4, n), generator=gen).double()  # many ties
    kk = min(k, n)
    ids, values = topk_lower_id_ties(logp, kk)
    ref_values, ref_ids = torch.sort(logp, dim=1, descending=True, stable=True)
    assert torch.equal(ids, ref_ids[:, :kk]) and torch.equal(values, ref_values[:, :kk])


@given(n=st.integers(2, 500), k=st.integers(1, 30), seed=st.integers(0, 10**6))
def test_union_and_kslot_differ_only_when_k_outside(n, k, seed):
    mu = random_logp(6, n, seed)
    sampled = sample_from(mu, seed)
    u = support_from_full(mu, sampled, k=k, convention="union")
    s = support_from_full(mu, sampled, k=k, convention="kslot")
    kk = min(k, n)
    top = torch.sort(mu, dim=1, descending=True, stable=True).indices[:, :kk]
    outside = ~(top == sampled[:, None]).any(dim=1)
    same = (u.ids[:, :kk] == s.ids[:, :kk]).all(dim=1) & ~(u.valid[:, kk:].any(dim=1) if u.ids.shape[1] > kk else torch.zeros(6, dtype=torch.bool))
    assert torch.equal(~same, outside)
    assert bool((u.valid.sum(1) == kk + outside.long()).all())
    assert bool((s.valid.sum(1) == kk).all())
    assert torch.equal(u.sampled, sampled) and torch.equal(s.sampled, sampled)


@given(n=st.integers(2, 2000), k=st.integers(1, 25), seed=st.integers(0, 10**6),
       convention=st.sampled_from(["union", "kslot"]), scale=st.sampled_from([0.5, 2.0, 6.0]))
def test_topk_kl_between_zero_and_full_kl(n, k, seed, convention, scale):
    mu, pi = mismatched_pair(5, n, seed, scale=scale)
    sampled = sample_from(mu, seed)
    s = support_from_full(mu, sampled, k=k, convention=convention)
    stats = token_stats(s, policy_on_support(pi, s.ids), mu_full=mu, pi_full=pi)
    assert bool((stats.topk_kl >= -1e-12).all())
    assert bool((stats.topk_kl <= stats.full_kl + 1e-10).all())


@given(n=st.integers(3, 1000), k=st.integers(1, 20), seed=st.integers(0, 10**6))
def test_adding_k_never_lowers_d(n, k, seed):
    """D on TopK ∪ {k} ≥ D on TopK alone (a finer partition; log-sum inequality)."""
    mu, pi = mismatched_pair(5, n, seed)
    sampled = sample_from(mu, seed)
    with_k = support_from_full(mu, sampled, k=k)
    top1 = torch.argmax(mu, dim=1)
    without = support_from_full(mu, top1, k=k)  # same top-K, k not added
    d = lambda s: token_stats(s, policy_on_support(pi, s.ids)).topk_kl
    assert bool((d(with_k) >= d(without) - 1e-12).all())


@given(n=st.integers(2, 400), k=st.integers(1, 25), seed=st.integers(0, 10**6),
       convention=st.sampled_from(["union", "kslot"]), shuffle=st.booleans())
# a shuffled row whose sampled token sits past the first k: whether the extra slot is used depends
# on the order, so every flag must come from the ordered rows
@example(n=2, k=1, seed=1, convention="union", shuffle=True)
def test_engine_side_support_matches_full_side(n, k, seed, convention, shuffle):
    """What a rollout engine returns (top-K', sampled) gives the same support as full μ."""
    mu = random_logp(4, n, seed)
    sampled = sample_from(mu, seed)
    full = support_from_full(mu, sampled, k=k, convention=convention)
    kk = min(k + 3, n)
    top_vals, top_ids = torch.sort(mu, dim=1, descending=True, stable=True)
    ids, vals = top_ids[:, :kk], top_vals[:, :kk]
    if shuffle:
        perm = torch.randperm(kk, generator=torch.Generator().manual_seed(seed))
        ids, vals = ids[:, perm], vals[:, perm]
    eng = support_from_topk(ids, vals, sampled, mu.gather(1, sampled[:, None])[:, 0],
                            vocab_size=n, k=k, convention=convention)
    assert torch.equal(eng.ids, full.ids)
    torch.testing.assert_close(eng.mu_logp, full.mu_logp)
    torch.testing.assert_close(eng.mu_kth_logp, full.mu_kth_logp)
    # the engine-side tail (log1mexp of the head) agrees with the direct log-sum-exp
    torch.testing.assert_close(eng.mu_tail_logp, full.mu_tail_logp, rtol=1e-9, atol=1e-9)


def test_row_mask_pads_rows_without_checking_them():
    ids = torch.tensor([[3, 1], [0, 0]])
    logp = torch.tensor([[-0.5, -1.5], [float("nan"), 7.0]])
    s = support_from_topk(ids, logp, torch.tensor([3, 9]), torch.tensor([-0.5, float("nan")]),
                          vocab_size=10, row_mask=torch.tensor([True, False]))
    assert s.ids[0].tolist() == [3, 1]
    assert torch.isfinite(s.mu_logp[1, 0])


def test_tail_of_astronomically_small_mass_stays_finite():
    """A head with all but 1e-60 of the mass: 1 − sum(exp) is 0 in any float; log space is not."""
    logp = torch.tensor([[0.0 - 1e-60, -140.0, -141.0, -142.0]], dtype=torch.float64)
    s = support_from_full(torch.log_softmax(logp, -1), torch.tensor([0]), k=1)
    assert torch.isfinite(s.mu_tail_logp).all() and s.mu_tail_logp.item() < -139


def test_full_kl_matches_definition():
    mu, pi = mismatched_pair(3, 50, 1)
    ref = (torch.exp(mu) * (mu - pi)).sum(-1)
    torch.testing.assert_close(full_kl(mu, pi), ref)


def test_support_from_slots_kslot_input():
    s = support_from_slots(torch.tensor([[4, 2, 7]]), torch.log(torch.tensor([[0.5, 0.2, 0.1]])),
                           torch.tensor([7]), vocab_size=10)
    assert s.k_index.tolist() == [2] and s.tail_count.tolist() == [7]
    torch.testing.assert_close(torch.exp(s.mu_tail_logp), torch.tensor([0.2]))


def _engine_batch(seed: int, n_rows: int = 48, width: int = 6, vocab: int = 40):
    """Engine-style rows: μ's top-`width` (some rows with −1 pads at the end), the sampled id."""
    gen = torch.Generator().manual_seed(seed)
    mu = random_logp(n_rows, vocab, seed)
    sampled = sample_from(mu, seed)
    vals, ids = torch.sort(mu, dim=1, descending=True, stable=True)
    ids, vals = ids[:, :width].clone(), vals[:, :width].clone()
    pad = torch.arange(width) >= width - torch.randint(0, 3, (n_rows, 1), generator=gen)
    ids[pad], vals[pad] = -1, 0.0  # padding: the log-prob there is ignored
    return ids, vals, sampled, mu.gather(1, sampled[:, None])[:, 0], vocab


def _same_support(a, b):
    for f in ("ids", "valid", "k_index", "tail_count"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    for f in ("mu_logp", "mu_tail_logp", "mu_kth_logp"):
        torch.testing.assert_close(getattr(a, f), getattr(b, f), rtol=1e-12, atol=1e-12, msg=f)


@pytest.mark.compile
@pytest.mark.parametrize("block_rows", [65536, 5])
def test_compiled_support_matches_eager(monkeypatch, block_rows):
    """The torch.compile path builds the same support as eager, and fails with the same message.
    With 5-row blocks, the rows out of order (more than a block) are redone by the compiled graph
    and by eager row blocks, instead of one eager call."""
    from pdm_lab.fast import compiled as compiled_mod
    monkeypatch.setattr(compiled_mod, "BLOCK_ROWS", block_rows)
    for seed in range(3):
        ids, vals, sampled, sampled_logp, n = _engine_batch(seed)
        if seed == 2:  # an unordered batch: sorted first, then built
            perm = torch.randperm(ids.shape[1], generator=torch.Generator().manual_seed(seed))
            ids, vals = ids[:, perm], vals[:, perm]
        keep = torch.rand(len(sampled), generator=torch.Generator().manual_seed(seed)) < 0.8
        for kw in ({"convention": "union", "row_mask": keep}, {"convention": "kslot"}):
            build = lambda c: support_from_topk(ids, vals, sampled, sampled_logp, vocab_size=n, k=4,
                                                compiled=c, **kw)
            _same_support(build(False), build(True))
        s = support_from_full(random_logp(48, n, seed), sampled, k=4)
        slots = lambda c: support_from_slots(s.ids, s.mu_logp, s.sampled, vocab_size=n, compiled=c)
        _same_support(slots(False), slots(True))

    ids, vals, sampled, sampled_logp, n = _engine_batch(7)
    bad_ids, bad_sampled = ids.clone(), sampled.clone()
    bad_ids[5, 1] = bad_ids[5, 0]
    corrupt = [(bad_ids, vals, sampled), (ids.masked_fill(ids == ids[9, 2], n + 3), vals, sampled),
               (ids, vals.index_put((torch.tensor(3), torch.tensor(0)), torch.tensor(float("nan"), dtype=vals.dtype)), sampled),
               (ids, vals + 2.0, sampled), (ids, vals, bad_sampled.fill_(n))]
    for cids, cvals, csampled in corrupt:
        messages = []
        for c in (False, True):
            with pytest.raises(PDMInputError) as err:
                support_from_topk(cids, cvals, csampled, sampled_logp, vocab_size=n, k=4, convention="kslot",
                                  compiled=c)
            messages.append(str(err.value))
        assert messages[0] == messages[1]


def test_take_rows_selects_every_per_row_field_and_keeps_n_and_k():
    import dataclasses

    from pdm_lab.support import support_from_full

    gen = torch.Generator().manual_seed(3)
    mu = torch.log_softmax(torch.randn(6, 11, generator=gen, dtype=torch.float64), -1)
    sup = support_from_full(mu, torch.randint(0, 11, (6,), generator=gen), k=3, compiled=False)
    rows = torch.tensor([4, 0, 4])
    got = sup.take_rows(rows)
    for f in dataclasses.fields(sup):
        value = getattr(sup, f.name)
        want = value[rows] if torch.is_tensor(value) else value
        assert (torch.equal(getattr(got, f.name), want) if torch.is_tensor(want) else getattr(got, f.name) == want), f.name
    assert len(sup.take_rows(slice(1, 3))) == 2
