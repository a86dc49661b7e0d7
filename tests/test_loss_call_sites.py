"""One parser and one loss tail behind every caller: the scaling loop's rollout conversion and loss
path, fed the batch of ``pdm_lab.testing.call_site_batch`` (the TRL and verl halves of the same
checks run in their environments: tests_frameworks/), give the core's tensors, loss and gradient."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdm_lab import MaskConfig
from pdm_lab.aggregation import DPInfo
from pdm_lab.engine_topk import pad_responses, topk_from_dicts, topk_from_flat, topk_from_ranked
from pdm_lab.errors import PDMInputError
from pdm_lab.policy_side import policy_on_support
from pdm_lab.scaling import train_step
from pdm_lab.scaling.rollout import outputs_to_batch
from pdm_lab.testing.call_site_batch import call_site_batch


class _Tok:
    def batch_decode(self, seqs, skip_special_tokens=True):
        return [" ".join(map(str, s)) for s in seqs]


def _same_topk(got, want):
    for field in ("ids", "logp", "sampled", "sampled_logp"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field


def test_every_layout_of_vllms_answer_parses_to_the_same_tensors():
    """vLLM's flat layout (the scaling loop, through ``outputs_to_batch``), its dicts (verl) and
    TRL's ranked lists give μ's top-K exactly as taken from μ itself, padded by one rule. A reader
    that takes the flat layout's first K entries as the top-K (the planted bug: entry 0 is the
    sampled token) is caught."""
    batch = call_site_batch(seed=3)
    t = batch.response_mask.shape[1]
    completions = batch.completions()
    request = SimpleNamespace(outputs=[SimpleNamespace(token_ids=toks, logprobs=flat, finish_reason="stop")
                                       for toks, flat in zip(completions, batch.vllm_flat())])
    rollout = outputs_to_batch([request], [[1]], ["a"], k=batch.k, tokenizer=_Tok())
    assert torch.equal(rollout.response_mask, batch.response_mask)
    assert torch.equal(rollout.response_ids, batch.topk.sampled)
    assert torch.equal(rollout.topk_ids, batch.topk.ids) and torch.equal(rollout.topk_logp, batch.topk.logp)
    assert torch.equal(rollout.sampled_logp, batch.topk.sampled_logp)
    dicts = [topk_from_dicts(seq, toks, batch.k) for seq, toks in zip(batch.vllm_dicts(), completions)]
    _same_topk(pad_responses(dicts, t), batch.topk)
    logprobs, token_ids = batch.vllm_ranked()
    ranked = [topk_from_ranked(lp, ids, toks, batch.k) for lp, ids, toks in zip(logprobs, token_ids, completions)]
    _same_topk(pad_responses(ranked, t), batch.topk)
    flat = batch.vllm_flat()[0]
    naive_ids = torch.tensor(flat.token_ids).reshape(-1, batch.k + 1)[:, : batch.k]
    assert not torch.equal(naive_ids, batch.topk.ids[0, : batch.lengths[0]])
    assert torch.equal(topk_from_flat(flat, completions[0], batch.k).ids, batch.topk.ids[0, : batch.lengths[0]])


@pytest.mark.parametrize("bad, match", [(None, "position 1: token 7 has log-prob nan"),
                                        (float("nan"), "position 1: token 7 has log-prob nan"),
                                        (float("inf"), "position 1: token 7 has log-prob inf")])
def test_the_parser_refuses_a_log_prob_that_is_not_one_naming_the_position(bad, match):
    logprobs = [[-0.1, -2.0], [-0.2, bad]]
    with pytest.raises(PDMInputError, match=match):
        topk_from_ranked(logprobs, [[3, 4], [5, 7]], [3, 5], 2, response=2)
    with pytest.raises(PDMInputError, match="response 2, position 1: no entry for the sampled token 9"):
        topk_from_ranked([[-0.1], [-0.2]], [[3], [5]], [3, 9], 1, response=2)
    with pytest.raises(PDMInputError, match="position 0: the sampled token 3 has log-prob −inf"):
        topk_from_dicts([{3: float("-inf"), 4: -0.1}], [3], 2)


def _micro_batch(batch, rows):
    """The loop's ``MicroBatch`` of sequences `rows`; the trainer's logits stand in for the model
    (``positions`` index them)."""
    t, k = batch.response_mask.shape[1], batch.k
    resp = batch.response_mask[rows]
    flat = (rows[:, None] * t + torch.arange(t)).reshape(-1)
    return train_step.MicroBatch(
        input_ids=torch.zeros_like(resp, dtype=torch.long), attention_mask=resp.long(),
        positions=flat[resp.reshape(-1)], response_mask=resp, advantages=batch.advantages[rows],
        topk_ids=batch.topk.ids[rows].reshape(-1, k), topk_logp=batch.topk.logp[rows].reshape(-1, k),
        sampled=batch.topk.sampled[rows].reshape(-1), sampled_logp=batch.topk.sampled_logp[rows].reshape(-1))


def _logits_policy(logits):
    """``PolicyModel``'s interface on given logits: π on the support at ``positions``."""
    def policy(input_ids, attention_mask, positions, ids, temperature, chunk_tokens):
        pi = policy_on_support(logits[positions], ids, temperature=temperature, chunk_size=chunk_tokens)
        return pi.logp, pi.tail_logp, pi.tail_log_sumsq
    return policy


@pytest.mark.parametrize("rule, aggregation", [("pdm_topk", "token-mean"), ("dppo_topk_kl", "seq-mean-token-mean"),
                                               ("ppo_clip", "seq-mean-token-sum-norm")])
def test_the_scaling_loss_path_is_the_cores_loss_whole_and_split_into_micro_batches(rule, aggregation):
    """``train_step.micro_batch_loss`` (the loop's support, π with padding rows, the core's loss)
    on the whole batch equals the core's loss on the same tensors: loss, gradient, keep mask. Split
    into two micro-batches with the mini-batch's counts (``DPInfo``), the losses add up to it. A
    micro-batch normalised by its own count (no ``dp``: the planted bug) does not."""
    batch = call_site_batch(seed=5)
    cfg = MaskConfig(rule=rule, delta=0.05, k=batch.k, aggregation=aggregation, clip_ratio_c=3.0)
    core = batch.core_loss(cfg)
    (core_grad,) = torch.autograd.grad(core.loss, batch.logits)
    assert core.keep.eq(0).any() and core.keep.eq(1).any()
    policy = _logits_policy(batch.logits)
    kw = dict(vocab_size=batch.vocab_size, temperature=1.0, chunk_tokens=None)
    whole = torch.arange(len(batch.lengths))
    out, _ = train_step.micro_batch_loss(policy, _micro_batch(batch, whole), cfg, **kw)
    (grad,) = torch.autograd.grad(out.loss, batch.logits)
    torch.testing.assert_close(out.loss, core.loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, core_grad, rtol=1e-10, atol=1e-15)
    assert torch.equal(out.keep, core.keep)
    micros = [_micro_batch(batch, torch.tensor(r)) for r in ([0, 1], [2, 3])]
    dp = DPInfo.all_reduce(sum(m.n_tokens for m in micros), sum(m.n_seqs for m in micros))
    split = sum(train_step.micro_batch_loss(policy, m, cfg, dp=dp, **kw)[0].loss for m in micros)
    (split_grad,) = torch.autograd.grad(split, batch.logits)
    torch.testing.assert_close(split, core.loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(split_grad, core_grad, rtol=1e-10, atol=1e-15)
    local = sum(train_step.micro_batch_loss(policy, m, cfg, **kw)[0].loss for m in micros)
    assert not torch.isclose(local, core.loss, rtol=1e-6)
