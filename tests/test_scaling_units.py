"""Pieces of the scaling loop in one process (no vLLM, no process group): advantages, FP8
rounding, rollout → tensors, the trainer's π on the support against a naive full log-softmax,
and one update through the registry's mask and the core's loss."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import pdm_lab.loss
import pdm_lab.masks
import pdm_lab.policy_side
import pdm_lab.support
from pdm_lab.mask_config import MaskConfig
from pdm_lab.scaling import policy_model, train_step
from pdm_lab.lab.advantages import group_advantages
from pdm_lab.scaling.config import TinyModelConfig, TrainerConfig
from pdm_lab.scaling.fp8 import dequantize_blockwise, quantize_blockwise, quantize_dequantize
from pdm_lab.scaling.policy_model import PolicyModel
from pdm_lab.engine_topk import topk_from_flat
from pdm_lab.errors import PDMInputError
from pdm_lab.scaling.rollout import RolloutBatch, outputs_to_batch, request_seed
from pdm_lab.scaling.tiny_model import build_model
from pdm_lab.scaling.weight_sync import to_rollout_precision


# ---------------------------------------------------------------------------- advantages

def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    ok = torch.tensor([True, True, True, False, True, True, True, True])
    a = group_advantages(r, g, ok)
    assert a[3] == 0  # a skipped sample is out of its group and gets no advantage
    assert torch.allclose(a[:3].sum(), torch.tensor(0.0), atol=1e-6) and a[0] > 0 > a[1]
    assert torch.equal(a[4:6], torch.zeros(2))  # equal rewards: no signal
    assert torch.allclose(a[6:], torch.tensor([0.25, -0.25]) / (0.25 * math.sqrt(2) + 1e-6), atol=1e-5)
    dr = group_advantages(r, g, ok, scale_by_std=False)
    assert torch.allclose(dr[6:], torch.tensor([0.25, -0.25]))


# ---------------------------------------------------------------------------- fp8

def test_fp8_blockwise_roundtrip():
    torch.manual_seed(0)
    w = torch.randn(200, 300) * torch.logspace(-3, 1, 300)[None, :]
    q, s = quantize_blockwise(w, 128)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    back = dequantize_blockwise(q, s, 128)
    # e4m3: 3 mantissa bits → relative error ≤ 2^-4 for values in the normal range of their block
    blockmax = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300] * 448
    normal = w.abs() > blockmax * 2.0 ** -6
    rel = ((back - w).abs() / w.abs())[normal]
    assert rel.max() <= 2.0 ** -4 + 1e-6
    assert not torch.equal(back, w)
    assert torch.equal(quantize_dequantize(torch.zeros(5, 7)), torch.zeros(5, 7))


def test_fp8_applies_to_decoder_linears_only():
    w = torch.randn(64, 64)
    assert not torch.equal(to_rollout_precision("model.layers.0.mlp.up_proj.weight", w, "fp8", "simulate", 32).float(),
                           w.to(torch.bfloat16).float())
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(to_rollout_precision(name, w, "fp8", "simulate", 32), w.to(torch.bfloat16))
    fp32 = to_rollout_precision("model.layers.0.mlp.up_proj.weight", w, "fp32", "simulate", 32)
    assert fp32.dtype == torch.float32 and torch.equal(fp32, w)  # fp32 rollout: the weight itself


# ---------------------------------------------------------------------------- rollout → tensors

@dataclasses.dataclass
class Flat:  # the two fields of vllm.logprobs.FlatLogprobs the converter reads
    token_ids: list
    logprobs: list


@dataclasses.dataclass
class Completion:
    token_ids: list
    logprobs: Flat
    finish_reason: str


@dataclasses.dataclass
class Request:
    outputs: list


class Tok:
    def batch_decode(self, seqs, skip_special_tokens=True):
        return ["".join(map(str, s)) for s in seqs]


def _completion(tokens, k, finish="stop"):
    ids, lps = [], []
    for t in tokens:
        top = [(t + j + 1) % 50 for j in range(k)]  # k outside the top-K: K + 1 distinct entries
        ids += [t] + top
        lps += [-0.5] + [-0.1 * (j + 1) for j in range(k)]
    return Completion(token_ids=tokens, logprobs=Flat(ids, lps), finish_reason=finish)


def test_outputs_to_batch():
    k = 3
    outs = [Request([_completion([5, 6, 7], k), _completion([8], k, "length")]),
            Request([_completion([9, 1], k), _completion([2, 3, 4, 0], k)])]
    b = outputs_to_batch(outs, [[1, 2], [3]], ["a", "b"], k=k, tokenizer=Tok())
    assert b.response_ids.shape == (4, 4) and b.topk_ids.shape == (4, 4, 3)
    assert b.response_mask.sum(1).tolist() == [3, 1, 2, 4]
    assert b.group.tolist() == [0, 0, 1, 1] and b.truncated.tolist() == [False, True, False, False]
    assert b.prompt_ids[2] == [3] and b.answers == ["a", "a", "b", "b"] and b.texts[0] == "567"
    assert b.topk_ids[1, 1:].eq(-1).all() and b.topk_logp[1, 1:].eq(float("-inf")).all()
    assert b.topk_ids[0, 0].tolist() == [6, 7, 8] and b.sampled_logp[0, 0] == -0.5
    with pytest.raises(PDMInputError, match="expected 4 per token"):
        topk_from_flat(Flat([1, 2], [0.0, 0.0]), [1], 3)


def test_request_seed_is_stable():
    assert request_seed(0, "train", 3, 7) == request_seed(0, "train", 3, 7)
    assert request_seed(0, "train", 3, 7) != request_seed(0, "train", 4, 7)
    assert 0 <= request_seed(1, 2) < 2 ** 31


# ---------------------------------------------------------------------------- trainer side

def test_loop_calls_the_core_functions():
    # the loop uses the registry's mask (via pdm_policy_loss) and the core's support/π code
    assert train_step.pdm_policy_loss is pdm_lab.loss.pdm_policy_loss
    assert train_step.support_from_topk is pdm_lab.support.support_from_topk
    assert policy_model.policy_on_support is pdm_lab.policy_side.policy_on_support


VOCAB = 64


@pytest.fixture(scope="module")
def tiny_lm():
    cfg = TinyModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=16,
                          max_position_embeddings=64, init_std=0.5)
    torch.manual_seed(0)
    return build_model(cfg, VOCAB, eos_id=1, pad_id=0)


def fake_batch(lm, n_prompts=2, g=3, k=5, temperature=0.8, seed=0) -> RolloutBatch:
    """A rollout batch whose μ is the model's own distribution (so r = 1 before any update)."""
    gen = torch.Generator().manual_seed(seed)
    prompts, resps = [], []
    for p in range(n_prompts):
        prompt = torch.randint(2, VOCAB, (3 + p,), generator=gen).tolist()
        for _ in range(g):
            resps.append(torch.randint(2, VOCAB, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist())
            prompts.append(prompt)
    n, t = len(resps), max(map(len, resps))
    out = dict(response_ids=torch.zeros(n, t, dtype=torch.long), response_mask=torch.zeros(n, t, dtype=torch.bool),
               sampled_logp=torch.zeros(n, t), topk_ids=torch.full((n, t, k), -1),
               topk_logp=torch.full((n, t, k), float("-inf")))
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(prompts, resps)):
            ids = torch.tensor([p + r])
            lp = torch.log_softmax(lm(input_ids=ids).logits[0].float() / temperature, -1)
            rows = lp[len(p) - 1:len(p) - 1 + len(r)]
            top = torch.topk(rows, k, dim=-1)
            out["response_ids"][i, :len(r)] = torch.tensor(r)
            out["response_mask"][i, :len(r)] = True
            out["sampled_logp"][i, :len(r)] = rows.gather(1, torch.tensor(r)[:, None])[:, 0]
            out["topk_ids"][i, :len(r)] = top.indices
            out["topk_logp"][i, :len(r)] = top.values
    return RolloutBatch(prompt_ids=prompts, group=torch.arange(n) // g, truncated=torch.zeros(n, dtype=torch.bool),
                        texts=[""] * n, answers=[""] * n, **out)


@pytest.mark.parametrize("chunk", [None, 3])
def test_policy_on_support_matches_naive_full_softmax(tiny_lm, chunk):
    temperature = 0.8
    batch = fake_batch(tiny_lm, temperature=temperature)
    mask_cfg = MaskConfig(k=5)
    adv = torch.linspace(-1, 1, len(batch))
    mb = train_step.make_micro_batch(batch, list(range(len(batch))), adv, pad_id=0)
    support = train_step.micro_batch_support(mb, mask_cfg, VOCAB)
    policy = PolicyModel(tiny_lm)
    pi = train_step.micro_batch_policy(policy, mb, support, temperature, chunk)
    # naive: per sequence, full logits → log_softmax(z / T) → gather on the support ids
    resp = mb.response_mask.reshape(-1)
    t_max = mb.response_mask.shape[1]
    for i in range(len(batch)):
        p, n = len(batch.prompt_ids[i]), int(batch.response_mask[i].sum())
        ids = torch.tensor([batch.prompt_ids[i] + batch.response_ids[i, :n].tolist()])
        with torch.no_grad():
            lp = torch.log_softmax(tiny_lm(input_ids=ids).logits[0].float() / temperature, -1)[p - 1:p - 1 + n]
        rows = slice(i * t_max, i * t_max + n)
        sup = support.ids[rows]
        want = lp.gather(1, sup.clamp(min=0)).masked_fill(sup < 0, float("-inf"))
        assert torch.allclose(pi.logp[rows].detach(), want, atol=1e-5, equal_nan=False)
        outside = torch.ones_like(lp, dtype=torch.bool)
        real = sup >= 0
        outside[torch.arange(n)[:, None].expand_as(sup)[real], sup[real]] = False
        assert torch.allclose(pi.tail_logp[rows], torch.logsumexp(lp.masked_fill(~outside, -math.inf), -1), atol=1e-5)
    # μ = π on response rows, so r = 1 and D = 0; padding rows are μ's trivial rows
    out = pdm_lab.loss.pdm_policy_loss(pi, support, mb.advantages, mb.response_mask, mask_cfg)
    assert torch.allclose(out.stats.ratio[resp], torch.ones(int(resp.sum())), atol=1e-4)
    assert out.stats.topk_kl[resp].abs().max() < 1e-5
    for name in ("topk_kl", "ratio", "log_ratio", "mu_tail", "pi_tail"):
        assert torch.isfinite(getattr(out.stats, name)).all(), name
    assert torch.isfinite(out.loss)


def test_chunked_and_unchunked_gradients_agree(tiny_lm):
    batch = fake_batch(tiny_lm, seed=1)
    mask_cfg = MaskConfig(k=5)
    adv = torch.linspace(-1, 1, len(batch))
    mb = train_step.make_micro_batch(batch, list(range(len(batch))), adv, pad_id=0)
    support = train_step.micro_batch_support(mb, mask_cfg, VOCAB)
    grads = []
    for chunk in (None, 2):
        tiny_lm.zero_grad()
        pi = train_step.micro_batch_policy(PolicyModel(tiny_lm), mb, support, 1.0, chunk)
        pdm_lab.loss.pdm_policy_loss(pi, support, mb.advantages, mb.response_mask, mask_cfg).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in tiny_lm.parameters()]))
    assert (grads[0] - grads[1]).abs().max() <= 1e-5 * grads[0].abs().max(), (grads[0] - grads[1]).abs().max()
    assert grads[0].abs().sum() > 0


@dataclasses.dataclass(frozen=True)
class _Rollout:
    temperature: float = 1.0


@dataclasses.dataclass(frozen=True)
class StepCfg:
    """The fields of the run config that ``train_step.update`` reads (also used by test_scaling_coupled)."""
    mask: MaskConfig
    trainer: TrainerConfig
    rollout: _Rollout = _Rollout()


def test_update_goes_through_the_registry_and_raises_good_samples(tiny_lm, monkeypatch):
    lm = build_model(TinyModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=16,
                                     max_position_embeddings=64, init_std=0.5), VOCAB, 1, 0)
    batch = fake_batch(lm, n_prompts=2, g=4, seed=2, temperature=1.0)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 1.0])
    calls = []
    original = pdm_lab.masks.MASK_RULES["pdm_topk"]

    def counting(stats, advantages, cfg):
        calls.append(int(advantages.numel()))
        return original(stats, advantages, cfg)

    monkeypatch.setitem(pdm_lab.masks.MASK_RULES, "pdm_topk", dataclasses.replace(original, drop=counting))
    cfg = StepCfg(mask=MaskConfig(rule="pdm_topk", k=5), trainer=TrainerConfig(mini_batches=2, micro_batch_size=2))
    policy = PolicyModel(lm)

    def seq_logp():
        mb = train_step.make_micro_batch(batch, list(range(len(batch))), adv, 0)
        support = train_step.micro_batch_support(mb, cfg.mask, VOCAB)
        with torch.no_grad():
            pi = train_step.micro_batch_policy(policy, mb, support, 1.0, None)
        lpk = pi.logp.gather(1, support.k_index[:, None])[:, 0].reshape(mb.response_mask.shape)
        return (lpk * mb.response_mask).sum(1)

    before = seq_logp()
    opt = torch.optim.SGD(policy.parameters(), lr=0.05)
    res = train_step.update_policy(policy, opt, batch, adv, cfg=cfg, vocab_size=VOCAB, pad_id=0, lr=0.05)
    change = seq_logp() - before
    assert len(calls) == 4  # 2 mini-batches × 2 micro-batches, each through the registry's rule
    assert change[adv > 0].mean() > change[adv < 0].mean()
    assert res.metrics["mismatch/topk_kl_mean"] < 1e-6  # first mini-batch: μ = π
    assert res.metrics["tokens/response"] == float(batch.response_mask.sum())
    for key in ("mask/frac_dropped", "div/topk_kl_max", "loss/grad_norm", "ratio/max"):
        assert key in res.metrics and math.isfinite(res.metrics[key]), key
    if res.metrics["mask/frac_outside"] == 0:  # no outside token: the disagreement is n/a, never 0.0
        assert math.isnan(res.metrics["mask/dir_disagree"])


def test_split_into_equal_mini_batches():
    assert train_step.split(6, 3) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="do not split"):
        train_step.split(7, 3)


def test_tiny_config_logs_the_direction_metric_of_its_own_rule(tiny_lm):
    """tiny-cpu.yaml trains with pdm_topk: its logged disagreement is the Ḋ_topk one, not Ḋ_uniform's."""
    from pathlib import Path

    from pdm_lab.metrics import direction_disagreement
    from pdm_lab.scaling.config import load_config

    tiny = load_config(Path(__file__).resolve().parents[1] / "scaling" / "configs" / "tiny-cpu.yaml")
    assert tiny.mask.rule == "pdm_topk" and tiny.mask.direction_estimator == "topk"
    mask = dataclasses.replace(tiny.mask, k=5, delta=0.0)  # every token with D > 0 is outside
    batch = fake_batch(tiny_lm, n_prompts=3, g=4, seed=3, temperature=0.5)  # μ at T = 0.5, π at T = 1
    adv = torch.linspace(-1, 1, len(batch))
    mb = train_step.make_micro_batch(batch, list(range(len(batch))), adv, pad_id=0)
    support = train_step.micro_batch_support(mb, mask, VOCAB)
    with torch.no_grad():
        pi = train_step.micro_batch_policy(PolicyModel(tiny_lm), mb, support, 1.0, None)
    stats = pdm_lab.loss.pdm_policy_loss(pi, support, mb.advantages, mb.response_mask, mask).stats
    outside = mb.response_mask.reshape(-1) & (stats.topk_kl > 0)
    rate = {est: float(direction_disagreement(stats, est)[outside].double().mean()) for est in ("topk", "agg")}
    assert rate["topk"] != rate["agg"]  # the batch tells the estimators apart

    def logged(mask_cfg):
        cfg = StepCfg(mask=mask_cfg, trainer=TrainerConfig(mini_batches=1, micro_batch_size=4))
        opt = torch.optim.SGD(PolicyModel(tiny_lm).parameters(), lr=0.0)  # measure only: π stays put
        return train_step.update_policy(PolicyModel(tiny_lm), opt, batch, adv, cfg=cfg, vocab_size=VOCAB,
                                        pad_id=0, lr=0.0).metrics

    res = logged(mask)
    assert res["mask/dir_disagree"] == pytest.approx(rate["topk"], abs=1e-9)
    assert res["mismatch/dir_disagree"] == pytest.approx(rate["topk"], abs=1e-9)
    # an explicit mask.estimator overrides the rule's own
    assert logged(dataclasses.replace(mask, estimator="agg"))["mask/dir_disagree"] == pytest.approx(rate["agg"], abs=1e-9)


def test_bench_rows_without_a_run():
    from pdm_lab.scaling.bench import saved_bytes, step_rows

    recs = [{"step": s, "time/step_s": 1.0, "time/generate_s": 0.3, "time/train_s": 0.5, "time/sync_s": 0.1,
             "time/loss_s": 0.01, "time/reward_s": 0.001} for s in range(1, 5)]
    rows = step_rows(recs)
    assert {r["name"].split(":")[1].split()[0] for r in rows} >= {"generate", "train", "sync", "mask"}
    assert all(set(r) == {"name", "value", "unit", "reference", "ratio", "target"} for r in rows)
    assert rows[-1]["ratio"] == pytest.approx(0.01)
    naive = saved_bytes("naive", 16, 128, 4, 64, None)
    assert saved_bytes("loop", 16, 128, 4, 64, 8) < naive / 4  # chunked recompute keeps no [N, V]
