"""The direction audit on the scaling loop's live batch (SPEC §6c, ``scaling/audit_step.py``).

* on 2 FSDP2 ranks (gloo) with AdamW state from two real updates and a forward with no backward
  after them (the root stays gathered), the audit's steps leave the parameters and the optimiser
  state bit-identical; a planted bug (restoring only the parameters) is caught; untied fp32 and
  tied bf16-compute models;
* each rule's ΔD equals that of a fresh copy stepped alone with that rule (rules are independent:
  a snapshot restored between them), and a planted bug (the optimiser state leaking from one
  rule's step into the next) is caught; a fresh AdamW (no state yet) is fresh again afterwards;
* ``pdm-lab train --config tiny-cpu.yaml audit.every=1`` (fp8 rollout, one rank) writes
  audit.jsonl with per-rule rates and logs ``time/audit_s``; δ = 1e-5, since the tiny model's fp8
  mismatch stays far below the paper's δ (D ≈ 1e-4, max ~1e-3);
* the same at two ranks (FSDP2 + an engine per rank), two steps: it runs, and the snapshot holds
  every shard's AdamW moments.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdm_lab.mask_config import MaskConfig
from pdm_lab.scaling import audit_step, train_step
from pdm_lab.scaling.config import AuditConfig, TinyModelConfig, TrainerConfig, load_config
from pdm_lab.scaling.policy_model import PolicyModel
from pdm_lab.scaling.tiny_model import build_model

from test_scaling_units import VOCAB, fake_batch

REPO = Path(__file__).resolve().parents[1]
ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, -1.0, 1.0, -0.3, 0.3])


@dataclasses.dataclass(frozen=True)
class _Rollout:
    temperature: float = 1.0


@dataclasses.dataclass(frozen=True)
class Cfg:
    """The run-config fields the audit and ``update_policy`` read."""
    mask: MaskConfig
    trainer: TrainerConfig
    audit: AuditConfig
    rollout: _Rollout = _Rollout()


def _cfg(rules=("dppo_topk_kl", "pdm_topk"), param_dtype="fp32", probe_tokens=0, step_scales=(1.0,)) -> Cfg:
    return Cfg(mask=MaskConfig(rule="pdm_topk", k=5, delta=0.02),
               trainer=TrainerConfig(mini_batches=2, micro_batch_size=2, param_dtype=param_dtype, grad_clip=1.0),
               audit=AuditConfig(every=1, rules=rules, delta=0.02, probe_tokens=probe_tokens, step_scales=step_scales))


def _lm(tied: bool):
    return build_model(TinyModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=16,
                                       max_position_embeddings=64, init_std=0.5, tie_word_embeddings=tied),
                       VOCAB, eos_id=1, pad_id=0)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _state_copy(policy, opt):
    """The optimiser's own parameters (FSDP2: the shards; ``policy.parameters()`` yields the root's
    gathered copies after a forward with no backward) and their state."""
    held = [p for g in opt.param_groups for p in g["params"]]
    params = [_local(p).detach().clone() for p in held]
    state = [{k: (_local(v).clone() if torch.is_tensor(v) else v) for k, v in opt.state.get(p, {}).items()}
             for p in held]
    return params, state, [g["lr"] for g in opt.param_groups]


def _identical(a, b) -> dict:
    (pa, sa, la), (pb, sb, lb) = a, b
    same_state = all(x.keys() == y.keys() and all(
        torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x) for x, y in zip(sa, sb))
    return {"params": all(torch.equal(x, y) for x, y in zip(pa, pb)), "state": same_state and la == lb}


# ------------------------------------------------------------------ 2 FSDP2 ranks, bit-exact restore
def _fsdp_worker(rank: int, world: int, store: str, tied: bool, param_dtype: str, queue) -> None:
    import torch.distributed as dist

    from pdm_lab.audit import snapshot as host_snapshot
    from pdm_lab.scaling.policy_model import sequence_logprobs, shard_policy

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        lm = _lm(tied)
        batch = fake_batch(lm, n_prompts=2, g=4, seed=4 + rank, temperature=0.6)  # each rank its own batch
        policy = shard_policy(lm, param_dtype=param_dtype, reduce_dtype="fp32", gradient_checkpointing=False)
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
        cfg = _cfg(param_dtype=param_dtype, probe_tokens=4, step_scales=(1.0, 0.1))
        for _ in range(2):  # AdamW state from two real updates (4 optimiser steps)
            train_step.update_policy(policy, opt, batch, ADV, cfg=cfg, vocab_size=VOCAB, pad_id=0, lr=1e-2)
        # a forward with no backward after it, as the loop's weight-sync check runs before step 1:
        # FSDP2's root stays gathered, and the audit must still snapshot and restore the shards
        sequence_logprobs(policy, [2, 5, 7, 9, 3])
        ref = _state_copy(policy, opt)
        record = audit_step.audit_live_batch(policy, opt, batch, ADV, cfg=cfg, vocab_size=VOCAB, pad_id=0, lr=3e-2)
        ok = _identical(ref, _state_copy(policy, opt))
        # the planted bug: the optimiser state is not restored (parameters only)
        host_snapshot.restore_optimizer = lambda *args: None
        audit_step.audit_live_batch(policy, opt, batch, ADV, cfg=cfg, vocab_size=VOCAB, pad_id=0, lr=3e-2)
        planted = _identical(ref, _state_copy(policy, opt))
        queue.put((rank, ok, planted, record))
    except BaseException as err:  # reported, not left for the parent's timeout
        queue.put((rank, f"{type(err).__name__}: {err}", None, None))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tied,param_dtype", [(False, "fp32"), pytest.param(True, "bf16", marks=pytest.mark.extended)])
def test_two_rank_fsdp2_audit_restores_parameters_and_adamw_state_bit_exactly(tmp_path, tied, param_dtype):
    from loop_helpers import run_ranks

    results = run_ranks(_fsdp_worker, str(tmp_path / "store"), tied, param_dtype)
    for rank, ok, planted, record in results:
        assert planted is not None, (rank, ok)  # the worker's exception
        assert ok == {"params": True, "state": True}, (rank, ok)
        assert planted == {"params": True, "state": False}, (rank, planted)  # the planted bug is caught
    record = results[0][3]
    assert record == results[1][3] | {k: record[k] for k in ("host_snapshot_bytes", "time/probe_s")}  # merged: same on every rank
    assert record["ranks"] == 2 and record["outside"] > 0
    pair = record["pairs"]["dppo_topk_kl|pdm_topk"]
    for rule in ("dppo_topk_kl", "pdm_topk"):
        assert pair[rule]["full_kl"] is None  # not measurable from μ's top-K
        assert pair[rule]["topk_kl"]["count"] == pair[rule]["topk_kl"]["grew"] + pair[rule]["topk_kl"]["shrank"] + \
            pair[rule]["topk_kl"]["flat_count"]
    assert pair["disagreement"] == pair["dppo_topk_kl"]["topk_kl"]["count"] + pair["pdm_topk"]["topk_kl"]["count"]
    assert record["regime"]["outside_tokens"] == record["outside"]
    # the probe and the decomposition (SPEC §6d) under the core's keys, pooled over both ranks
    assert record["probe"]["probe/tokens"] == 4 and "probe/agree/pdm_topk/outside/topk_kl" in record["probe"]
    assert set(record["step_scales"]) == {"1", "0.1"}
    for scale in record["step_scales"].values():
        assert {"steps/unsafe_keep/pdm_topk", "steps/control/kept_by_all", "steps/control/momentum_only",
                "steps/median_abs_dd_over_d"} <= set(scale)
    assert set(record["decomposition"]) == {"dppo_topk_kl", "pdm_topk"}


# ------------------------------------------------------------------ one rank: rules independent, ΔD real
@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    lm = _lm(tied=False)
    batch = fake_batch(lm, n_prompts=2, g=4, seed=4, temperature=0.6)
    return lm, batch


def _stepped(lm, batch, cfg, steps=1):
    model = copy.deepcopy(lm)
    policy = PolicyModel(model)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    for _ in range(steps):
        train_step.update_policy(policy, opt, batch, ADV, cfg=cfg, vocab_size=VOCAB, pad_id=0, lr=1e-2)
    return policy, opt


def _alone(policy, opt, batch, cfg, rule, lr):
    """ΔD of one rule's step from a copy of (policy, opt), stepped with nothing else before it."""
    p2 = copy.deepcopy(policy)
    o2 = torch.optim.AdamW(p2.parameters(), lr=1e-2)
    o2.load_state_dict(copy.deepcopy(opt.state_dict()))
    micros = audit_step._micro_batches(batch, ADV, 0, cfg.trainer.micro_batch_size, None)
    d = lambda: torch.cat([audit_step.measured_divergence(p2, mb, cfg.mask, VOCAB, 1.0, None) for mb in micros])  # noqa: E731
    before = d()
    run = dataclasses.replace(cfg, mask=audit_step.rule_mask_config(cfg.mask, rule, 0.02),
                              trainer=dataclasses.replace(cfg.trainer, mini_batches=1))
    train_step.update_policy(p2, o2, batch, ADV, cfg=run, vocab_size=VOCAB, pad_id=0, lr=lr)
    return d() - before


def _audit_counts(record, rule, pair="none|dppo_topk_kl"):
    return record["pairs"][pair][rule]["topk_kl"]


def test_each_rules_delta_d_equals_a_fresh_copy_stepped_alone(setup, monkeypatch):
    from pdm_lab.audit import live as audit_live
    from pdm_lab.audit import snapshot as host_snapshot

    lm, batch = setup
    cfg = _cfg(rules=("none", "dppo_topk_kl", "pdm_topk"))
    policy, opt = _stepped(lm, batch, cfg)
    expected = {rule: _alone(policy, opt, batch, cfg, rule, 3e-2) for rule in cfg.audit.rules}
    seen = {}
    real = audit_live.step_record

    def spy(rules, keep, delta_d, outside, tol):
        seen.update({r: delta_d[r]["topk_kl"].clone() for r in rules}, outside=outside.clone(), keep=keep)
        return real(rules, keep, delta_d, outside, tol)

    monkeypatch.setattr(audit_live, "step_record", spy)
    ref = _state_copy(policy, opt)
    record = audit_step.audit_live_batch(policy, opt, batch, ADV, cfg=cfg, vocab_size=VOCAB, pad_id=0, lr=3e-2)
    assert _identical(ref, _state_copy(policy, opt)) == {"params": True, "state": True}
    out = seen["outside"]
    assert out.sum() >= 3
    for rule in cfg.audit.rules:
        assert torch.equal(seen[rule][out], expected[rule][out]), rule
        assert seen[rule][out].abs().max() > 1e-6  # the step moved D: ΔD measured after it, not after the restore
    assert seen["keep"]["none"].all() and not seen["keep"]["pdm_topk"][out].all()
    assert record["outside"] == int(out.sum())
    # rates: the kept disagreement tokens of each rule, classified by the sign of ΔD
    dis = out & (seen["keep"]["none"] != seen["keep"]["dppo_topk_kl"])
    kept = dis & seen["keep"]["none"]
    counts = _audit_counts(record, "none")
    assert counts["count"] == int(kept.sum()) and counts["grew"] == int((seen["none"][kept] > 1e-9).sum())
    dropped = record["dropped_outside"]["pdm_topk"]["topk_kl"]
    assert dropped["count"] == int((out & ~seen["keep"]["pdm_topk"]).sum())
    # the per-token rows (SPEC §6d's selection controls re-score them): every outside token once, its
    # sampled id, and each rule's keep and ΔD as measured
    (rows,) = record["outside_tokens"]
    idx = out.nonzero(as_tuple=True)[0]
    assert rows["index"] == idx.tolist() and len(rows["momentum_dd"]) == len(idx)
    sampled = batch.response_ids[torch.tensor(rows["seq"]), torch.tensor(rows["col"])]
    assert rows["token_id"] == sampled.tolist()
    for rule in cfg.audit.rules:
        assert rows["dd"][rule] == seen[rule][idx].tolist() and rows["keep"][rule] == seen["keep"][rule][idx].tolist()

    # the planted bug: AdamW's state not restored between the rules → later rules' ΔD differ
    monkeypatch.setattr(host_snapshot, "restore_optimizer", lambda *args: None)
    policy, opt = _stepped(lm, batch, cfg)
    audit_step.audit_live_batch(policy, opt, batch, ADV, cfg=cfg, vocab_size=VOCAB, pad_id=0, lr=3e-2)
    assert not torch.equal(seen["pdm_topk"][out], expected["pdm_topk"][out])


def test_a_fresh_adamw_is_fresh_again_after_the_audit(setup):
    lm, batch = setup
    cfg = _cfg()
    policy = PolicyModel(copy.deepcopy(lm))
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in policy.parameters()]
    audit_step.audit_live_batch(policy, opt, batch, ADV, cfg=cfg, vocab_size=VOCAB, pad_id=0, lr=1e-2)
    assert len(opt.state) == 0  # the next real step is AdamW's first, as without the audit
    assert all(torch.equal(p, b) and p.grad is None for p, b in zip(policy.parameters(), before))


def test_audit_section_is_off_by_default_and_validated():
    cfg = load_config(REPO / "scaling" / "configs" / "tiny-cpu.yaml")
    assert cfg.audit.every == 0
    from pdm_lab.config import ConfigError

    with pytest.raises(ConfigError, match=r"audit.rules\[1\].*pdm_topk"):
        load_config(REPO / "scaling" / "configs" / "tiny-cpu.yaml", ["audit.rules=[dppo_topk_kl,pdm_topkk]"])
    with pytest.raises(ConfigError, match="at least two"):
        load_config(REPO / "scaling" / "configs" / "tiny-cpu.yaml", ["audit.rules=[pdm_topk]"])
    assert audit_step.host_bytes(10, 4) == 36  # fp32 weight + two AdamW moments of ⌈10/4⌉ parameters


# ------------------------------------------------------------------ the loop, as a user runs it
@pytest.mark.slow
@pytest.mark.vllm
def test_train_with_audit_writes_audit_jsonl(tmp_path):
    run_dir = tmp_path / "run"
    (tmp_path / "plugin.py").write_text("def parity(response, answer):\n    return float(len(response) % 2)\n")
    cmd = [sys.executable, "-m", "pdm_lab", "train", "--config", str(REPO / "scaling" / "configs" / "tiny-cpu.yaml"),
           "total_steps=2", "model.tiny.sft_steps=60", "rollout.prompts_per_step=8", "rollout.group_size=4",
           "rollout.max_tokens=6", "rollout.precision=fp8", "rollout.fp8_block=32", "trainer.micro_batch_size=8",
           "eval.every=0", "checkpoint.every=0", "log.sync_check_every=0", "audit.every=1", "audit.delta=1e-5",
           "audit.rules=[dppo_topk_kl,pdm_topk,pdm_uniform]", "data.synthetic.n_train=400", f"run_dir={run_dir}",
           f"plugins=[{tmp_path / 'plugin.py'}]", "reward.verifier=pdm_lab_plugin_plugin:parity"]
    env = dict(os.environ, PDM_LAB_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    lines = [json.loads(x) for x in (run_dir / "audit.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        assert r["rules"] == ["dppo_topk_kl", "pdm_topk", "pdm_uniform"] and r["delta"] == 1e-5 and r["k"] == 20
        assert r["outside"] > 0 and r["tokens"] > r["outside"]
        assert set(r["pairs"]) == {"dppo_topk_kl|pdm_topk", "dppo_topk_kl|pdm_uniform"}
        assert r["regime"]["outside_tokens"] == r["outside"]
        assert r["host_snapshot_bytes"] > 0
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["step"] > 0]
    for r in train:
        assert 0 < r["time/audit_s"] < r["time/step_s"]
        assert r["audit/outside"] > 0
        assert "audit/dppo_topk_kl|pdm_topk/disagreement" in r
    for r in lines:  # the interference line: each rule's dropped outside tokens, counted
        dropped = r["dropped_outside"]["pdm_topk"]["topk_kl"]
        assert dropped["count"] == dropped["grew"] + dropped["shrank"] + dropped["flat_count"]
    # what moved the divergence, from the same run's probe, decomposition and step sizes
    out = tmp_path / "mechanism"
    proc = subprocess.run([sys.executable, "-m", "pdm_lab", "mechanism", str(run_dir), "--out", str(out)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    doc = json.loads((out / "mechanism.json").read_text())
    assert doc["audited_steps"] == 2 and doc["probe"]["probe/tokens"] > 0
    assert "probe/agree/pdm_topk/outside/topk_kl" in doc["probe"] and "probe/data" not in doc["probe"]
    assert set(doc["step_scales"]) == {"1", "0.1", "0.01"}
    assert doc["step_scales"]["1"]["dppo_topk_kl"]["n"] >= 0 and doc["decomposition"]["dppo_topk_kl"] is not None
    md = (out / "mechanism.md").read_text()
    assert "## The own-update probe" in md and "## Unsafe-keep across step sizes" in md
    assert (out / "mechanism_step_sizes.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.vllm
def test_two_rank_train_with_audit_runs_and_snapshots_every_shard(tmp_path):
    """Two FSDP2 ranks with their vLLM engines and the audit on, two steps. The weight-sync check
    before step 1 is a forward with no backward, which leaves FSDP2's root gathered: a snapshot of
    ``policy.parameters()`` then held the gathered copies, and restoring it wrote into storage the
    measurement's reshard had freed (SIGSEGV in a float32 ``copy_`` on both ranks before step 1),
    while the root's AdamW state (keyed by the shards) was not snapshotted at all."""
    from loop_helpers import tiny_loop

    run_dir = tmp_path / "run"
    cmd, env = tiny_loop(tmp_path, "launch.nproc_per_node=2", "rollout.prompts_per_step=4", "rollout.group_size=4",
                         "trainer.mini_batches=1", "trainer.micro_batch_size=8", "log.tensorboard=false",
                         "audit.every=1", "audit.delta=1e-5", "audit.probe_tokens=8", "audit.step_scales=[1.0]")
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    lines = [json.loads(x) for x in (run_dir / "audit.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        assert r["ranks"] == 2 and r["outside"] > 0 and r["probe"]["probe/tokens"] > 0
    # step 1 (a fresh AdamW): the shards alone; step 2: the shards and both moments of every one of
    # them (the root's embedding and norm included, whose state is keyed by their shards)
    first, second = (r["host_snapshot_bytes"] for r in lines)
    assert second >= 3 * first
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()][-2:] == [1, 2]


@dataclasses.dataclass(frozen=True)
class _CutRollout:
    temperature: float = 1.0
    sampling_mask: object = None


def test_the_audits_d_is_the_losss_d_under_the_engines_sampling_cut(setup):
    """With the sampling mask kept, the loss thresholds D on π over the engine's sampling set
    (SPEC §1); the audit's measured D is the same quantity, not the full softmax's."""
    from pdm_lab.sampling_mask import SamplingMask

    lm, batch = setup
    cut = SamplingMask(top_p=0.9)
    cfg = dataclasses.replace(_cfg(), rollout=_CutRollout(sampling_mask=cut))
    policy = PolicyModel(copy.deepcopy(lm))
    seen = []
    run = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, mini_batches=1))
    train_step.update_policy(policy, torch.optim.SGD(policy.parameters(), lr=0.0), batch, ADV, cfg=run,
                             vocab_size=VOCAB, pad_id=0, lr=0.0,
                             on_loss=lambda _m, _i, out: seen.append(out))
    micros = audit_step._micro_batches(batch, ADV, 0, cfg.trainer.micro_batch_size, None)
    loss_d = torch.cat([o.stats.topk_kl[mb.response_mask.reshape(-1)].double() for o, mb in zip(seen, micros)])
    audit_d = torch.cat([audit_step.measured_divergence(policy, mb, cfg.mask, VOCAB, 1.0, None, cut) for mb in micros])
    full_d = torch.cat([audit_step.measured_divergence(policy, mb, cfg.mask, VOCAB, 1.0, None) for mb in micros])
    assert torch.allclose(audit_d, loss_d, rtol=1e-4, atol=1e-6), (audit_d - loss_d).abs().max()
    assert (full_d - loss_d).abs().max() > 1e-3  # the full softmax's D is another quantity: the check can fail
