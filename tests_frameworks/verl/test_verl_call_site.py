"""verl's halves of the call-site checks (tests/test_loss_call_sites.py has the scaling loop's,
tests_frameworks/trl the TRL trainer's): fed ``pdm_lab.testing.call_site_batch``, vLLM's dicts parse
to the core's tensors, and verl's policy losses — the top-K path on the actor's no-padding logits
and a sampled-token rule through ``get_policy_loss_fn`` — give the core's loss and gradient, on one
rank and split over two ranks with verl's global batch counts."""
from __future__ import annotations

import pytest
import torch

import verl  # noqa: F401  (loads the `verl.plugins` entry points: pdm_lab registers here)
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from pdm_lab import MaskConfig
from pdm_lab.integrations.verl import LOSS_PREFIX
from pdm_lab.integrations.verl_topk import topk_from_vllm, topk_policy_loss
from pdm_lab.testing.call_site_batch import call_site_batch

P = 3  # prompt length; prompts left-padded by 0, 1, 2, 0 tokens


def test_vllms_dicts_parse_to_the_cores_tensors():
    batch = call_site_batch(seed=3)
    ids, logp, mu_k = topk_from_vllm(batch.vllm_dicts(), batch.topk.sampled, batch.k)
    assert torch.equal(ids, batch.topk.ids) and torch.equal(logp, batch.topk.logp)
    assert torch.equal(mu_k, batch.topk.sampled_logp)


def _verl_batch(batch, rows):
    """Sequences `rows` in verl's padded layout (TensorDict) and the actor's [nnz, V] logits."""
    from tensordict import TensorDict
    from verl.utils.attention_utils import index_first_axis, unpad_input

    b, (t, v) = len(rows), (batch.response_mask.shape[1], batch.vocab_size)
    resp = batch.response_mask[rows]
    prompt_mask = (torch.arange(P)[None, :] >= torch.tensor([0, 1, 2, 0])[rows][:, None]).long()
    attention = torch.cat([prompt_mask, resp.long()], 1)
    data = TensorDict({"prompts": prompt_mask, "responses": batch.topk.sampled[rows], "attention_mask": attention,
                       "input_ids": torch.cat([prompt_mask, batch.topk.sampled[rows]], 1),
                       "response_mask": resp.long(), "advantages": batch.advantages[rows],
                       "rollout_log_probs": batch.topk.sampled_logp[rows].double(),
                       "rollout_topk_ids": batch.topk.ids[rows], "rollout_topk_logp": batch.topk.logp[rows].double()},
                      batch_size=[b])
    # response token j is predicted at position P + j − 1 of the padded [b, P + T] sequence
    padded = torch.zeros(b, P + t, v, dtype=torch.float64)
    padded = torch.cat([padded[:, : P - 1], batch.logits.reshape(-1, t, v)[rows], padded[:, P - 1 + t:]], 1)
    _, indices, *_ = unpad_input(attention.unsqueeze(-1).float(), attention)
    return data, index_first_axis(padded.reshape(-1, v), indices)


def _config(cfg, info):
    section = {"mask": {key: getattr(cfg, key) for key in ("delta", "k", "clip_ratio_c")}}
    return type("Cfg", (), {"policy_loss": section, "global_batch_info": info})()


@pytest.mark.parametrize("rule, mode", [("pdm_topk", "token-mean"), ("dppo_topk_kl", "seq-mean-token-sum-norm")])
def test_the_topk_policy_loss_is_the_cores_loss_on_one_rank_and_split_over_two(rule, mode):
    batch = call_site_batch(seed=5)
    cfg = MaskConfig(rule=rule, delta=0.05, k=batch.k, clip_ratio_c=3.0, aggregation=mode)
    core = batch.core_loss(cfg)
    (core_grad,) = torch.autograd.grad(core.loss, batch.logits)
    assert core.keep.eq(0).any()
    data, nnz = _verl_batch(batch, torch.arange(4))
    loss, metrics = topk_policy_loss(_config(cfg, {}), nnz, data, rule=rule, loss_agg_mode=mode)
    (grad,) = torch.autograd.grad(loss, batch.logits)
    torch.testing.assert_close(loss, core.loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, core_grad, rtol=1e-10, atol=1e-15)
    assert metrics["actor/pdm/mask/frac_dropped"] == pytest.approx(float(core.metrics["mask/frac_dropped"]))
    ranks = (torch.tensor([0, 1]), torch.tensor([2, 3]))
    info = {"dp_size": 2, "batch_num_tokens": int(batch.response_mask.sum()), "global_batch_size": 4,
            "loss_scale_factor": None}
    losses = [topk_policy_loss(_config(cfg, info), *_verl_batch(batch, r)[::-1], rule=rule, loss_agg_mode=mode)[0]
              for r in ranks]
    mean = (losses[0] + losses[1]) / 2  # FSDP averages the ranks' gradients
    (mean_grad,) = torch.autograd.grad(mean, batch.logits)
    torch.testing.assert_close(mean, core.loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(mean_grad, core_grad, rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("rule", ["ppo_clip", "dppo_binary_kl"])
def test_a_sampled_token_rule_through_verls_registry_is_the_cores_loss(rule):
    """The one-slot support S = {k} decides a sampled-token rule as μ's top-K support does: the
    verl loss on [B, T] log-probs equals the core's on the top-K support, value and gradient."""
    batch = call_site_batch(seed=5)
    b, t = batch.response_mask.shape
    cfg = MaskConfig(rule=rule, delta=0.05, k=batch.k, clip_ratio_c=3.0)
    core = batch.core_loss(cfg)
    (core_grad,) = torch.autograd.grad(core.loss, batch.logits)
    assert core.keep.eq(0).any()
    pi_k = torch.log_softmax(batch.logits, -1).gather(1, batch.topk.sampled.reshape(-1, 1))[:, 0].reshape(b, t)
    loss, _ = get_policy_loss_fn(f"{LOSS_PREFIX}{rule}")(
        old_log_prob=batch.topk.sampled_logp.double(), log_prob=pi_k, advantages=batch.advantages,
        response_mask=batch.response_mask, loss_agg_mode="token-mean", config=_config(cfg, {}),
        rollout_is_weights=None)
    (grad,) = torch.autograd.grad(loss, batch.logits)
    torch.testing.assert_close(loss, core.loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, core_grad, rtol=1e-10, atol=1e-15)
