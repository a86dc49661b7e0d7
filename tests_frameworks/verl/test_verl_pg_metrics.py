"""verl's own policy-loss metrics (``actor/pg_clipfrac``, ``actor/ppo_kl``,
``actor/pg_clipfrac_lower``) from pdm_lab's registered losses, dispatched through verl's
``get_policy_loss_fn``, against verl 0.9.1's own ``dppo_tv`` / ``dppo_kl`` losses on the same
tensors (pdm_lab's DPPO-Binary-TV/KL mask is verl's ``valid_mask`` where Â ≠ 0; pdm_lab's
``mask.clip_ratio_c`` is verl's ``clip_ratio_c``); and the plugin's registration failure is a
WARNING naming its cause."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import verl  # noqa: F401  (loads the `verl.plugins` entry points)
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config import ActorConfig

from pdm_lab.integrations.verl import LOSS_PREFIX, PDMPolicyLossConfig

B, T = 6, 7
KEYS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")


def _tensors(seed=0):
    gen = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(B, T, generator=gen, dtype=torch.float64) * 0.9 + 0.05)
    new = (old + 0.5 * torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp(max=0.0)
    resp = torch.ones(B, T, dtype=torch.bool)
    resp[1, 5:] = False
    resp[4, 2:] = False
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=torch.float64)[:, None].expand(B, T).clone()
    return old, new, adv, resp


@pytest.mark.parametrize("verl_loss, rule, delta, cap", [("dppo_tv", "dppo_binary_tv", 0.1, 1.3),
                                                          ("dppo_kl", "dppo_binary_kl", 0.05, 1.5),
                                                          ("dppo_tv", "dppo_binary_tv", 0.2, 1.1)])
def test_verls_metrics_equal_verls_own_mask_loss_on_the_same_tensors(verl_loss, rule, delta, cap):
    old, new, adv, resp = _tensors()
    theirs_cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=delta,
                             clip_ratio_low=delta, clip_ratio_high=delta,
                             clip_ratio_c=cap)
    _, theirs = get_policy_loss_fn(verl_loss)(old_log_prob=old, log_prob=new, advantages=adv, response_mask=resp,
                                              loss_agg_mode="token-mean", config=theirs_cfg, rollout_is_weights=None)
    ours_cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                           policy_loss=PDMPolicyLossConfig(loss_mode=f"{LOSS_PREFIX}{rule}",
                                                           mask={"delta": delta, "clip_ratio_c": cap}))
    _, ours = get_policy_loss_fn(f"{LOSS_PREFIX}{rule}")(old_log_prob=old, log_prob=new, advantages=adv,
                                                         response_mask=resp, loss_agg_mode="token-mean",
                                                         config=ours_cfg, rollout_is_weights=None)
    for key in KEYS:
        # verl takes the fractions in float32 (`.float()`), pdm_lab in the inputs' float64
        assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-9), (key, ours[key], theirs[key])
    assert 0 < theirs["actor/pg_clipfrac"] < 1 and theirs["actor/pg_clipfrac_lower"] > 0  # both non-trivial
    assert ours["actor/pg_clipfrac"] == pytest.approx(ours["actor/pdm/mask/frac_dropped"])


def test_no_cap_truncates_nothing():
    old, new, adv, resp = _tensors(1)
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                      policy_loss=PDMPolicyLossConfig(loss_mode=f"{LOSS_PREFIX}dppo_binary_tv", mask={"delta": 0.1}))
    _, ours = get_policy_loss_fn(f"{LOSS_PREFIX}dppo_binary_tv")(
        old_log_prob=old, log_prob=new, advantages=adv, response_mask=resp, loss_agg_mode="token-mean",
        config=cfg, rollout_is_weights=None)
    assert ours["actor/pg_clipfrac_lower"] == 0.0 and ours["actor/ppo_kl"] != 0.0


def test_a_failed_registration_is_a_warning_naming_its_cause():
    env = dict(os.environ, PDM_LAB_VERL_TOPK="not-a-number")
    proc = subprocess.run([sys.executable, "-c", "import verl"], env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in proc.stderr.splitlines() if "pdm_lab's verl plugin" in line]
    assert len(lines) == 1 and lines[0].startswith("WARNING"), proc.stderr[-2000:]
    assert "ValueError" in lines[0] and "PDM_LAB_VERL_TOPK='not-a-number'" in lines[0]


def test_no_rollout_is_keys_without_a_threshold_and_verls_is_variants_refused_by_name():
    from pdm_lab.metrics import as_mismatch, finalize_floats, rollout_corr_sums

    old, new, adv, resp = _tensors(2)
    log_r, flat = (new - old).reshape(-1), resp.reshape(-1)
    bare = finalize_floats(as_mismatch(rollout_corr_sums(log_r, flat, layout=(B, T))))
    assert "rollout_corr/kl" in bare and not any(k.startswith("rollout_corr/rollout_is_") for k in bare)
    capped = finalize_floats(as_mismatch(rollout_corr_sums(log_r, flat, cap=1.5, layout=(B, T))))
    assert "rollout_corr/rollout_is_mean" in capped and "rollout_corr/rollout_is_ratio_fraction_high" in capped
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                      policy_loss=PDMPolicyLossConfig(loss_mode=f"{LOSS_PREFIX}dppo_binary_tv", mask={"delta": 0.1}))
    with pytest.raises(ValueError, match="sequence-level TIS.*two-sided thresholds"):
        get_policy_loss_fn(f"{LOSS_PREFIX}dppo_binary_tv")(
            old_log_prob=old, log_prob=new, advantages=adv, response_mask=resp, loss_agg_mode="token-mean",
            config=cfg, rollout_is_weights=torch.ones(B, T, dtype=torch.float64))


def _bypass(**corr):
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    return RolloutCorrectionConfig(bypass_mode=True, **corr)


@pytest.mark.parametrize("corr", [dict(rollout_is="sequence", rollout_is_threshold=2.0),
                                  dict(rollout_is="token", rollout_is_threshold="0.5_2.0"),
                                  dict(rollout_is=None, rollout_rs="token_k1", rollout_rs_threshold="0.6_1.5"),
                                  dict(rollout_is="sequence", rollout_is_threshold=3.0, rollout_is_batch_normalize=True,
                                       rollout_rs="seq_max_k2", rollout_rs_threshold=0.3)])
def test_bypass_mode_rollout_corr_keys_are_verls_own_and_its_rejection_mask_applies(corr):
    """verl's bypass loss (``loss_mode=bypass_mode``, ``loss_type=ppo_clip``) against pdm_lab's on
    the same tensors and rollout-correction config: the same ``rollout_corr/*`` keys and values
    (sequence TIS, two-sided thresholds, batch normalisation, rejection), and pdm_lab's mask acts
    on the tokens verl's rejection kept."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    old, new, adv, resp = _tensors(2)
    theirs_cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
                             policy_loss={"loss_mode": "bypass_mode", "rollout_correction": _bypass(**corr)})
    _, theirs = get_policy_loss_fn("bypass_mode")(old_log_prob=old, log_prob=new, advantages=adv, response_mask=resp,
                                                  loss_agg_mode="token-mean", config=theirs_cfg, rollout_is_weights=None)
    rule = f"{LOSS_PREFIX}dppo_binary_tv"
    ours_cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                           policy_loss=PDMPolicyLossConfig(loss_mode=rule, mask={"delta": 0.2},
                                                           rollout_correction=_bypass(**corr)))
    loss, ours = get_policy_loss_fn(rule)(old_log_prob=old, log_prob=new, advantages=adv, response_mask=resp,
                                          loss_agg_mode="token-mean", config=ours_cfg, rollout_is_weights=None)
    corr_keys = {k for k in theirs if k.startswith("rollout_corr/")}
    assert corr_keys and corr_keys == {k for k in ours if k.startswith("rollout_corr/")}
    for key in corr_keys:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-12, abs=1e-12), key
    if corr.get("rollout_is") == "sequence":
        assert any("seq" in k for k in corr_keys)
    _, kept, _ = compute_rollout_correction_and_rejection_mask(new, old, resp, rollout_is=None, rollout_rs=corr.get("rollout_rs"),
                                                               rollout_rs_threshold=corr.get("rollout_rs_threshold"))
    plain_cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                            policy_loss=PDMPolicyLossConfig(loss_mode=rule, mask={"delta": 0.2}))
    expected, plain = get_policy_loss_fn(rule)(old_log_prob=old, log_prob=new, advantages=adv, response_mask=kept.bool(),
                                               loss_agg_mode="token-mean", config=plain_cfg, rollout_is_weights=None)
    assert torch.equal(loss, expected)
    if corr.get("rollout_rs"):
        assert int(kept.sum()) < int(resp.sum())  # the rejection removed tokens, and the loss saw that
    assert not any(k.startswith("rollout_corr/") for k in plain)  # no config, no verl keys


def test_bypass_mode_reinforce_is_refused_by_name():
    old, new, adv, resp = _tensors(3)
    rule = f"{LOSS_PREFIX}dppo_binary_tv"
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                      policy_loss=PDMPolicyLossConfig(loss_mode=rule, rollout_correction=_bypass(loss_type="reinforce")))
    with pytest.raises(ValueError, match="rollout_correction.loss_type='reinforce'"):
        get_policy_loss_fn(rule)(old_log_prob=old, log_prob=new, advantages=adv, response_mask=resp,
                                 loss_agg_mode="token-mean", config=cfg, rollout_is_weights=None)
