"""Bad input gets a clear error naming the argument and the first offending position."""
import pytest
import torch

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
