"""verl's losses take the whole ``MaskConfig`` (every field away from its default) and the
engine's sampling mask, and compute the core's loss with it: the top-K path on the actor's
no-padding logits, the sampled-token path through verl's registry. Each process records what it
resolved (``PDM_LAB_RECORD_DIR``)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import verl  # noqa: F401  (loads the `verl.plugins` entry points: pdm_lab registers here)
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from pdm_lab import MaskConfig, pdm_policy_loss, policy_on_support, support_from_topk
from pdm_lab.aggregation import DPInfo
from pdm_lab.config import to_dict
from pdm_lab.integrations.verl import LOSS_PREFIX
from pdm_lab.integrations.verl_config import RECORD_ENV
from pdm_lab.integrations.verl_topk import topk_policy_loss, topk_rules
from pdm_lab.sampling_mask import SamplingMask, engine_kept, on_sampling_set
from pdm_lab.testing.call_site_batch import call_site_batch

from test_verl_call_site import _verl_batch

NON_DEFAULT = dict(delta=0.01, delta_neg=0.02, k=4, convention="kslot", estimator="uniform", eps_low=0.1,
                   eps_high=0.3, icepop_low=0.9, icepop_high=1.05, clip_ratio_c=1.5,
                   aggregation="seq-mean-token-sum-norm", horizon=10, dual_clip_c=2.5, seq_agg="max",
                   band_low=-0.3, band_high=0.3, veto_floor=0.05, opsm_delta=2e-4, kernel_ratio=2.0)
SAMPLING = SamplingMask(top_k=30, top_p=0.9, min_p=0.01)


def test_every_field_is_away_from_its_default():
    default = MaskConfig()
    assert {f.name for f in dataclasses.fields(MaskConfig)} == set(NON_DEFAULT) | {"rule"}
    assert all(NON_DEFAULT[name] != getattr(default, name) for name in NON_DEFAULT)


def _config(cfg: MaskConfig, info: dict, sampling: SamplingMask | None):
    section = {key: value for key, value in to_dict(cfg).items() if key != "rule"}
    loss = {"mask": section, "sampling_mask": {} if sampling is None else sampling.as_dict()}
    return type("Cfg", (), {"policy_loss": loss, "global_batch_info": info})()


def _core(batch, cfg: MaskConfig, sampling: SamplingMask | None, dp: DPInfo):
    t, k = batch.response_mask.shape[1], batch.k
    resp = batch.response_mask
    support = support_from_topk(batch.topk.ids.reshape(-1, k), batch.topk.logp.reshape(-1, k),
                                batch.topk.sampled.reshape(-1), batch.topk.sampled_logp.reshape(-1),
                                vocab_size=batch.vocab_size, k=cfg.k, convention=cfg.convention,
                                row_mask=resp.reshape(-1))
    pi = policy_on_support(batch.logits, support.ids, sampling=sampling, keep_on_support=engine_kept(support))
    return pdm_policy_loss(pi, on_sampling_set(support, pi.tail_count), batch.advantages, resp, cfg, dp=dp)


@pytest.mark.parametrize("rule", topk_rules())
def test_the_topk_loss_is_the_cores_with_every_field_and_the_sampling_mask(rule, tmp_path, monkeypatch):
    monkeypatch.setenv(RECORD_ENV, str(tmp_path))
    batch = call_site_batch(seed=5)
    cfg = MaskConfig(rule=rule, **NON_DEFAULT)
    info = {"dp_size": 1, "batch_num_tokens": int(batch.response_mask.sum()), "global_batch_size": 4,
            "loss_scale_factor": None}
    dp = DPInfo(tokens=info["batch_num_tokens"], sequences=4, world=1)
    core = _core(batch, cfg, SAMPLING, dp)
    (core_grad,) = torch.autograd.grad(core.loss, batch.logits)
    data, nnz = _verl_batch(batch, torch.arange(4))
    loss, metrics = topk_policy_loss(_config(cfg, info, SAMPLING), nnz, data, rule=rule, loss_agg_mode=cfg.aggregation)
    (grad,) = torch.autograd.grad(loss, batch.logits)
    torch.testing.assert_close(loss, core.loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, core_grad, rtol=1e-10, atol=1e-15)
    assert metrics["actor/pdm/mask/frac_dropped"] == pytest.approx(float(core.metrics["mask/frac_dropped"]))
    record = json.loads((tmp_path / "pdm_config.json").read_text())
    assert record["mask"] == to_dict(cfg) and record["mask"]["convention"] == "kslot"
    assert record["sampling_mask"] == SAMPLING.as_dict()
    # planted bug: the same loss without the sampling mask is another loss
    plain = _core(batch, cfg, None, dp)
    assert not torch.allclose(plain.loss, core.loss, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("rule", ["ppo_clip_dual", "icepop", "seq_k3", "opsm", "token_k1", "dppo_binary_tv"])
def test_a_sampled_token_loss_is_the_cores_with_every_field(rule):
    batch = call_site_batch(seed=5)
    b, t = batch.response_mask.shape
    cfg = MaskConfig(rule=rule, **NON_DEFAULT)
    info = {"dp_size": 1, "batch_num_tokens": int(batch.response_mask.sum()), "global_batch_size": 4,
            "loss_scale_factor": None}
    core = _core(batch, cfg, None, DPInfo(tokens=info["batch_num_tokens"], sequences=4, world=1))
    (core_grad,) = torch.autograd.grad(core.loss, batch.logits)
    pi_k = torch.log_softmax(batch.logits, -1).gather(1, batch.topk.sampled.reshape(-1, 1))[:, 0].reshape(b, t)
    loss, _ = get_policy_loss_fn(f"{LOSS_PREFIX}{rule}")(
        old_log_prob=batch.topk.sampled_logp.double(), log_prob=pi_k, advantages=batch.advantages,
        response_mask=batch.response_mask, loss_agg_mode=cfg.aggregation, config=_config(cfg, info, None),
        rollout_is_weights=None)
    (grad,) = torch.autograd.grad(loss, batch.logits)
    torch.testing.assert_close(loss, core.loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, core_grad, rtol=1e-10, atol=1e-15)


def test_contradictions_are_refused_in_one_line():
    batch = call_site_batch(seed=5)
    b, t = batch.response_mask.shape
    cfg = MaskConfig(rule="ppo_clip", **NON_DEFAULT)
    kwargs = dict(old_log_prob=batch.topk.sampled_logp.double(), log_prob=batch.topk.sampled_logp.double(),
                  advantages=batch.advantages, response_mask=batch.response_mask, rollout_is_weights=None)
    fn = get_policy_loss_fn(f"{LOSS_PREFIX}ppo_clip")
    with pytest.raises(ValueError, match="sampling_mask cuts"):
        fn(loss_agg_mode=cfg.aggregation, config=_config(cfg, {}, SAMPLING), **kwargs)
    with pytest.raises(ValueError, match="contradicts verl's loss_agg_mode"):
        fn(loss_agg_mode="token-mean", config=_config(cfg, {}, None), **kwargs)
    bad = type("Cfg", (), {"policy_loss": {"mask": {}, "sampling_mask": {"top_q": 0.9}}, "global_batch_info": {}})()
    with pytest.raises(ValueError, match="top_q"):
        fn(loss_agg_mode="token-mean", config=bad, **kwargs)
