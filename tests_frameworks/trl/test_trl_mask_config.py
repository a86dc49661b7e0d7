"""PDMGRPOTrainer passes the whole ``MaskConfig`` and the data-parallel counts to the core, keeps
the generator's sampling mask, records what it resolved, and generates without transformers'
deprecation warning (HF generate on a tiny random Qwen3, CPU, fp32: real TRL steps)."""
from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from pdm_lab import MaskConfig, pdm_policy_loss, policy_on_support, support_from_topk
from pdm_lab.aggregation import DPInfo
from pdm_lab.config import to_dict
from pdm_lab.sampling_mask import SamplingMask, engine_kept, on_sampling_set

from test_trl_trainer import _dataset, build_tiny


def _reward(completions, **kwargs):
    # varied within each group whatever the lengths: non-zero advantages for the loss to weigh
    return [float(sum(map(ord, c[0]["content"])) % 7) for c in completions]

#: every field away from its default (the rule varies per case; band rules need their band)
NON_DEFAULT = dict(delta=0.01, delta_neg=0.02, k=6, convention="kslot", estimator="uniform", eps_low=0.1,
                   eps_high=0.3, icepop_low=0.9, icepop_high=1.05, clip_ratio_c=1.5,
                   aggregation="seq-mean-token-sum-norm", horizon=10, dual_clip_c=2.5, seq_agg="max",
                   band_low=-1e-4, band_high=1e-4, veto_floor=0.5, opsm_delta=2e-4, kernel_ratio=2.0)
RULES = ("pdm_agg", "dppo_topk_tv", "ppo_clip_dual", "icepop", "seq_topk_kl", "opsm", "token_k3")


def test_every_field_is_away_from_its_default():
    default = MaskConfig()
    for f in dataclasses.fields(MaskConfig):
        if f.name != "rule":
            assert NON_DEFAULT[f.name] != getattr(default, f.name), f.name


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny-qwen3-mask"))


def _recording(rule_loss):
    from pdm_lab.integrations.trl import PDMGRPOTrainer

    class Recording(PDMGRPOTrainer):
        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            if not rule_loss:  # before any step: π has the weights that generated μ
                self.pdm_first_d = self.pdm_last_output.metrics["div/topk_kl_mean"]
            rule_loss.append((inputs, {k: v.detach().clone() for k, v in model.state_dict().items()}, loss.detach()))
            return loss

    return Recording


def _train(tiny_dir, tmp_path, mask: MaskConfig, records: list, **kwargs):
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=10, max_steps=2, num_iterations=2, learning_rate=3e-3, beta=0.0,
                      temperature=1.0,
                      top_k=0, top_p=0.9, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                      save_strategy="no", bf16=False, **kwargs.pop("args", {}))
    trainer = _recording(records)(model=str(tiny_dir), reward_funcs=_reward, args=args, train_dataset=_dataset(4),
                                  mask=mask, **kwargs)
    trainer.train()
    return trainer


def _core_loss(tiny_dir, inputs, weights, mask: MaskConfig, sampling: SamplingMask | None):
    """The same batch through the core alone: the model at the loss's weights, μ's support by
    the config's K and convention, π over the sampling set, the batch's own counts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir)).float()
    model.load_state_dict(weights)
    b, t = inputs["completion_ids"].shape
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=att, logits_to_keep=t + 1).logits[:, :-1]
    resp = inputs["completion_mask"].bool()
    support = support_from_topk(inputs["pdm_topk_ids"].reshape(b * t, -1), inputs["pdm_topk_logp"].reshape(b * t, -1),
                                inputs["completion_ids"].reshape(-1), inputs["pdm_mu_logp"].reshape(-1),
                                vocab_size=logits.size(-1), k=mask.k, convention=mask.convention,
                                row_mask=resp.reshape(-1))
    pi = policy_on_support(logits.reshape(b * t, -1), support.ids, sampling=sampling,
                           keep_on_support=engine_kept(support))
    adv = inputs["advantages"][:, None].expand(b, t).float()
    dp = DPInfo(tokens=float(resp.sum()), sequences=float(resp.any(1).sum()), world=1)  # one window, one process
    return pdm_policy_loss(pi, on_sampling_set(support, pi.tail_count), adv, resp, mask, dp=dp)


@pytest.mark.parametrize("rule", RULES)
def test_the_trainer_loss_is_the_cores_with_every_field(tiny_dir, tmp_path, rule):
    mask = MaskConfig(rule=rule, **NON_DEFAULT)
    records = []
    trainer = _train(tiny_dir, tmp_path, mask, records)
    assert trainer.pdm_mask == mask and trainer.pdm_sampling == SamplingMask(top_k=0, top_p=0.9, min_p=0.0)
    recorded = json.loads((tmp_path / "out" / "pdm_config.json").read_text())
    assert recorded["mask"] == to_dict(mask) and recorded["mask"]["convention"] == "kslot"
    assert recorded["sampling_mask"] == {"top_k": 0, "top_p": 0.9, "min_p": 0.0}
    assert records and float(records[0][0]["advantages"].abs().max()) > 0.1
    for inputs, weights, loss in records:
        ref = _core_loss(tiny_dir, inputs, weights, mask, trainer.pdm_sampling)
        torch.testing.assert_close(loss, ref.loss.detach(), rtol=1e-5, atol=1e-7)
    assert torch.equal(trainer.pdm_last_output.keep, ref.keep)
    # a planted bug: an adapter that dropped the config (the rule's defaults) computes another
    # loss or mask on the same batch (the second call re-uses it after a step: r ≠ 1)
    if rule == "seq_topk_kl":
        return  # this tiny batch has every response's D outside both bands: nothing to tell apart
    inputs, weights, loss = records[-1]
    other = _core_loss(tiny_dir, inputs, weights, MaskConfig(rule=rule, k=mask.k), trainer.pdm_sampling)
    assert not (torch.allclose(loss, other.loss.detach(), rtol=1e-5, atol=1e-7) and torch.equal(ref.keep, other.keep))


def test_the_sampling_mask_removes_the_cut_and_generate_does_not_warn(tiny_dir, tmp_path):
    """HF generate samples with the model's own weights at top_p 0.9: the first loss call sees
    μ = π over the cut (D ~ 0) with the sampling mask, and D > 0 from the cut alone without it.
    transformers' 'generation_config together with generation arguments' warning never fires."""
    seen = []

    class Grab(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Grab(level=logging.WARNING)
    logging.getLogger("transformers").addHandler(handler)
    try:
        d = {}
        for keep in (None, False):
            records = []
            trainer = _train(tiny_dir, tmp_path / str(keep), MaskConfig(rule="pdm_topk", k=8), records,
                             keep_sampling_mask=keep)
            d[keep] = float(trainer.pdm_first_d)
            assert (trainer.pdm_sampling is None) == (keep is False)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert d[None] < 1e-6 and d[False] > 1e-3, d
    assert not [m for m in seen if "generation_config" in m and "deprecated" in m], seen
