"""Bad input gets a clear error naming the argument and the first offending position."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from pdm_lab import ConfigError, MaskConfig, PDMInputError, diagnose, pdm_policy_loss
from pdm_lab.config import from_dict
from pdm_lab.direction import get_ddot_estimator
from pdm_lab.policy_side import policy_on_support
from pdm_lab.support import support_from_full, support_from_slots, support_from_topk

F64 = torch.float64


def _full(n_rows=3, n=8):
    return torch.log_softmax(torch.randn(n_rows, n, dtype=F64), -1)


def test_nan_logprob_names_tensor_and_position():
    mu = _full()
    mu[1, 4] = float("nan")
    with pytest.raises(PDMInputError, match=r"mu_logp_full: NaN log-probability at position \[1, 4\]"):
        support_from_full(mu, torch.tensor([0, 0, 0]), k=2)


def test_pos_inf_and_positive_logprob():
    mu = _full()
    mu[2, 1] = float("inf")
    with pytest.raises(PDMInputError, match=r"\+inf.*\[2, 1\]"):
        support_from_full(mu, torch.tensor([0, 0, 0]), k=2)
    with pytest.raises(PDMInputError, match=r"topk_logp: log-probability above 0 at position \[0, 1\]"):
        support_from_topk(torch.tensor([[1, 2]]), torch.tensor([[-0.1, 0.5]]), torch.tensor([1]),
                          torch.tensor([-0.1]), vocab_size=5)


def test_topk_mass_above_one():
    with pytest.raises(PDMInputError, match="top-K mass above 1"):
        support_from_topk(torch.tensor([[1, 2]]), torch.log(torch.tensor([[0.7, 0.6]])), torch.tensor([1]),
                          torch.log(torch.tensor([0.7])), vocab_size=5)


def test_duplicate_and_out_of_range_and_missing_ids():
    with pytest.raises(PDMInputError, match="duplicate token id 2 in row 1"):
        support_from_topk(torch.tensor([[1, 2], [2, 2]]), torch.full((2, 2), -2.0), torch.tensor([1, 2]),
                          torch.tensor([-2.0, -2.0]), vocab_size=5)
    with pytest.raises(PDMInputError, match=r"id out of range \[0, 5\) \(−1 pads\) at position \[0, 1\]"):
        support_from_topk(torch.tensor([[1, 7]]), torch.full((1, 2), -2.0), torch.tensor([1]),
                          torch.tensor([-2.0]), vocab_size=5)
    with pytest.raises(PDMInputError, match="sampled token missing from the support"):
        support_from_slots(torch.tensor([[1, 2]]), torch.full((1, 2), -2.0), torch.tensor([3]), vocab_size=5)


def test_sampled_token_with_zero_probability():
    with pytest.raises(PDMInputError, match="sampled_logp: -inf"):
        support_from_topk(torch.tensor([[1, 2]]), torch.full((1, 2), -2.0), torch.tensor([3]),
                          torch.tensor([float("-inf")]), vocab_size=5)


def test_shape_dtype_device_mismatches():
    with pytest.raises(PDMInputError, match="topk_ids has shape"):
        support_from_topk(torch.tensor([[1, 2]]), torch.full((1, 3), -2.0), torch.tensor([1]),
                          torch.tensor([-2.0]), vocab_size=5)
    with pytest.raises(PDMInputError, match="sampled: expected an integer dtype"):
        support_from_full(_full(), torch.tensor([0.0, 1.0, 2.0]), k=2)
    with pytest.raises(PDMInputError, match="mu_logp has dtype torch.float64 but pi_logp has dtype torch.float32"):
        diagnose(_full(), _full().float(), torch.tensor([0, 0, 0]), torch.ones(3, dtype=F64))
    with pytest.raises(PDMInputError, match="expected 2 dimensions"):
        policy_on_support(torch.zeros(5), torch.zeros(5, 1, dtype=torch.long))


def test_k_delta_names():
    with pytest.raises(PDMInputError, match="k: the top-K size must be an integer ≥ 1"):
        support_from_full(_full(), torch.tensor([0, 0, 0]), k=0)
    with pytest.raises(ConfigError, match="delta: must be ≥ 0"):
        MaskConfig(delta=-0.1)
    with pytest.raises(PDMInputError, match="unknown Ḋ estimator 'gauss'; valid: agg, exact, topk, uniform"):
        get_ddot_estimator("gauss")
    with pytest.raises(ConfigError, match="did you mean 'delta'"):
        from_dict(MaskConfig, {"delat": 0.1})


def test_empty_batch_returns_empty_outputs():
    mu = torch.empty(0, 10, dtype=F64)
    out = diagnose(mu, mu.clone(), torch.empty(0, dtype=torch.long), torch.empty(0, dtype=F64))
    assert out["topk_kl"].shape == (0,) and out["mask_pdm_uniform"].shape == (0,)
    support = support_from_full(mu, torch.empty(0, dtype=torch.long), k=3)
    pol = policy_on_support(mu.clone().requires_grad_(), support.ids)
    res = pdm_policy_loss(pol, support, torch.empty(0, 4, dtype=F64), torch.empty(0, 4, dtype=torch.bool), MaskConfig(k=3))
    assert res.loss.item() == 0.0


def test_error_loses_nothing_computed():
    """An error leaves the caller's tensors untouched (no in-place damage)."""
    mu = _full()
    before = mu.clone()
    mu[0, 0] = float("nan")
    snap = mu.clone()
    with pytest.raises(PDMInputError):
        support_from_full(mu, torch.tensor([1, 1, 1]), k=2)
    assert torch.equal(torch.nan_to_num(mu), torch.nan_to_num(snap))
    assert before.shape == mu.shape


def test_device_mismatch_is_named():
    mu = _full()
    pi = torch.empty(mu.shape, dtype=F64, device="meta")
    with pytest.raises(PDMInputError, match="mu_logp is on cpu but pi_logp is on meta"):
        diagnose(mu, pi, torch.tensor([0, 0, 0]), torch.ones(3, dtype=F64))


# ---------------------------------------------------------------------------- the second pass
# Each case below was accepted once (NaN loss, a silent wrong answer); each valid neighbour
# beside it must still pass, so a check that refuses too much fails here too.

def _loss_inputs(k=3, n_rows=4, n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    mu = torch.log_softmax(torch.randn(n_rows, n, dtype=F64, generator=g), -1)
    support = support_from_full(mu, torch.arange(n_rows) % n, k=k)
    pi = policy_on_support(torch.randn(n_rows, n, dtype=F64, generator=g), support.ids)
    return support, pi, torch.ones(2, n_rows // 2, dtype=F64), torch.ones(2, n_rows // 2, dtype=torch.bool)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.compile)])
def test_logits_row_without_a_finite_entry_is_named(compiled):
    support, *_ = _loss_inputs()
    logits = torch.randn(4, 10, dtype=F64)
    logits[2] = float("-inf")
    with pytest.raises(PDMInputError, match=r"logits: row with every logit −inf .* at position \[2\]; 1 such"):
        policy_on_support(logits, support.ids, compiled=compiled)
    logits[2, 5] = 0.0  # one finite logit: π is that token, every other log π_i = −inf (legal)
    pol = policy_on_support(logits.requires_grad_(), support.ids, compiled=compiled)
    (grad,) = torch.autograd.grad(pol.logp[:, 0].masked_fill(pol.logp[:, 0] == float("-inf"), 0).sum(), logits)
    assert not torch.isnan(pol.logp).any() and torch.isfinite(grad).all()
    logits = torch.randn(4, 10, dtype=F64)
    logits[1, 3], logits[3, 0] = float("nan"), float("inf")
    with pytest.raises(PDMInputError, match=r"logits: NaN logit at position \[1, 3\]"):
        policy_on_support(logits, support.ids, compiled=compiled)
    logits[1, 3] = 0.0
    with pytest.raises(PDMInputError, match=r"logits: \+inf logit at position \[3, 0\]"):
        policy_on_support(logits, support.ids, compiled=compiled)


@settings(max_examples=25)
@given(st.integers(1, 30), st.data())
def test_the_first_row_without_a_finite_logit_is_named(n_rows, data):
    rows = sorted(data.draw(st.sets(st.integers(0, n_rows - 1), min_size=1, max_size=n_rows)))
    logits = torch.randn(n_rows, 16)
    logits[rows] = float("-inf")
    ids = torch.arange(3).repeat(n_rows, 1)
    with pytest.raises(PDMInputError, match=rf"every logit −inf .* at position \[{rows[0]}\]; {len(rows)} such"):
        policy_on_support(logits, ids, chunk_size=data.draw(st.integers(1, 8)))


def test_logits_overflowing_at_a_tiny_temperature_are_named():
    support, *_ = _loss_inputs()
    for sign in (1, -1):  # +inf, or −inf everywhere though no logit is −inf
        with pytest.raises(PDMInputError, match=r"logits / temperature leaves torch.float32's range "
                                                r"\(temperature 0.001; row index\) at position \[0\]; 4 such"):
            policy_on_support(torch.full((4, 10), sign * 3e38), support.ids, temperature=1e-3)


def test_reference_checks_the_same_rows():
    from pdm_lab.policy_side import policy_on_support_reference

    support, *_ = _loss_inputs()
    logits = torch.randn(4, 10, dtype=F64)
    logits[3] = float("-inf")
    with pytest.raises(PDMInputError, match=r"row with every logit −inf .* at position \[3\]"):
        policy_on_support_reference(logits, support.ids)


def test_duplicate_support_ids_are_refused_but_repeated_padding_is_not():
    ids = torch.tensor([[1, 2, -1, -1], [4, 0, 4, -1], [3, 3, 5, 6]])
    with pytest.raises(PDMInputError, match="support_ids: duplicate token id 4 in row 1; 2 rows affected"):
        policy_on_support(torch.randn(3, 8), ids)
    policy_on_support(torch.randn(1, 8), ids[:1])  # two −1 pads in a row are not a duplicate
    with pytest.raises(PDMInputError, match=r"support_ids: id out of range \[0, 8\) .* position \[0, 1\]"):
        policy_on_support(torch.randn(1, 8), torch.tensor([[1, 8, 1]]))  # the range is named first


@settings(max_examples=25)
@given(st.integers(2, 40), st.integers(2, 12), st.data())
def test_the_first_duplicated_row_is_named(n_rows, m, data):
    vocab = 64
    ids = torch.stack([torch.randperm(vocab)[:m] for _ in range(n_rows)])
    rows = sorted(data.draw(st.sets(st.integers(0, n_rows - 1), min_size=1, max_size=n_rows)))
    for row in rows:
        a, b = data.draw(st.lists(st.integers(0, m - 1), min_size=2, max_size=2, unique=True))
        ids[row, b] = ids[row, a]
    with pytest.raises(PDMInputError, match=rf"duplicate token id {int(ids[rows[0]].mode().values)} "
                                            rf"in row {rows[0]}; {len(rows)} rows affected"):
        policy_on_support(torch.randn(n_rows, vocab), ids)


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), True, 0.0, -1.0, "1.0", None])
def test_temperature_must_be_a_finite_positive_number(temperature):
    support, *_ = _loss_inputs()
    with pytest.raises(PDMInputError, match=r"temperature: must be a finite number > 0, got"):
        policy_on_support(torch.randn(4, 10), support.ids, temperature=temperature)


def test_temperature_as_int_or_numpy_float_is_a_number():
    np = pytest.importorskip("numpy")
    support, *_ = _loss_inputs()
    logits = torch.randn(4, 10, dtype=F64)
    a = policy_on_support(logits, support.ids, temperature=2).logp
    b = policy_on_support(logits, support.ids, temperature=np.float64(2.0)).logp
    assert torch.equal(a, b)


@pytest.mark.parametrize("value", [0.5, float("nan"), 2.0, -1.0])
def test_response_mask_must_be_zero_or_one(value):
    support, pi, adv, resp = _loss_inputs()
    mask = resp.to(F64)
    mask[1, 0] = value
    with pytest.raises(PDMInputError, match=r"response_mask: not 0 or 1 at position \[1, 0\]"):
        pdm_policy_loss(pi, support, adv, mask, MaskConfig(k=3))
    mask[1, 0] = 0.0  # 0/1 numbers (a float or int mask) are the same as bool
    for as_numbers in (mask, mask.long()):
        got = pdm_policy_loss(pi, support, adv, as_numbers, MaskConfig(k=3)).loss
        assert torch.equal(got, pdm_policy_loss(pi, support, adv, as_numbers.bool(), MaskConfig(k=3)).loss)


def test_mask_config_k_must_be_the_supports():
    support, pi, adv, resp = _loss_inputs(k=3)
    assert support.top_k == 3
    with pytest.raises(PDMInputError, match=r"mask.k: K = 5 in the mask config, but the support was built "
                                            r"with K = 3"):
        pdm_policy_loss(pi, support, adv, resp, MaskConfig(k=5))
    # ready slots carry no K (a sampled-token view): nothing to compare
    slots = support_from_slots(support.ids, support.mu_logp, support.sampled, vocab_size=10)
    assert slots.top_k is None
    pdm_policy_loss(pi, slots, adv, resp, MaskConfig(k=5))
    # K ≥ n: the support holds the whole vocabulary, and the config's K is still the one asked for
    wide, wide_pi, *_ = _loss_inputs(k=20)
    assert wide.ids.shape[1] == 10 and wide.top_k == 20
    pdm_policy_loss(wide_pi, wide, adv, resp, MaskConfig(k=20))


def test_coupled_scores_must_not_be_nan():
    support, pi, adv, resp = _loss_inputs()
    cfg = MaskConfig(k=3, rule="pdm_coupled")
    c = torch.tensor([0.1, float("nan"), -0.2, float("nan")], dtype=F64)
    with pytest.raises(PDMInputError, match=r"coupled: NaN at position \[1\]; 2 such entries"):
        pdm_policy_loss(pi, support, adv, resp, cfg, coupled=c)
    with pytest.raises(PDMInputError, match=r"coupled has shape \(3,\) but the support has 4 rows"):
        pdm_policy_loss(pi, support, adv, resp, cfg, coupled=c[:3])
    c = torch.tensor([0.1, float("inf"), -0.2, float("-inf")], dtype=F64)  # a sign is still a sign
    out = pdm_policy_loss(pi, support, adv, resp, cfg, coupled=c)
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("shift", [-5.0, -2e-3, 2e-3, 0.1])
def test_diagnose_refuses_rows_that_are_not_distributions(shift):
    mu = _full(4, 12)
    pi = _full(4, 12)
    bad = mu.clone()
    bad[2] += shift  # total mass e^shift
    with pytest.raises(PDMInputError, match=r"mu_logp: total probability is not 1 within 0.001 .* "
                                            r"at position \[2\]"):
        diagnose(bad, pi, torch.tensor([0, 1, 2, 3]), torch.ones(4, dtype=F64))
    with pytest.raises(PDMInputError, match=r"pi_logp: total probability is not 1 .* at position \[2\]"):
        diagnose(mu, bad, torch.tensor([0, 1, 2, 3]), torch.ones(4, dtype=F64))
    with pytest.raises(PDMInputError, match=r"mu_logp_full: total probability is not 1"):
        support_from_full(bad, torch.tensor([0, 1, 2, 3]), k=3)


def test_float32_distributions_over_a_large_vocabulary_pass_the_mass_check():
    torch.manual_seed(0)
    mu = torch.log_softmax(torch.randn(8, 50_000) * 6, -1)
    pi = torch.log_softmax(torch.randn(8, 50_000) * 6, -1)
    mu[:, :100] = float("-inf")  # cut by top-k sampling: the rest is renormalised by the engine
    mu = torch.log_softmax(mu, -1)
    out = diagnose(mu, pi, torch.full((8,), 200), torch.ones(8))
    assert torch.isfinite(out["topk_kl"]).all() and (out["topk_kl"] > 0).all()


def test_k_beyond_the_topk_columns_given_is_refused():
    ids, logp = torch.tensor([[1, 2]]), torch.log(torch.tensor([[0.5, 0.3]]))
    sampled, sampled_logp = torch.tensor([1]), torch.log(torch.tensor([0.5]))
    with pytest.raises(PDMInputError, match=r"k: K = 4 exceeds the 2 top-K columns given \(topk_ids has "
                                            r"shape \(1, 2\)\)"):
        support_from_topk(ids, logp, sampled, sampled_logp, vocab_size=5, k=4)
    assert support_from_topk(ids, logp, sampled, sampled_logp, vocab_size=5, k=2).top_k == 2
    # every token of a 2-token vocabulary given: K = 4 ≥ n is the empty tail (SPEC §8)
    full = support_from_topk(ids - 1, torch.log(torch.tensor([[0.6, 0.4]])), sampled - 1,
                             torch.log(torch.tensor([0.6])), vocab_size=2, k=4)
    assert full.top_k == 4 and int(full.tail_count[0]) == 0
