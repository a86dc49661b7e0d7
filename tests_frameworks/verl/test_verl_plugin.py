"""The verl plugin in a real verl 0.9.1 environment (CPU): the entry point registers every
sampled-token rule on ``import verl``; a loss dispatched through verl's ``get_policy_loss_fn`` and
through ``ppo_loss`` (verl's no-padding → padding path) equals ``pdm_policy_loss``, value and
gradient; the top-K data path through verl's padding utilities equals ``pdm_policy_loss`` on the
padded batch; the bypass-mode patch keeps the plugin's loss_mode; installing pdm_lab moved nothing."""
from __future__ import annotations

import math
from importlib import metadata

import pytest
import torch

import verl  # noqa: F401  (loads the `verl.plugins` entry points: pdm_lab registers here)
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn
from verl.workers.config import ActorConfig
from verl.workers.config.actor import PolicyLossConfig

from pdm_lab import MaskConfig, pdm_policy_loss, policy_on_support, support_from_full, support_from_topk
from pdm_lab.integrations.sampled_token import sampled_token_rules, sampled_token_view
from pdm_lab.integrations.verl import LOSS_PREFIX, PDMPolicyLossConfig

B, P, T, V = 3, 4, 5, 40
SECTION = {"delta": 0.05, "band_low": -0.05, "band_high": 0.05, "veto_floor": 0.2, "opsm_delta": 0.01}


def test_installing_pdm_lab_moved_no_version(install_diff):
    only_before, only_after = install_diff
    assert only_before == [] and only_after == [], (only_before, only_after)
    assert metadata.version("verl") == "0.9.1"


def test_entry_point_registers_every_sampled_token_rule():
    names = {f"{LOSS_PREFIX}{r}" for r in sampled_token_rules()}
    assert names <= set(POLICY_LOSS_REGISTRY), names - set(POLICY_LOSS_REGISTRY)
    assert {"pdm_lab.ppo_clip_dual", "pdm_lab.seq_geo_mean", "pdm_lab.opsm", "pdm_lab.dppo_binary_kl"} <= names
    assert "pdm_lab.pdm_topk" not in names  # needs μ's top-K: the top-K path
    assert issubclass(PDMPolicyLossConfig, PolicyLossConfig)


def _batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(B * T, V, generator=gen, dtype=torch.float64) * 3
    mu = torch.log_softmax(z, -1)
    pi_logits = (z + 0.4 * torch.randn(B * T, V, generator=gen, dtype=torch.float64)).requires_grad_()
    sampled = torch.multinomial(mu.exp(), 1, generator=gen)[:, 0]
    resp = torch.tensor([[1] * T, [1] * (T - 2) + [0] * 2, [1] * 2 + [0] * (T - 2)], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)[:, None].expand(B, T).clone()
    return mu, pi_logits, sampled, resp, adv


def _reference(rule, mu, pi_logits, sampled, resp, adv):
    support = support_from_full(mu, sampled, k=5)
    out = pdm_policy_loss(policy_on_support(pi_logits, support.ids), support, adv, resp,
                          MaskConfig(rule=rule, k=5, **SECTION))
    (grad,) = torch.autograd.grad(out.loss, pi_logits)
    return out, grad


def _actor_config(rule):
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                       policy_loss=PDMPolicyLossConfig(loss_mode=f"{LOSS_PREFIX}{rule}", mask=dict(SECTION)))


@pytest.mark.parametrize("rule", sampled_token_rules())
def test_get_policy_loss_fn_equals_pdm_policy_loss(rule):
    mu, pi_logits, sampled, resp, adv = _batch()
    ref, ref_grad = _reference(rule, mu, pi_logits, sampled, resp, adv)
    mu_k = mu.gather(1, sampled[:, None])[:, 0].reshape(B, T)
    pi_k = torch.log_softmax(pi_logits, -1).gather(1, sampled[:, None])[:, 0].reshape(B, T)
    loss, metrics = get_policy_loss_fn(f"{LOSS_PREFIX}{rule}")(
        old_log_prob=mu_k, log_prob=pi_k, advantages=adv, response_mask=resp, loss_agg_mode="token-mean",
        config=_actor_config(rule), rollout_is_weights=None)
    (grad,) = torch.autograd.grad(loss, pi_logits)
    assert torch.allclose(loss, ref.loss, rtol=1e-12, atol=1e-14)
    assert torch.allclose(grad, ref_grad, rtol=1e-10, atol=1e-14)
    assert metrics["actor/pdm/mask/frac_dropped"] == pytest.approx(float(ref.metrics["mask/frac_dropped"]))


def _padded_batch(sampled, resp, extra):
    """verl's left-right padded layout: prompts left-padded [B, P], responses right-padded [B, T]."""
    from tensordict import TensorDict

    prompt_mask = torch.tensor([[1] * P, [0] + [1] * (P - 1), [0, 0] + [1] * (P - 2)], dtype=torch.long)
    prompts = torch.randint(0, V, (B, P)) * prompt_mask
    responses = sampled.reshape(B, T) * resp
    attention_mask = torch.cat([prompt_mask, resp.long()], 1)
    return TensorDict({"prompts": prompts, "responses": responses, "attention_mask": attention_mask,
                       "input_ids": torch.cat([prompts, responses], 1), "response_mask": resp.long(), **extra},
                      batch_size=[B])


def _no_padding(values_padded, attention_mask):
    """[B, P+T, ...] → [nnz, ...] the way verl unpads (its own ``unpad_input`` indices)."""
    from verl.utils.attention_utils import index_first_axis, unpad_input

    _, indices, *_ = unpad_input(attention_mask.unsqueeze(-1).float(), attention_mask)
    flat = values_padded.reshape(-1, *values_padded.shape[2:])
    if flat.dim() == 1:  # verl's index_first_axis wants [*, ...]: carry a trailing unit dim
        return index_first_axis(flat[:, None], indices)[:, 0]
    return index_first_axis(flat, indices)


@pytest.mark.parametrize("rule", ["dppo_binary_kl", "seq_geo_mean", "ppo_clip_dual"])
def test_ppo_loss_through_verls_padding_equals_pdm_policy_loss(rule):
    from verl.workers.utils.losses import ppo_loss

    mu, pi_logits, sampled, resp, adv = _batch(1)
    ref, ref_grad = _reference(rule, mu, pi_logits, sampled, resp, adv)
    mu_k = mu.gather(1, sampled[:, None])[:, 0].reshape(B, T)
    pi_k = torch.log_softmax(pi_logits, -1).gather(1, sampled[:, None])[:, 0].reshape(B, T)
    data = _padded_batch(sampled, resp, {"old_log_probs": mu_k, "advantages": adv})
    # model output: log-prob of the *next* token at each position ([B, P+T] → no padding), as verl's
    # actor returns it; response token t sits at position P+t−1
    per_position = torch.zeros(B, P + T, dtype=torch.float64)
    per_position = torch.cat([per_position[:, : P - 1], pi_k, per_position[:, P - 1 + T:]], 1)
    from verl.utils import tensordict_utils as tu

    for key, value in (("dp_size", 1), ("batch_num_tokens", None), ("global_batch_size", None)):
        tu.assign_non_tensor_data(data, key, value)  # one rank, local normalisation
    out = _no_padding(per_position, data["attention_mask"])
    loss, metrics = ppo_loss(_actor_config(rule), {"log_probs": out}, data)
    (grad,) = torch.autograd.grad(loss, pi_logits)
    assert torch.allclose(loss, ref.loss, rtol=1e-12, atol=1e-14)
    assert torch.allclose(grad, ref_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("rule", ["pdm_topk", "dppo_topk_kl", "seq_topk_kl"])
def test_topk_path_through_verls_padding_equals_pdm_policy_loss(rule):
    from pdm_lab.integrations.verl_topk import topk_from_vllm, topk_policy_loss

    k = 6
    mu, pi_logits, sampled, resp, adv = _batch(2)
    # what vLLM returns per position: the top-K plus the sampled token, as {id: logprob}
    top = torch.topk(mu, k, -1)
    vllm_out = [[{**{int(i): float(lp) for i, lp in zip(top.indices[b * T + t], top.values[b * T + t])},
                  int(sampled[b * T + t]): float(mu[b * T + t, sampled[b * T + t]])} for t in range(T)]
                for b in range(B)]
    responses = sampled.reshape(B, T)
    ids, logp, mu_k = topk_from_vllm(vllm_out, responses, k)
    data = _padded_batch(sampled, resp, {"advantages": adv, "rollout_log_probs": mu_k.double(),
                                         "rollout_topk_ids": ids, "rollout_topk_logp": logp.double()})
    data["responses"] = responses  # padding positions are masked; keep the ids the support checks
    # the actor's logits in verl's no-padding layout: response token t is predicted at P+t−1
    logits_padded = torch.zeros(B, P + T, V, dtype=torch.float64)
    logits_padded = torch.cat([logits_padded[:, : P - 1], pi_logits.reshape(B, T, V), logits_padded[:, P - 1 + T:]], 1)
    nnz = _no_padding(logits_padded, data["attention_mask"])
    section = {"mask": {**SECTION, "k": k}}
    cfg = type("Cfg", (), {"policy_loss": section, "global_batch_info": {}})()
    loss, metrics = topk_policy_loss(cfg, nnz, data, rule=rule)
    (grad,) = torch.autograd.grad(loss, pi_logits)
    support = support_from_topk(ids.reshape(B * T, k), logp.reshape(B * T, k).double(), sampled,
                                mu_k.reshape(-1).double(), vocab_size=V, k=k, row_mask=resp.reshape(-1))
    ref = pdm_policy_loss(policy_on_support(pi_logits, support.ids), support, adv, resp,
                          MaskConfig(rule=rule, k=k, **SECTION))
    (ref_grad,) = torch.autograd.grad(ref.loss, pi_logits)
    assert torch.allclose(loss, ref.loss, rtol=1e-10, atol=1e-12)
    assert torch.allclose(grad, ref_grad, rtol=1e-8, atol=1e-12)
    assert metrics["actor/pdm/mask/frac_dropped"] == pytest.approx(float(ref.metrics["mask/frac_dropped"]))
    assert math.isfinite(metrics["actor/pdm/div/topk_kl_mean"])


def test_bypass_mode_patch_keeps_the_plugin_loss_mode():
    from omegaconf import OmegaConf
    from verl.trainer.ppo import rollout_corr_helper

    from verl import DataProto

    batch = DataProto.from_dict({"rollout_log_probs": torch.zeros(2, 3)})
    policy_loss = OmegaConf.create({"loss_mode": "pdm_lab.opsm"})
    rollout_corr_helper.apply_bypass_mode(batch, OmegaConf.create({"bypass_mode": True}), policy_loss)
    assert policy_loss["loss_mode"] == "pdm_lab.opsm"
    assert torch.equal(batch.batch["old_log_probs"], batch.batch["rollout_log_probs"])
    verl_own = OmegaConf.create({"loss_mode": "vanilla"})
    rollout_corr_helper.apply_bypass_mode(batch, OmegaConf.create({"bypass_mode": True}), verl_own)
    assert verl_own["loss_mode"] == "bypass_mode"  # verl's own behaviour untouched
