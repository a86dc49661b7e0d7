"""The TRL trainer's halves of the call-site checks (tests/test_loss_call_sites.py has the scaling
loop's, tests_frameworks/verl the verl ones'): fed ``pdm_lab.testing.call_site_batch``, TRL's view of
vLLM's answer parses to the core's tensors, and ``PDMGRPOTrainer.pdm_loss_output`` — the trainer's
loss path from the model's logits — gives the core's loss, gradient and keep mask."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdm_lab import MaskConfig
from pdm_lab.engine_topk import pad_responses
from pdm_lab.integrations.trl import PDMGRPOTrainer, rollout_from_vllm
from pdm_lab.testing.call_site_batch import call_site_batch

P = 3  # prompt length


def test_trls_view_of_vllms_answer_parses_to_the_cores_tensors():
    batch = call_site_batch(seed=3)
    logprobs, token_ids = batch.vllm_ranked()
    rows = rollout_from_vllm(batch.completions(), logprobs, token_ids, batch.k)
    padded = pad_responses(rows, batch.response_mask.shape[1])  # as _generate_and_score_completions pads
    for field in ("ids", "logp", "sampled", "sampled_logp"):
        assert torch.equal(getattr(padded, field), getattr(batch.topk, field)), field
    top_by_rank = torch.tensor([ids[: batch.k] for ids in token_ids[0]])  # vLLM's rank order: the top-K's here
    assert torch.equal(top_by_rank, batch.topk.ids[0, : batch.lengths[0]])


class _Logits(torch.nn.Module):
    """The model's interface on given logits: [B, P + T] inputs → logits of the last T + 1 positions,
    the first T of which predict the completion tokens."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, attention_mask, logits_to_keep):
        b, t, v = self.logits.shape
        assert logits_to_keep == t + 1 and input_ids.shape == (b, P + t)
        return SimpleNamespace(logits=torch.cat([self.logits, torch.zeros(b, 1, v, dtype=self.logits.dtype)], 1))


@pytest.mark.parametrize("rule", ["pdm_topk", "dppo_topk_kl", "ppo_clip"])
def test_the_trainers_loss_path_is_the_cores_loss(rule):
    batch = call_site_batch(seed=5)
    b, t = batch.response_mask.shape
    cfg = MaskConfig(rule=rule, delta=0.05, k=batch.k, clip_ratio_c=3.0)
    core = batch.core_loss(cfg)
    (core_grad,) = torch.autograd.grad(core.loss, batch.logits)
    assert core.keep.eq(0).any()
    inputs = {"prompt_ids": torch.ones(b, P, dtype=torch.long), "prompt_mask": torch.ones(b, P, dtype=torch.long),
              "completion_ids": batch.topk.sampled, "completion_mask": batch.response_mask.long(),
              "pdm_topk_ids": batch.topk.ids, "pdm_topk_logp": batch.topk.logp, "pdm_mu_logp": batch.topk.sampled_logp,
              "advantages": batch.advantages[:, 0]}
    trainer = SimpleNamespace(pdm_mask=cfg, temperature=1.0, pdm_sampling=None, pdm_dp=lambda inputs: None)
    out = PDMGRPOTrainer.pdm_loss_output(trainer, _Logits(batch.logits.reshape(b, t, -1)), inputs)
    (grad,) = torch.autograd.grad(out.loss, batch.logits)
    torch.testing.assert_close(out.loss, core.loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, core_grad, rtol=1e-10, atol=1e-15)
    assert torch.equal(out.keep, core.keep)
