"""``pdm_kernel`` in the scaling loop (SPEC §6d): the loop's c_t = ⟨W̃ᵀg, W̃ᵀv⟩, computed in π's own
forward from the hidden states and lm_head's weight, equals the core's ``kernel_scores`` on the same
processed logits z = h Wᵀ/T and W̃ = W/T (float64, tied and untied, chunked or not); the update
step applies the rule with it; the config accepts the rule except with a sampling cut; and
``pdm-lab train`` runs it end to end, its live audit comparing it with ``pdm_topk``."""
import copy
import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
import torch

from pdm_lab.config import ConfigError
from pdm_lab.kernel_direction import kernel_scores
from pdm_lab.mask_config import MaskConfig
from pdm_lab.masks import kernel_outward, outside_region
from pdm_lab.scaling import train_step
from pdm_lab.scaling.config import TinyModelConfig, TrainerConfig, load_config
from pdm_lab.scaling.policy_model import PolicyModel
from pdm_lab.scaling.tiny_model import build_model

from test_scaling_units import VOCAB, StepCfg, _Rollout, fake_batch

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "scaling" / "configs" / "tiny-cpu.yaml"


def _lm(tied: bool):
    cfg = TinyModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=16,
                          max_position_embeddings=64, init_std=0.5, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return build_model(cfg, VOCAB, eos_id=1, pad_id=0)


def _reference_logits(lm, batch, mb) -> torch.Tensor:
    """[n, V] the response tokens' logits from the HF model's own full forward, one sequence at a
    time, in the micro-batch's row order (row-major over [b, T])."""
    rows = []
    for i in range(len(batch)):
        p, n = len(batch.prompt_ids[i]), int(batch.response_mask[i].sum())
        ids = torch.tensor([batch.prompt_ids[i] + batch.response_ids[i, :n].tolist()])
        with torch.no_grad():
            rows.append(lm(input_ids=ids).logits[0, p - 1:p - 1 + n])
    return torch.cat(rows)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk_tokens", [None, 2])
def test_loop_c_equals_kernel_scores_on_the_same_logits_and_weight(tied, chunk_tokens, monkeypatch):
    """float64 model: the loop's c (in the training forward, through ``on_head``) equals
    ``kernel_scores(z, W/T, support)`` with z the HF model's own logits / T; padding rows 0; the
    same c when the rows are processed three at a time."""
    lm = _lm(tied).double()
    assert (lm.lm_head.weight is lm.model.embed_tokens.weight) == tied
    temperature = 0.7
    batch = fake_batch(lm, n_prompts=2, g=3, seed=2, temperature=0.6)
    adv = torch.linspace(-1, 1, len(batch))
    mb = train_step.make_micro_batch(batch, list(range(len(batch))), adv, pad_id=0)
    support = train_step.micro_batch_support(mb, MaskConfig(k=5), VOCAB)
    policy = PolicyModel(lm)
    pi, c = train_step.micro_batch_policy_kernel(policy, mb, support, temperature, chunk_tokens)
    resp = mb.response_mask.reshape(-1)
    valid = resp.nonzero(as_tuple=True)[0]
    assert c.dtype == torch.float64 and c.shape == resp.shape
    assert torch.equal(c[~resp], torch.zeros(int((~resp).sum()), dtype=torch.float64))
    z = _reference_logits(lm, batch, mb) / temperature
    want = kernel_scores(z, lm.lm_head.weight.detach() / temperature, support.take_rows(valid))
    assert want.abs().max() > 1e-3  # a real signal, not zeros on both sides
    torch.testing.assert_close(c[valid], want, rtol=1e-9, atol=1e-12)
    # π of the same forward is micro_batch_policy's
    torch.testing.assert_close(pi.logp, train_step.micro_batch_policy(policy, mb, support, temperature, chunk_tokens).logp)
    monkeypatch.setattr(train_step, "KERNEL_CHUNK_ELEMENTS", 3 * VOCAB)  # three rows per chunk
    _, c3 = train_step.micro_batch_policy_kernel(policy, mb, support, temperature, chunk_tokens)
    torch.testing.assert_close(c3, c, rtol=1e-12, atol=1e-15)


def test_head_kernel_scores_is_kernel_scores_of_h_w_over_t():
    """The chunked helper on its own: any chunk size gives kernel_scores(h Wᵀ/T, W/T)."""
    gen = torch.Generator().manual_seed(0)
    n, d, vocab, t = 7, 6, 11, 1.3
    h = torch.randn(n, d, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, d, generator=gen, dtype=torch.float64)
    logp = torch.log_softmax(torch.randn(n, vocab, generator=gen, dtype=torch.float64), -1)
    sampled = torch.randint(0, vocab, (n,), generator=gen)
    top = torch.topk(logp, 3, dim=-1)
    from pdm_lab.support import support_from_topk

    support = support_from_topk(top.indices, top.values.float(), sampled, logp.gather(1, sampled[:, None])[:, 0].float(),
                                vocab_size=vocab, k=3)
    want = kernel_scores(h @ w.t() / t, w / t, support)
    for chunk in (1, vocab, 2 * vocab + 1, None):
        got = train_step.head_kernel_scores(h, w, support, t, chunk_elements=chunk)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    assert train_step.head_kernel_scores(h[:0], w, support.take_rows(slice(0, 0)), t).shape == (0,)


SEED = 6  # a batch where λ = 3 flips one of pdm_topk's decisions (on most, c has Ḋ_topk's sign)


def _capture_update(lm, mask, seed=SEED):
    batch = fake_batch(lm, n_prompts=2, g=4, seed=seed, temperature=0.6)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, -1.0, 1.0, -0.3, 0.3])
    policy = PolicyModel(copy.deepcopy(lm))
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    cfg = StepCfg(mask=mask, trainer=TrainerConfig(mini_batches=1, micro_batch_size=4), rollout=_Rollout(0.9))
    outs = []
    res = train_step.update_policy(policy, opt, batch, adv, cfg=cfg, vocab_size=VOCAB, pad_id=0, lr=1e-3,
                                   on_loss=lambda _m, _i, out: outs.append(out))
    return res, outs


def test_update_with_pdm_kernel_applies_the_rule_with_the_loops_c():
    """``update_policy`` with ``pdm_kernel``: every micro-batch's stats carry c, the keep mask is the
    rule's on them (D > δ ∧ Â·(Ḋ_topk + λ c) > 0 dropped), λ = 0 gives ``pdm_topk``'s keep, and
    the mask drops tokens."""
    lm = _lm(True)
    base = MaskConfig(rule="pdm_kernel", k=5, delta=0.02, kernel_ratio=3.0)
    res, outs = _capture_update(lm, base)
    assert 0 < res.metrics["mask/frac_dropped"] < 1
    for out in outs:
        assert out.stats.kernel is not None and out.stats.kernel.abs().max() > 0
    _, zero = _capture_update(lm, dataclasses.replace(base, kernel_ratio=0.0))
    _, topk = _capture_update(lm, dataclasses.replace(base, rule="pdm_topk"))
    for a, b in zip(zero, topk):
        assert torch.equal(a.keep, b.keep)
    # the rule read the loop's c: recompute its drops from the recorded stats
    batch = fake_batch(lm, n_prompts=2, g=4, seed=SEED, temperature=0.6)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, -1.0, 1.0, -0.3, 0.3])
    for out, rows in zip(outs, ([0, 1, 2, 3], [4, 5, 6, 7])):
        mb = train_step.make_micro_batch(batch, rows, adv, pad_id=0)
        a = mb.advantages.reshape(-1).to(out.stats.ratio.dtype) * mb.response_mask.reshape(-1)
        drop = outside_region(out.stats.topk_kl, a, base) & kernel_outward(out.stats, a, base.kernel_ratio)
        drop &= mb.response_mask.reshape(-1)
        assert torch.equal(out.keep.reshape(-1) == 0, drop)
    assert any(bool((o.keep == 0).any()) for o in outs)
    assert not all(torch.equal(a.keep, b.keep) for a, b in zip(outs, topk))  # λ = 3 changes some decision


def test_the_loop_accepts_pdm_kernel_and_refuses_it_with_a_sampling_cut():
    cfg = load_config(TINY, ["mask.rule=pdm_kernel", "mask.kernel_ratio=3.0"])
    assert cfg.mask.rule == "pdm_kernel" and cfg.mask.kernel_ratio == 3.0
    cfg = load_config(TINY, ["audit.every=1", "audit.rules=[pdm_topk,pdm_kernel]"])
    assert cfg.audit.rules == ("pdm_topk", "pdm_kernel")
    with pytest.raises(ConfigError, match=r"^rollout\.keep_sampling_mask: mask\.rule 'pdm_kernel'") as err:
        load_config(TINY, ["mask.rule=pdm_kernel", "rollout.top_p=0.9"])
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"^rollout\.keep_sampling_mask: audit\.rules\[1\] 'pdm_kernel'"):
        load_config(TINY, ["audit.every=1", "audit.rules=[pdm_topk,pdm_kernel]", "rollout.top_k=50"])
    load_config(TINY, ["mask.rule=pdm_kernel", "rollout.top_p=0.9", "rollout.keep_sampling_mask=false"])
    load_config(TINY, ["audit.rules=[pdm_topk,pdm_kernel]", "rollout.top_k=50"])  # audit off: not run


def test_the_loss_path_refuses_pdm_kernel_over_a_sampling_set():
    from pdm_lab.errors import PDMInputError
    from pdm_lab.sampling_mask import SamplingMask

    lm = _lm(True)
    batch = fake_batch(lm, n_prompts=1, g=2, seed=1)
    mb = train_step.make_micro_batch(batch, [0, 1], torch.tensor([1.0, -1.0]), pad_id=0)
    with pytest.raises(PDMInputError, match="pdm_kernel.*sampling set"):
        train_step.micro_batch_loss(PolicyModel(lm), mb, MaskConfig(rule="pdm_kernel", k=5), vocab_size=VOCAB,
                                    temperature=1.0, chunk_tokens=None, sampling=SamplingMask(top_p=0.9))


def test_live_audit_compares_pdm_kernel_on_one_rank():
    """The loop's live audit with ``pdm_kernel`` among its rules: its step goes through the loss path
    that supplies c, its record has the pair and the dropped-outside entries, the probe scores its
    sign (with the run's λ, ``mask.kernel_ratio``) and the decomposition covers it."""
    from pdm_lab.scaling import audit_step
    from pdm_lab.scaling.config import AuditConfig

    from test_scaling_audit import ADV, Cfg

    lm = _lm(True)
    batch = fake_batch(lm, n_prompts=2, g=4, seed=SEED, temperature=0.6)
    cfg = Cfg(mask=MaskConfig(rule="pdm_topk", k=5, delta=0.02, kernel_ratio=3.0),
              trainer=TrainerConfig(mini_batches=1, micro_batch_size=4, grad_clip=1.0),
              audit=AuditConfig(every=1, rules=("pdm_topk", "pdm_kernel"), delta=0.02, probe_tokens=4,
                                step_scales=(1.0,)))
    policy = PolicyModel(copy.deepcopy(lm))
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    record = audit_step.audit_live_batch(policy, opt, batch, ADV, cfg=cfg, vocab_size=VOCAB, pad_id=0, lr=1e-2)
    assert record["rules"] == ["pdm_topk", "pdm_kernel"] and record["outside"] > 0
    pair = record["pairs"]["pdm_topk|pdm_kernel"]
    assert pair["pdm_kernel"]["topk_kl"] is not None and pair["pdm_kernel"]["full_kl"] is None
    dropped = record["dropped_outside"]["pdm_kernel"]["topk_kl"]
    assert dropped["count"] == dropped["grew"] + dropped["shrank"] + dropped["flat_count"] > 0
    assert record["probe"]["probe/tokens"] == 4 and "probe/agree/pdm_kernel/outside/topk_kl" in record["probe"]
    assert set(record["decomposition"]) == {"pdm_topk", "pdm_kernel"}


# ------------------------------------------------------------------ 2 FSDP2 ranks: c from the gathered weight
def _fsdp_worker(rank: int, world: int, store: str, tied: bool, queue) -> None:
    import torch.distributed as dist

    from pdm_lab.scaling.policy_model import shard_policy

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        lm = _lm(tied)
        ref = PolicyModel(copy.deepcopy(lm))
        batch = fake_batch(lm, n_prompts=2, g=3, seed=7 + rank, temperature=0.6)  # each rank its own batch
        adv = torch.linspace(-1, 1, len(batch))
        mb = train_step.make_micro_batch(batch, list(range(len(batch))), adv, pad_id=0)
        support = train_step.micro_batch_support(mb, MaskConfig(k=5), VOCAB)
        policy = shard_policy(lm, param_dtype="fp32", reduce_dtype="fp32", gradient_checkpointing=False)
        sharded = hasattr(policy.lm.lm_head.weight, "full_tensor")  # a DTensor shard outside the forward
        pi, c = train_step.micro_batch_policy_kernel(policy, mb, support, 0.8, None)
        pi.logp[torch.isfinite(pi.logp)].sum().backward()  # the training forward's backward, as in a step
        _, want = train_step.micro_batch_policy_kernel(ref, mb, support, 0.8, None)
        err = float((c - want).abs().max() / want.abs().max())
        cfg = StepCfg(mask=MaskConfig(rule="pdm_kernel", k=5, delta=0.02, kernel_ratio=3.0),
                      trainer=TrainerConfig(mini_batches=1, micro_batch_size=3), rollout=_Rollout(0.8))
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        res = train_step.update_policy(policy, opt, batch, adv, cfg=cfg, vocab_size=VOCAB, pad_id=0, lr=1e-3)
        queue.put((rank, sharded, err, res.metrics["mask/frac_dropped"]))
    except BaseException as e:  # reported, not left for the parent's timeout
        queue.put((rank, f"{type(e).__name__}: {e}", None, None))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tied", [True, pytest.param(False, marks=pytest.mark.extended)])
def test_two_rank_fsdp2_c_equals_the_unsharded_models(tmp_path, tied):
    """Under FSDP2 (2 gloo ranks, lm_head a DTensor shard between forwards) the c computed inside
    the forward from the gathered weight equals an unsharded copy's, and a ``pdm_kernel`` update
    runs on every rank."""
    from loop_helpers import run_ranks

    results = run_ranks(_fsdp_worker, str(tmp_path / "store"), tied)
    for rank, sharded, err, dropped in results:
        assert err is not None, (rank, sharded)  # the worker's exception
        assert sharded is True, rank
        assert err < 1e-5, (rank, err)
        assert 0 <= dropped < 1


# ------------------------------------------------------------------ the loop, as a user runs it
@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.vllm
def test_tiny_loop_trains_with_pdm_kernel_and_audits_it(tmp_path):
    """Two steps of ``pdm-lab train`` on the tiny config (one rank, fp8 rollout so that μ ≠ π, δ
    below the mismatch) with ``mask.rule=pdm_kernel``: the run finishes, the rule drops tokens, and
    the live audit compares ``pdm_topk`` with ``pdm_kernel`` (its record keys, the probe scoring it)."""
    from loop_helpers import tiny_loop

    run_dir = tmp_path / "run"
    cmd, env = tiny_loop(tmp_path, "rollout.prompts_per_step=8", "rollout.group_size=4", "trainer.mini_batches=1",
                         "trainer.micro_batch_size=8", "log.tensorboard=false", "launch.nproc_per_node=1",
                         "mask.rule=pdm_kernel", "mask.kernel_ratio=3.0", "mask.delta=1e-5", "audit.every=1",
                         "audit.delta=1e-5", "audit.rules=[pdm_topk,pdm_kernel]", "audit.probe_tokens=8",
                         "audit.step_scales=[1.0]")
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["step"] > 0]
    assert [r["step"] for r in train] == [1, 2]
    assert sum(r["mask/frac_dropped"] for r in train) > 0  # the rule's mask is active
    for r in train:
        assert 0 <= r["mask/frac_dropped"] < 1
    lines = [json.loads(x) for x in (run_dir / "audit.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        assert r["rules"] == ["pdm_topk", "pdm_kernel"] and r["outside"] > 0
        pair = r["pairs"]["pdm_topk|pdm_kernel"]
        assert set(pair) == {"disagreement", "pdm_topk", "pdm_kernel"}
        assert set(pair["pdm_kernel"]) == {"topk_kl", "full_kl"} and pair["pdm_kernel"]["topk_kl"] is not None
        dropped = r["dropped_outside"]["pdm_kernel"]["topk_kl"]
        assert dropped["count"] == dropped["grew"] + dropped["shrank"] + dropped["flat_count"] > 0
        assert "pdm_kernel" in r["decomposition"]
    probes = [r["probe"] for r in lines if r["probe"]]
    assert probes and any("probe/agree/pdm_kernel/outside/topk_kl" in p for p in probes)
    print("pdm_topk|pdm_kernel disagreement per step:",
          [r["pairs"]["pdm_topk|pdm_kernel"]["disagreement"] for r in lines])
