"""The direction audit on the loop's live batch (SPEC §6, §6c), under FSDP2 or on one rank.

Per audited step, at the audited mini-batch j (``audit.mini_batch``: ``first``, ``last`` — the
default —, ``all`` or an index): ``MiniBatchAudit`` is ``train_step.update_policy``'s
``before_step`` hook, so the audit runs inside the real update's mini-batch loop just before
mini-batch j's real step — the run's state when its mask acts on mini-batch j, after this batch's
first j real optimiser steps with their AdamW state (SPEC §6c) — on this rank's rows of mini-batch
j (the real step's rows, micro-batched the same way; the first ``audit.sequences`` of them when
set). The record carries ``mini_batch`` and the ``state_fingerprint`` of the parameters it
snapshotted. Then:

1. snapshot the parameters (local shards), AdamW's state, its param-group settings and the RNG
   to host memory (``pdm_lab.audit.live.HostSnapshot``);
2. D per response token at θ₀ with lm_head and the softmax in float64 (``measured_divergence``;
   the decoder runs in the trainer's dtype, deterministically, so an unmoved token has ΔD = 0);
3. for each rule R: one optimiser step from θ₀ and the snapshot's AdamW state with R's mask on
   mini-batch j (``train_step.update_policy`` with one mini-batch: the run's own micro-batching, loss
   scaling, gradient clip and AdamW, at the run's learning rate), its keep mask read from the
   core's ``LossOutput``; D recomputed in float64; ΔD = D_after − D_before on the outside
   tokens; then the snapshot restored, bit for bit;
4. the outside set O = {D > δ, Â ≠ 0} from the same stats the rules read (float32 π at θ₀), the
   per-pair disagreement and each rule's rates (``pdm_lab.audit.live.step_record``, the toy
   audit's ``delta_rates`` entries), merged over ranks.

The real mini-batch j then steps from the restored state: the run's weights and metrics are those
of the same run with the audit off (``tests/test_scaling_staleness.py``).

Only the top-K KL is measured: its change needs μ on the support alone, while the full KL needs
μ's whole distribution, which the engine does not return (``full_kl`` is null in the record).

Cost: the host snapshot (``host_bytes``: parameters + AdamW's two moments, per rank's shard) and,
per rule, one update over the batch plus one float64 forward; logged as ``time/audit_s``.
Collective: every rank calls ``audit_live_batch`` at the same step.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor

from pdm_lab.aggregation import DPInfo
from pdm_lab.audit.live import ProbeView, StepOutcome, distinct_contexts, run_live_audit, support_in_float64
from pdm_lab.policy_side import PolicyOnSupport
from pdm_lab.audit.probe_record import token_weights
from pdm_lab.tokenwise import token_stats
from pdm_lab.sampling_mask import engine_kept, on_sampling_set
from pdm_lab.support import support_from_topk

from .audit_probe import loop_probe_view, reshard
from .train_step import MicroBatch, make_micro_batch, update_policy

BYTES_PER_PARAM = 12
"""Host bytes per parameter held by the snapshot: fp32 master weight + AdamW's exp_avg and exp_avg_sq."""


def host_bytes(n_params: int, world: int) -> int:
    """The audit's extra host memory per rank: the snapshot of its shard (``BYTES_PER_PARAM``)."""
    return BYTES_PER_PARAM * -(-n_params // max(world, 1))


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rule_mask_config(mask_cfg, rule: str, delta: float):
    """The run's mask section with the audited rule and δ (the rule's own estimator)."""
    return dataclasses.replace(mask_cfg, rule=rule, delta=delta, delta_neg=None, estimator=None)


@torch.no_grad()
def measured_divergence(policy, mb: MicroBatch, mask_cfg, vocab_size: int, temperature: float,
                        chunk_tokens: int | None, sampling=None) -> Tensor:
    """[n] D of ``measured_stats`` (the audit's measurement; module docstring)."""
    return measured_stats(policy, mb, mask_cfg, vocab_size, temperature, chunk_tokens, sampling)[0]


@torch.no_grad()  # read only: the audit runs inside the update's grad-enabled mini-batch loop
def measured_stats(policy, mb: MicroBatch, mask_cfg, vocab_size: int, temperature: float,
                   chunk_tokens: int | None, sampling=None) -> tuple[Tensor, Tensor]:
    """[n] top-K KL D(μ‖π) of the micro-batch's response tokens in float64 (μ's support as the
    rules build it, then cast; lm_head and the softmax in float64; with the engine's sampling mask
    kept, π over the sampling set, as the loss computes it). Collective under FSDP."""
    valid = mb.response_mask.reshape(-1).nonzero(as_tuple=True)[0]
    support = support_in_float64(support_from_topk(mb.topk_ids[valid], mb.topk_logp[valid], mb.sampled[valid],
                                                   mb.sampled_logp[valid], vocab_size=vocab_size, k=mask_cfg.k,
                                                   convention=mask_cfg.convention))
    extra = {} if sampling is None else {"sampling": sampling, "keep_on_support": engine_kept(support)}
    out = policy(mb.input_ids, mb.attention_mask, mb.positions, support.ids, temperature, chunk_tokens,
                 head_dtype=torch.float64, **extra)
    pi = PolicyOnSupport(logp=out[0].double(), tail_logp=out[1].double(), tail_log_sumsq=out[2].double())
    if len(out) == 4:  # π over the engine's sampling set (SPEC §1): the D the loss's mask thresholds
        pi = dataclasses.replace(pi, tail_count=out[3])
        support = on_sampling_set(support, out[3])
    reshard(policy)
    stats = token_stats(support, pi, binary=False)
    return stats.topk_kl, stats.mu_tail


def _micro_batches(batch, seq_adv: Tensor, pad_id: int, size: int, device) -> list[MicroBatch]:
    """The micro-batches ``update_policy`` builds for one mini-batch of the whole batch (same order)."""
    rows = list(range(len(batch)))
    return [make_micro_batch(batch, rows[i:i + size], seq_adv, pad_id).to(device or "cpu")
            for i in range(0, len(rows), size)]


def _distinct_contexts(batch) -> int:
    return distinct_contexts(batch.prompt_ids, batch.response_ids.tolist(), batch.response_mask.tolist())


class LoopAuditStage:
    """The loop's side of ``pdm_lab.audit.live.run_live_audit`` on this rank's audited batch."""

    def __init__(self, policy, optimizer, batch, seq_adv: Tensor, *, cfg, vocab_size: int, pad_id: int, lr: float,
                 delta: float, device=None):
        self.policy, self.optimizer, self.batch, self.seq_adv = policy, optimizer, batch, seq_adv
        self.cfg, self.vocab_size, self.pad_id, self.lr, self.delta = cfg, vocab_size, pad_id, lr, delta
        self.device = device
        # the shards the optimiser holds: a forward with no backward after it (the loop's sync
        # check before step 1) leaves FSDP2's root gathered, and ``parameters()`` then yields the
        # gathered copies, whose storage the next reshard frees (a snapshot restored into them
        # writes through freed memory; their AdamW state is keyed by the shards)
        reshard(policy)
        self.params = list(policy.parameters())
        self.micros = _micro_batches(batch, seq_adv, pad_id, cfg.trainer.micro_batch_size, device)
        resp = [mb.response_mask.reshape(-1) for mb in self.micros]
        dp = DPInfo.all_reduce(sum(mb.n_tokens for mb in self.micros), sum(mb.n_seqs for mb in self.micros))
        self.weights = torch.cat([token_weights(mb.response_mask, cfg.mask.aggregation, horizon=cfg.mask.horizon,
                                                dp=dp).reshape(-1)[r.cpu()] for mb, r in zip(self.micros, resp)])
        offset, seqs, cols = 0, [], []
        for mb in self.micros:  # audited token → (sequence, response position), in the micro-batches' order
            r, c = mb.response_mask.cpu().nonzero(as_tuple=True)
            seqs.append(r + offset)
            cols.append(c)
            offset += mb.response_mask.shape[0]
        self.token_seq, self.token_col = torch.cat(seqs), torch.cat(cols)
        #: [n] the sampled token id of each audited token (the record's per-token rows carry it)
        self.token_ids = torch.cat([mb.sampled.reshape(-1)[r.to(mb.sampled.device)].cpu()
                                    for mb, r in zip(self.micros, resp)])
        #: [n] Â per audited token (``run_live_audit`` reads it for an idle batch's counts)
        self.advantages = torch.cat([mb.advantages.reshape(-1)[r] for mb, r in zip(self.micros, resp)])

    def step(self, rule: str, optimizer, *, lr_scale: float, zero_advantages: bool) -> StepOutcome:
        cfg = self.cfg
        mask_cfg = rule_mask_config(cfg.mask, rule, self.delta)
        run_cfg = dataclasses.replace(cfg, mask=mask_cfg, trainer=dataclasses.replace(cfg.trainer, mini_batches=1))
        outs: list = []
        adv = torch.zeros_like(self.seq_adv) if zero_advantages else self.seq_adv
        upd = update_policy(self.policy, optimizer, self.batch, adv, cfg=run_cfg, vocab_size=self.vocab_size,
                            pad_id=self.pad_id, lr=self.lr * lr_scale, device=self.device,
                            on_loss=lambda _m, _i, out: outs.append(out))
        resp = [mb.response_mask.reshape(-1) for mb in self.micros]
        norm = upd.metrics.get("loss/grad_norm")
        clip = cfg.trainer.grad_clip
        return StepOutcome(
            keep=torch.cat([o.keep.reshape(-1)[r] for o, r in zip(outs, resp)]) > 0,
            topk_kl=torch.cat([o.stats.topk_kl[r] for o, r in zip(outs, resp)]),
            mu_tail=torch.cat([o.stats.mu_tail[r] for o, r in zip(outs, resp)]),
            advantages=self.advantages,
            ratio=torch.cat([o.stats.ratio[r] for o, r in zip(outs, resp)]),
            weights=self.weights,
            clip_factor=1.0 if clip is None or norm is None else min(1.0, clip / (norm + 1e-6)))

    def measure(self) -> Tensor:
        cfg = self.cfg
        parts = [measured_stats(self.policy, mb, cfg.mask, self.vocab_size, cfg.rollout.temperature,
                                cfg.trainer.logits_chunk_tokens, getattr(cfg.rollout, "sampling_mask", None))
                 for mb in self.micros]
        self.mu_tail = torch.cat([t for _, t in parts])  # μ_T of the measured tokens (an idle batch's regime)
        return torch.cat([d for d, _ in parts])

    def probe_view(self, rows: Tensor, preconditioner) -> ProbeView:
        return loop_probe_view(self, rows.cpu(), preconditioner)


def audit_live_batch(policy, optimizer, batch, seq_adv: Tensor, *, cfg, vocab_size: int, pad_id: int,
                     lr: float, device=None, mini_batch: int | None = None) -> dict:
    """SPEC §6 on this step's batch (module docstring); returns the merged record (every rank).

    Args:
        policy: the (FSDP) ``PolicyModel``; its parameters are stepped and restored.
        optimizer: its AdamW (state snapshotted and restored).
        batch: this rank's ``RolloutBatch``; seq_adv: [B] per-sequence advantages.
        cfg: the run's TrainConfig (``audit``, ``mask``, ``trainer``, ``rollout`` sections).
        vocab_size, pad_id: as for ``update_policy``.
        lr: the learning rate of the audited optimiser step (the audited step takes it).
        mini_batch: the index j of the mini-batch ``batch`` is (its rows, at the state the run is
            in when its mask acts on it: ``MiniBatchAudit``); the record's ``mini_batch``. None:
            ``batch`` audited as given, from the current state.
    """
    audit = cfg.audit
    if audit.sequences is not None:  # this rank's share of the audited sequences (whole groups first)
        share = min(len(batch), -(-audit.sequences // _world()))
        batch, seq_adv = batch.select(list(range(share))), seq_adv[:share]
    delta = cfg.mask.delta if audit.delta is None else audit.delta
    stage = LoopAuditStage(policy, optimizer, batch, seq_adv, cfg=cfg, vocab_size=vocab_size, pad_id=pad_id, lr=lr,
                           delta=delta, device=device)
    record = run_live_audit(stage, rules=audit.rules, cfg=audit, mask_cfg=cfg.mask, delta=delta,
                            contexts=_distinct_contexts(batch), seed=getattr(cfg, "seed", 0))
    record.update(k=cfg.mask.k, mini_batch=mini_batch, mini_batches=cfg.trainer.mini_batches,
                  step_doc={"optimizer": type(optimizer).__name__ + " (the run's, with its state at this step)",
                            "lr": lr, "aggregation": cfg.mask.aggregation, "grad_clip": cfg.trainer.grad_clip,
                            "batch": ("each rank's rows of mini-batch j as one optimiser step, from the run's "
                                      "state before its real step on j" if mini_batch is not None else
                                      "each rank's given batch as one optimiser step"),
                            "precision": "decoder in trainer.param_dtype, lm_head + D in float64",
                            "measured": {"topk_kl": True, "full_kl": "not measured: the engine returns μ's top-K only"},
                            "probe": "K v by central differences of the decoder (lm_head in float64) at θ ± εu"})
    return record


class MiniBatchAudit:
    """``update_policy``'s ``before_step`` for an audited step: at each audited mini-batch j
    (``cfg.audit.mini_batches(M)``), ``audit_live_batch`` on this rank's rows of j from the run's
    current state, restored bit for bit before the real step on j. ``records`` holds one record per
    audited j; ``skipped`` the one-line reasons of audits a non-finite update stopped (every rank
    together; the state restored). ``seconds``: the time spent here (part of the update's)."""

    def __init__(self, policy, optimizer, batch, seq_adv: Tensor, *, cfg, vocab_size: int, pad_id: int, lr: float,
                 device=None):
        self.policy, self.optimizer, self.batch, self.seq_adv = policy, optimizer, batch, seq_adv
        self.cfg, self.vocab_size, self.pad_id, self.lr, self.device = cfg, vocab_size, pad_id, lr, device
        self.audited = set(cfg.audit.mini_batches(cfg.trainer.mini_batches))
        self.records: list[dict] = []
        self.skipped: list[str] = []
        self.seconds = 0.0

    def __call__(self, mb_index: int, rows: list[int]) -> None:
        import time

        from .train_step import NonFiniteUpdate

        if mb_index not in self.audited:
            return
        t0 = time.perf_counter()
        try:
            record = audit_live_batch(self.policy, self.optimizer, self.batch.select(rows), self.seq_adv[rows],
                                      cfg=self.cfg, vocab_size=self.vocab_size, pad_id=self.pad_id, lr=self.lr,
                                      device=self.device, mini_batch=mb_index)
        except NonFiniteUpdate as err:  # every rank together; the snapshot was restored
            self.skipped.append(f"mini-batch {mb_index}: {err}")
        else:
            record["time_s"] = time.perf_counter() - t0
            self.records.append(record)
        self.seconds += time.perf_counter() - t0


def write_record(run_dir, step: int, seed: int, record: dict) -> None:
    """Append one audited step to ``run_dir/audit.jsonl`` (NaN written as null). A step redone
    after a resume is appended again; readers keep the last line of each step."""
    import json
    from pathlib import Path

    from pdm_lab.audit.live import json_safe

    path = Path(run_dir) / "audit.jsonl"
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(json_safe({"step": step, "seed": seed, **record}), allow_nan=False) + "\n")


def parameter_count(cfg) -> int | None:
    """The policy's parameter count without loading weights: the safetensors headers of
    ``model.path`` (their shapes), else its config.json (the model built on the meta device), or
    the tiny model's section; None when neither is there."""
    import json
    import struct
    from pathlib import Path

    if cfg.model.tiny is not None:
        from .tiny_model import build_model

        with torch.device("meta"):
            lm = build_model(cfg.model.tiny, cfg.model.tiny.vocab_size, eos_id=0, pad_id=0)
        return sum(p.numel() for p in lm.parameters())
    path = Path(cfg.model.path)
    files = sorted(path.glob("*.safetensors"))
    if files:
        total = 0
        for f in files:
            with f.open("rb") as fh:
                header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
            for name, meta in header.items():
                if name != "__metadata__":
                    n = 1
                    for s in meta["shape"]:
                        n *= s
                    total += n
        return total
    if (path / "config.json").exists():
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)))
        return sum(p.numel() for p in lm.parameters())
    return None


def audit_memory(cfg, world: int) -> dict:
    """What ``--dry-run`` reports for the ``audit:`` section: its settings and the host memory of
    the snapshot per rank (``host_bytes``), beyond the step's own."""
    n = parameter_count(cfg)
    per_rank = None if n is None else host_bytes(n, world)
    return {"every": cfg.audit.every, "rules": list(cfg.audit.rules), "mini_batch": cfg.audit.mini_batch,
            "audited_mini_batches": list(cfg.audit.mini_batches(cfg.trainer.mini_batches)),
            "delta": cfg.mask.delta if cfg.audit.delta is None else cfg.audit.delta, "k": cfg.mask.k,
            "parameters": n, "ranks": world,
            "host_snapshot_gib_per_rank": None if per_rank is None else round(per_rank / 2 ** 30, 3),
            "note": "fp32 shard + AdamW's two moments on the host; plus per rule one update and one "
                    "forward (time/audit_s)"}
