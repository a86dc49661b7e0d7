"""Non-finite steps in the scaling loop: a loss or gradient that goes NaN/inf is never
stepped on, is logged and summarised, and stops the run after ``trainer.max_nonfinite_steps``
consecutive steps with exit status 3 and one line, never a traceback or exit 70.

* ``update_policy`` in one process: an overflowing loss, an overflowing gradient norm (with and
  without clipping) skip exactly the mini-batches they occur in, leave the weights and AdamW
  state untouched, and flag ``train/nonfinite``; a caller reading every micro-batch's output
  (the audit) gets ``NonFiniteUpdate``;
* ``pdm-lab train`` on the tiny CPU config with a plugin verifier whose rewards explode at chosen
  steps (Dr. GRPO advantages, ``algo.norm_by_std=false``, carry the reward's scale into the loss):
  step 2 skipped, a reward beyond float32 at step 3 skipped as a sample, steps 4-6 non-finite → stop
  at step 6 with exit 3; metrics, summary.json and the checkpoints' weights checked.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdm_lab.mask_config import MaskConfig
from pdm_lab.scaling import train_step
from pdm_lab.scaling.config import TinyModelConfig, TrainerConfig
from pdm_lab.scaling.policy_model import PolicyModel
from pdm_lab.scaling.tiny_model import build_model

from test_scaling_units import VOCAB, fake_batch

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class _Rollout:
    temperature: float = 1.0


@dataclasses.dataclass(frozen=True)
class Cfg:
    mask: MaskConfig
    trainer: TrainerConfig
    rollout: _Rollout = _Rollout()


def _setup(grad_clip=1.0, mini_batches=2):
    torch.manual_seed(0)
    lm = build_model(TinyModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=16,
                                     max_position_embeddings=64, init_std=0.5), VOCAB, 1, 0)
    batch = fake_batch(lm, n_prompts=2, g=4, seed=2, temperature=1.0)
    policy = PolicyModel(lm)
    opt = torch.optim.AdamW(policy.parameters(), lr=0.05)
    cfg = Cfg(mask=MaskConfig(rule="pdm_topk", k=5),
              trainer=TrainerConfig(mini_batches=mini_batches, micro_batch_size=2, grad_clip=grad_clip))
    return policy, opt, batch, cfg


def _params(policy):
    return [p.detach().clone() for p in policy.parameters()]


def _update(policy, opt, batch, cfg, adv, **kw):
    return train_step.update_policy(policy, opt, batch, adv, cfg=cfg, vocab_size=VOCAB, pad_id=0, lr=0.05, **kw)


@pytest.mark.parametrize("big, quantities", [(3e38, {"loss"}), (1e30, {"gradient", "grad_norm"})])
@pytest.mark.parametrize("grad_clip", [1.0, None])
def test_a_nonfinite_mini_batch_is_skipped_and_flagged(big, quantities, grad_clip):
    if big == 3e38 and grad_clip is None:
        quantities = {"loss", "gradient", "grad_norm"}
    policy, opt, batch, cfg = _setup(grad_clip=grad_clip)
    # mini-batch 0 (the first group) carries the exploding advantages, mini-batch 1 normal ones
    adv = torch.tensor([big, -big / 3, -big / 3, -big / 3, 1.0, -1.0, 0.5, -0.5])
    before = _params(policy)
    res = _update(policy, opt, batch, cfg, adv)
    assert [s.mini_batch for s in res.nonfinite] == [0]
    assert res.nonfinite[0].quantity in quantities, res.nonfinite
    assert "\n" not in res.nonfinite[0].detail and res.nonfinite[0].detail
    m = res.metrics
    assert m["train/nonfinite"] == 1.0 and m["train/skipped_optimizer_steps"] == 1.0
    assert m[f"train/nonfinite_{res.nonfinite[0].quantity}"] == 1.0
    after = _params(policy)
    assert all(bool(torch.isfinite(p).all()) for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))  # mini-batch 1 was stepped on
    # AdamW took exactly one step (mini-batch 1's): its state never saw the NaN/inf
    steps = {float(s["step"]) for s in opt.state.values()}
    assert steps == {1.0}
    assert all(bool(torch.isfinite(t).all()) for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


def test_only_nonfinite_mini_batches_leave_weights_and_optimizer_untouched():
    policy, opt, batch, cfg = _setup()
    adv = torch.tensor([3e38, -1e38, -1e38, -1e38, 3e38, -1e38, -1e38, -1e38])
    before = _params(policy)
    res = _update(policy, opt, batch, cfg, adv)
    assert [s.mini_batch for s in res.nonfinite] == [0, 1]
    assert all(torch.equal(a, b) for a, b in zip(before, _params(policy)))
    assert not opt.state  # AdamW never stepped
    assert all(p.grad is None for p in policy.parameters())
    assert res.metrics["train/skipped_optimizer_steps"] == 2.0
    assert math.isnan(res.metrics["loss/policy"])


def test_a_finite_update_is_unchanged_and_flags_zero():
    policy, opt, batch, cfg = _setup()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 1.0])
    res = _update(policy, opt, batch, cfg, adv)
    assert res.nonfinite == []
    assert res.metrics["train/nonfinite"] == 0.0 and res.metrics["train/skipped_optimizer_steps"] == 0.0
    assert math.isfinite(res.metrics["loss/grad_norm"]) and "mask/frac_dropped" in res.metrics
    assert {float(s["step"]) for s in opt.state.values()} == {2.0}


def test_the_audits_update_raises_after_the_skip():
    policy, opt, batch, cfg = _setup(mini_batches=1)
    adv = torch.tensor([3e38, -1e38, -1e38, -1e38, 1.0, -1.0, 0.5, -0.5])
    before = _params(policy)
    with pytest.raises(train_step.NonFiniteUpdate, match="non-finite loss in mini-batch 0"):
        _update(policy, opt, batch, cfg, adv, on_loss=lambda *a: None)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(policy))) and not opt.state


def test_bad_input_to_the_loss_still_raises():
    """Only the core's non-finite *result* is skipped; a NaN advantage is bad input, as before."""
    from pdm_lab.errors import PDMInputError

    policy, opt, batch, cfg = _setup()
    adv = torch.tensor([math.nan, 1.0, -1.0, 0.0, 1.0, -1.0, 0.5, -0.5])
    with pytest.raises(PDMInputError, match="advantage"):
        _update(policy, opt, batch, cfg, adv)


# ---------------------------------------------------------------------------- two FSDP2 ranks

def _fsdp_worker(rank: int, world: int, store: str, explode: bool, queue) -> None:
    import torch.distributed as dist

    from pdm_lab.scaling.policy_model import shard_policy

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        lm = build_model(TinyModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=16,
                                         max_position_embeddings=64, init_std=0.5), VOCAB, 1, 0)
        batch = fake_batch(lm, n_prompts=2, g=4, seed=2, temperature=1.0)
        cfg = Cfg(mask=MaskConfig(rule="pdm_topk", k=5),
                  trainer=TrainerConfig(mini_batches=2, micro_batch_size=2, grad_clip=1.0))
        half = list(range(rank * 4, rank * 4 + 4))
        adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
        if explode and rank == 0:  # only rank 0's first mini-batch (its rows 0, 1) explodes
            adv[:2] = 3e38
        elif not explode:  # the reference: mini-batch 0 moves nothing on either rank (Â = 0, SGD)
            adv[:2] = 0.0
        policy = shard_policy(lm, param_dtype="fp32", reduce_dtype="fp32", gradient_checkpointing=False)
        opt = torch.optim.SGD(policy.parameters(), lr=0.5)
        res = train_step.update_policy(policy, opt, batch.select(half), adv, cfg=cfg, vocab_size=VOCAB, pad_id=0,
                                       lr=0.5)
        full = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().numpy().copy()
                for name, p in policy.named_parameters()}
        queue.put((rank, full, [(s.mini_batch, s.quantity, s.detail) for s in res.nonfinite], sorted(res.metrics)))
    finally:
        dist.destroy_process_group()


def _two_ranks(tmp_path, explode: bool):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_fsdp_worker, args=(r, 2, str(tmp_path / f"store-{explode}"), explode, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=300) for _ in procs), key=lambda x: x[0])
    for p in procs:
        p.join(timeout=60)
    return results


@pytest.mark.slow
def test_two_fsdp2_ranks_skip_together_when_one_ranks_loss_overflows(tmp_path):
    """Rank 0's loss overflows in mini-batch 0, rank 1's does not: neither hangs (rank 0 still runs
    its backward), both skip mini-batch 0 and step on mini-batch 1 alike, and the weights are those
    of a run whose mini-batch 0 has zero advantages on both ranks (an SGD step on a zero gradient)."""
    (_, p0, nf0, keys0), (_, p1, nf1, keys1) = _two_ranks(tmp_path, explode=True)
    assert [(m, q) for m, q, _ in nf0] == [(m, q) for m, q, _ in nf1] == [(0, "loss")]
    assert nf0[0][2].startswith("loss:") and "another rank" in nf1[0][2]
    assert keys0 == keys1
    (_, ref, nf_ref, _), _ = _two_ranks(tmp_path, explode=False)
    assert nf_ref == []
    for name, want in ref.items():
        torch.testing.assert_close(torch.from_numpy(p0[name]), torch.from_numpy(want), rtol=0, atol=0)
        torch.testing.assert_close(torch.from_numpy(p1[name]), torch.from_numpy(want), rtol=0, atol=0)


# ---------------------------------------------------------------------------- end to end

PLUGIN = '''
"""A verifier whose rewards explode at chosen steps (32 samples a step, in order)."""
PER_STEP = 32
EXPLODE = {2: 1e33, 4: 3.4e38, 5: 3.4e38, 6: 3.4e38}   # step -> reward of each group's first sample
calls = [0]


def reward(response, answer):
    i = calls[0]
    calls[0] += 1
    step, j = i // PER_STEP + 1, i % PER_STEP
    if step == 3 and j == 5:
        return 1e39   # a finite Python float beyond float32's range: skipped as a sample
    if step in EXPLODE and j % 4 == 0:
        return EXPLODE[step]
    return float(len(response) % 2)
'''


def _weights(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    return {k: v for k, v in torch.load(out, weights_only=True)["model"].items() if torch.is_tensor(v)}


@pytest.mark.extended
def test_train_with_exploding_rewards_skips_stops_and_exits_3(tmp_path):
    run_dir = tmp_path / "run"
    (tmp_path / "explode.py").write_text(PLUGIN)
    cmd = [sys.executable, "-m", "pdm_lab", "train", "--config", str(REPO / "scaling" / "configs" / "tiny-cpu.yaml"),
           "total_steps=7", "model.tiny.sft_steps=60", "rollout.prompts_per_step=8", "rollout.group_size=4",
           "rollout.max_tokens=6", "trainer.micro_batch_size=8", "trainer.warmup_steps=0", "algo.norm_by_std=false",
           "eval.every=0", "checkpoint.every=1", "checkpoint.keep_last=10", "log.sync_check_every=1",
           "log.tensorboard=false", "data.synthetic.n_train=400", f"run_dir={run_dir}",
           f"plugins=[{tmp_path / 'explode.py'}]", "reward.verifier=pdm_lab_plugin_explode:reward"]
    env = dict(os.environ, PDM_LAB_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-4000:]
    assert "Traceback" not in out and "internal error" not in out
    assert not (run_dir / "pdm-lab-traceback.txt").exists()

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped_nonfinite" and summary["nonfinite"] is True
    assert summary["last_step"] == 6 and summary["total_steps"] == 7 and summary["max_nonfinite_steps"] == 3
    entries = {e["step"]: e for e in summary["nonfinite_steps"]}
    assert sorted(entries) == [2, 4, 5, 6]
    for e in entries.values():
        assert e["quantity"] in ("loss", "gradient", "grad_norm") and e["detail"]
        assert e["skipped_optimizer_steps"] == e["optimizer_steps"] == 2  # every mini-batch held an exploded group
    # one line on stderr naming the step and the quantity
    lines = [x for x in proc.stderr.splitlines() if x.startswith("pdm-lab train:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "stopped at step 6 of 7" in lines[0] and f"non-finite {entries[6]['quantity']}" in lines[0]
    assert summary["message"] in lines[0]

    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]  # stopped: no step 7
    flags = {r["step"]: r["train/nonfinite"] for r in recs}
    assert flags == {1: 0.0, 2: 1.0, 3: 0.0, 4: 1.0, 5: 1.0, 6: 1.0}
    for r in recs:
        q = entries[r["step"]]["quantity"] if r["step"] in entries else None
        for name in ("loss", "gradient", "grad_norm"):
            assert r[f"train/nonfinite_{name}"] == (2.0 if name == q else 0.0), (r["step"], name)
        # the engine still matches the trainer after every step: the weights it got are finite
        assert r["sync/logp_max_abs_err"] is not None and r["sync/logp_max_abs_err"] < 1e-3, r
    assert recs[2]["rollout/skipped_samples"] >= 1  # the reward beyond float32 at step 3
    assert "overflows float32" in proc.stdout

    # no checkpoint of the step it stopped at; the skipped steps left the weights as they were
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == [f"step_0000000{s}" for s in range(1, 6)]
    w = {s: _weights(run_dir / "checkpoints" / f"step_0000000{s}", tmp_path) for s in range(1, 6)}
    for s, weights in w.items():
        assert weights and all(bool(torch.isfinite(t).all()) for t in weights.values()), s
    same = lambda a, b: all(torch.equal(w[a][k], w[b][k]) for k in w[a])  # noqa: E731
    assert same(1, 2) and not same(2, 3) and same(3, 4) and same(3, 5)
