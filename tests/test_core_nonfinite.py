"""A non-finite loss is an error naming the token (float16 with advantages near 1e6), and
non-finite gradients are flagged by name and position: a run never steps on NaN or inf silently."""
from __future__ import annotations

import pytest
import torch

from core_helpers import mismatched_pair, sample_from
from pdm_lab import MaskConfig, pdm_policy_loss, policy_on_support, support_from_full
from pdm_lab.errors import PDMInputError
from pdm_lab.loss_checks import gradient_flags


def _loss(dtype: torch.dtype, scale: float, *, adv_dtype: torch.dtype | None = None):
    mu, pi = mismatched_pair(8, 30, seed=3, noise=0.3)
    sampled = sample_from(mu, 4)
    support = support_from_full(mu.to(dtype), sampled, k=5)
    logits = pi.to(dtype).clone().requires_grad_(True)
    adv = (torch.linspace(-1, 1, 8, dtype=torch.float64) * scale).to(adv_dtype or dtype).reshape(2, 4)
    resp = torch.ones(2, 4, dtype=torch.bool)
    return logits, pdm_policy_loss(policy_on_support(logits, support.ids), support, adv, resp,
                                   MaskConfig(rule="none", k=5), compiled=False)


def test_float16_advantages_near_1e6_are_an_error_naming_the_tensor():
    # 1e6 is inf in float16: the advantages are refused at the boundary, by position
    with pytest.raises(PDMInputError, match=r"advantage.*position \[0\]"):
        _loss(torch.float16, 1e6)


def test_float16_logits_with_advantages_near_1e6_flag_the_infinite_gradient():
    # float32 advantages: the loss (float32 statistics) is finite, but Â/N = 1.25e5 flows back into
    # float16 logits, whose largest value is 65504: the flag names the parameter and position
    logits, out = _loss(torch.float16, 1e6, adv_dtype=torch.float32)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    flags, first = gradient_flags([("logits", logits)])
    assert float(flags["grad/nonfinite"].value) > 0 and first.startswith("logits at position [")


def test_a_nonfinite_loss_is_an_error_naming_the_token():
    from pdm_lab.loss_checks import check_loss_finite

    per_token = torch.tensor([[1.0, 2.0], [float("inf"), 3.0]], dtype=torch.float16)
    adv = torch.tensor([1.0, 2.0, 6e4, 3.0])
    with pytest.raises(PDMInputError, match=r"loss: non-finite surrogate at token position \[1, 0\] "
                                            r"\(advantage 60000, log r 0.5, dtype torch.float16\)"):
        check_loss_finite(per_token.sum(), per_token, adv, torch.tensor([0.0, 0.0, 0.5, 0.0]))
    check_loss_finite(torch.tensor(3.0), per_token, adv, adv)  # a finite loss passes untouched


def test_the_same_advantages_in_float32_give_a_finite_loss_and_gradient():
    logits, out = _loss(torch.float32, 1e6)
    out.loss.backward()
    flags, first = gradient_flags([("logits", logits)])
    assert torch.isfinite(out.loss) and float(flags["grad/nonfinite"].value) == 0 and first is None


def test_nonfinite_gradients_are_flagged_by_name_and_position():
    logits, out = _loss(torch.float32, 1.0)
    out.loss.backward()
    logits.grad[1, 2] = float("inf")  # planted: what an overflowing backward leaves behind
    logits.grad[3, 0] = float("nan")
    flags, first = gradient_flags([("bias", torch.zeros(2, requires_grad=True)), ("logits", logits)])
    assert float(flags["grad/nonfinite"].value) == 2 and first.startswith("logits at position [1, 2]")
