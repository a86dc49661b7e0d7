"""The RL loop, top to bottom (run on every rank; see ``scaling/README.md`` for the picture).

    prompts ─► vLLM (μ, top-K log-probs) ─► verifier ─► GRPO advantages
       ▲                                                      │
       │                                                      ▼
    in-place weight sync ◄── optimiser ◄── pdm_policy_loss(π on support, mask registry)

Every rank holds an FSDP shard of the policy and its own vLLM engine (external launcher). One
step = one rollout batch = ``trainer.mini_batches`` optimiser steps, then one weight sync.
``run_training`` reads as the list of those steps; each is a named function below it, and what
is built once before the first step is ``scaling.run_setup``.

Non-finite steps: an optimiser step whose loss or gradient is NaN or ±inf is skipped
(``train_step.update_policy``), the step is logged with ``train/nonfinite = 1`` and the quantity
(``train/nonfinite_loss``, ``_gradient``, ``_grad_norm``), and recorded with where it happened in
``summary.json``. After ``trainer.max_nonfinite_steps`` (default 3) consecutive such steps the run stops with one
line naming the step and the quantity. ``pdm-lab train`` then exits with status 3 (a result, as
``sweep``'s non-finite runs), never a traceback.

One module of ~420 lines on purpose: the loop reads top to bottom as CleanRL's do; its pieces are
the steps of one iteration, each a short named function, and splitting them apart would hide the order.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch

from pdm_lab.lab.advantages import group_advantages
from pdm_lab.lab.lifetime import guard_rank

from pdm_lab.audit.live import flat_metrics

from .audit_step import MiniBatchAudit, write_record
from .checkpoint import save_checkpoint
from .config import TrainConfig
from .distributed import all_reduce_max, all_reduce_sum
from .evaluate import evaluate
from .metrics_log import read_summary, write_summary
from .policy_model import DTYPES, PREFIX, sequence_logprobs
from .rollout import (engine_dtype, generate, outputs_to_batch, request_seed, sampling_params, score_sequence,
                      shutdown_engine)
from .run_setup import Run, set_up_run
from .train_step import NonFinite, update_policy
from .verifiers import score_responses
from .weight_sync import check_sync, push_weights, rollout_weights, sync_tolerance


def run_training(cfg: TrainConfig) -> Path:
    """Train; returns the run directory. Collective: every rank calls it."""
    run = set_up_run(cfg)  # layout, assets, engine, trainer, resume, first weight push
    sync_error(run.llm, run.policy, run.fixed_seq, cfg, run.start)
    if run.start == 0 and cfg.eval.every and cfg.eval.at_start and run.eval_sets:
        evaluate_at_start(run)
    nonfinite = NonFiniteSteps.start(run)
    for step in range(run.start + 1, cfg.total_steps + 1):
        t_step, cpu_step = time.perf_counter(), time.process_time()
        times: dict[str, float] = {}
        lr = learning_rate(cfg, (step - 1) * cfg.trainer.mini_batches)
        rows, first = draw_prompts(run, step)                                    # 1. prompts
        with timed(times, "generate"):
            batch = roll_out(run, rows, first, step)                            # 2. rollout, μ's top-K
        with timed(times, "reward"):
            batch, rewards, ok, adv = score_and_advantages(run, batch, step)     # 3-4. rewards, Â
        audit = audit_hook(run, batch, adv, lr) if due(cfg.audit.every, step) else None  # 5a. at mini-batch j
        metrics, skipped = train_on_batch(run, step, batch, adv, lr, times, audit)  # 5. update (non-finite: skipped)
        if audit is not None:
            metrics.update(audit_metrics(run, step, audit, times))
        with timed(times, "sync"):                                              # 6. weight sync
            push_weights(run.llm, rollout_weights(run.policy, cfg.rollout, PREFIX), in_place=run.in_place)
        if due(cfg.log.sync_check_every, step):
            metrics["sync/logp_max_abs_err"] = sync_error(run.llm, run.policy, run.fixed_seq, cfg, step)
        metrics.update(rollout_metrics(run, batch, rewards, ok, adv, lr))       # 7. rollout metrics
        if due(cfg.eval.every, step) and run.eval_sets:                         # 8. evaluation
            with timed(times, "eval"):
                metrics.update(evaluate_on(run, step))
        times["step"] = time.perf_counter() - t_step
        # CPU seconds of this process (all its threads): on a shared machine, less load-dependent
        times["step_cpu"] = time.process_time() - cpu_step
        log_step(run, step, metrics, times)                                     # 9. log
        if nonfinite.record(step, skipped):                                     # too many non-finite steps
            break
        if due(cfg.checkpoint.every, step) or step == cfg.total_steps:         # 10. checkpoint
            checkpoint(run, step)
    run.log.close()
    torch.distributed.barrier()
    shutdown_engine(run.llm)  # vLLM's shutdown also tears down the process group
    nonfinite.finish()  # summary.json; a non-finite run: its line, and exit status 3
    return run.run_dir


#: Consecutive steps with a non-finite loss or gradient after which a run stops (each one's
#: optimiser steps are skipped); ``trainer.max_nonfinite_steps`` where the config has that key.
#: Exit status of ``pdm-lab train`` when a step went non-finite: a result, as ``sweep``'s.
NONFINITE_EXIT = 3


class NonFiniteRun(SystemExit):
    """How a ``pdm-lab train`` run in this process ends when a step went non-finite: exit
    status 3 after its one line on stderr (a ``SystemExit``: no traceback, not an internal error).
    Ranks under torchrun return normally instead (a failed rank would fail the whole group)."""

    def __init__(self, line: str):
        super().__init__(NONFINITE_EXIT)
        self.line = line


def nonfinite_status(run_dir: Path) -> int:
    """The exit status a finished run's ``summary.json`` calls for: ``NONFINITE_EXIT`` when a step
    went non-finite, else 0 (for a launcher whose ranks ran under torchrun and returned 0)."""
    return NONFINITE_EXIT if (read_summary(run_dir) or {}).get("nonfinite") else 0


def nonfinite_limit(cfg: TrainConfig) -> int:
    """Consecutive non-finite steps that stop the run (``trainer.max_nonfinite_steps``)."""
    return int(cfg.trainer.max_nonfinite_steps)


@dataclasses.dataclass
class NonFiniteSteps:
    """The run's non-finite steps: counted, said, written to ``summary.json`` (rank 0)."""

    run: Run
    limit: int
    entries: list[dict]
    consecutive: int = 0
    stopped: int | None = None      # the step the run stopped at
    last_step: int = 0

    @classmethod
    def start(cls, run: Run) -> "NonFiniteSteps":
        """A resumed run keeps the earlier entries up to the resumed step (and their streak)."""
        old = ((read_summary(run.run_dir) or {}).get("nonfinite_steps") or []) if run.start else []
        entries = [e for e in old if isinstance(e, dict) and isinstance(e.get("step"), int) and e["step"] <= run.start]
        streak, steps = 0, {e["step"] for e in entries}
        while run.start - streak in steps:
            streak += 1
        return cls(run=run, limit=nonfinite_limit(run.cfg), entries=entries, consecutive=streak,
                   last_step=run.start)

    def record(self, step: int, skipped: list[NonFinite]) -> bool:
        """After step ``step`` is logged: count it; True when the run must stop here."""
        self.last_step = step
        if not skipped:
            self.consecutive = 0
            return False
        self.consecutive += 1
        first = skipped[0]
        self.entries.append({"step": step, "quantity": first.quantity,
                             "quantities": sorted({s.quantity for s in skipped}),
                             "skipped_optimizer_steps": len(skipped),
                             "optimizer_steps": self.run.cfg.trainer.mini_batches, "detail": first.detail})
        stop = self.consecutive >= self.limit
        self.run.say(f"[train] step {step}: non-finite {first.quantity} ({first.detail}); {len(skipped)} of "
                     f"{self.run.cfg.trainer.mini_batches} optimiser steps skipped, the weights do not take it "
                     f"({self.consecutive} consecutive; the run stops at {self.limit})")
        if stop:
            self.stopped = step
        if self.run.lay.is_main:
            write_summary(self.run.run_dir, self.summary())
        return stop

    def summary(self) -> dict:
        cfg = self.run.cfg
        return {"status": "stopped_nonfinite" if self.stopped is not None else
                ("completed" if self.last_step >= cfg.total_steps else "running"),
                "last_step": self.last_step, "total_steps": cfg.total_steps,
                "nonfinite": bool(self.entries), "max_nonfinite_steps": self.limit,
                "nonfinite_steps": self.entries, "message": self.line() if self.entries else None}

    def line(self) -> str:
        """The run's one line on its non-finite steps: the step, the quantity, the count."""
        last = self.entries[-1]
        where = f"summary in {self.run.run_dir / 'summary.json'}"
        if self.stopped is not None:
            return (f"stopped at step {self.stopped} of {self.run.cfg.total_steps}: {self.consecutive} consecutive "
                    f"steps with a non-finite loss or gradient, the last a non-finite {last['quantity']} "
                    f"({last['detail']}); no optimiser step was taken on a non-finite loss or gradient, the weights "
                    f"stay finite; {where}")
        steps = ", ".join(f"{e['step']} ({e['quantity']})" for e in self.entries[:5])
        more = f" and {len(self.entries) - 5} more" if len(self.entries) > 5 else ""
        return (f"finished, but {len(self.entries)} step(s) had a non-finite loss or gradient and were not "
                f"stepped on: step {steps}{more}; {where}")

    def finish(self) -> None:
        """The final ``summary.json``; a non-finite run says so in one line and, outside torchrun,
        ends with ``NonFiniteRun`` (exit status 3)."""
        if not self.run.lay.is_main:
            return
        write_summary(self.run.run_dir, self.summary())
        if not self.entries:
            return
        line = f"pdm-lab train: {self.line()}"
        print(line, file=sys.stderr, flush=True)
        if "TORCHELASTIC_RUN_ID" not in os.environ:  # this process is the command: its status says it
            raise NonFiniteRun(line)


def due(every: int, step: int) -> bool:
    """Whether a periodic action (every ``every`` steps; 0 = never) runs at ``step``."""
    return bool(every) and step % every == 0


@contextlib.contextmanager
def timed(times: dict[str, float], key: str):
    """Wall seconds of the block into ``times[key]``."""
    t0 = time.perf_counter()
    yield
    times[key] = time.perf_counter() - t0


def learning_rate(cfg: TrainConfig, optimizer_step: int) -> float:
    """Linear warm-up over ``trainer.warmup_steps`` optimiser steps, then constant (SPEC §7)."""
    warm = cfg.trainer.warmup_steps
    return cfg.trainer.lr * min(1.0, (optimizer_step + 1) / warm) if warm else cfg.trainer.lr


def sync_error(llm, policy, token_ids: list[int], cfg: TrainConfig, step: int) -> float:
    """The weight-sync check: max |log μ − log π| on a fixed sequence (all ranks' maximum);
    raises ``SyncError`` beyond ``log.sync_check_tol`` (default: from the two dtypes).

    Collective: every rank calls it.
    """
    engine = score_sequence(llm, token_ids)
    trainer = sequence_logprobs(policy, token_ids).cpu()
    # NaN (a broken engine) must survive the max-reduction: send it as +inf
    local = float(torch.nan_to_num((engine - trainer).abs(), nan=float("inf")).max()) if len(engine) else 0.0
    err = all_reduce_max([local, float(trainer.abs().max()) if len(trainer) else 0.0])
    tol = cfg.log.sync_check_tol
    if tol is None:
        tol = sync_tolerance(getattr(torch, engine_dtype(cfg.rollout.precision)),
                             DTYPES[cfg.trainer.param_dtype], err[1])
        if cfg.rollout.precision == "fp8":  # fp8 weights: the mismatch is the point, not a fault
            tol = float("inf")
    # every rank raises together (the maximum is global), so no rank is left in a collective
    return check_sync(err[0], tol, step)


def evaluate_on(run: Run, step: int) -> dict[str, float]:
    """The eval sets' metrics at ``step`` (every data-parallel group scores its share)."""
    lay = run.lay
    return evaluate(run.llm, run.eval_sets, run.tokenizer, run.verifier, run.cfg, step=step, dp_rank=lay.dp_rank,
                    dp_size=lay.dp, count_here=lay.tp_rank == 0, stop_token_ids=run.stops)


def evaluate_at_start(run: Run) -> None:
    """Step 0's evaluation, logged and printed before training starts."""
    t0 = time.perf_counter()
    ev = evaluate_on(run, 0)
    ev["time/eval_s"] = time.perf_counter() - t0
    run.log.log(0, ev)
    run.say("[eval] step 0 " + " ".join(f"{k}={v:.3f}" for k, v in ev.items() if k.startswith("eval/")))


def draw_prompts(run: Run, step: int) -> tuple[list, int]:
    """Every rank draws the same global batch and takes its data-parallel group's slice; returns
    the rows and the index of the first one in the global batch."""
    per_dp = run.cfg.rollout.prompts_per_step // run.lay.dp
    batch_idx = run.sampler.next_batch(run.cfg.rollout.prompts_per_step)
    first = run.lay.dp_rank * per_dp
    return [run.train_rows[i] for i in batch_idx[first:first + per_dp]], first


def roll_out(run: Run, rows: list, first: int, step: int):
    """``group_size`` responses per prompt from the engine, with μ's top-K log-probs."""
    cfg = run.cfg
    r = cfg.rollout
    params = [sampling_params(n=r.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p,
                              max_tokens=r.max_tokens, logprobs=cfg.mask.k,
                              seed=request_seed(cfg.seed, r.seed, "train", step, first + j),
                              stop_token_ids=run.stops) for j in range(len(rows))]
    outputs = generate(run.llm, [list(row.prompt_ids) for row in rows], params)
    return outputs_to_batch(outputs, [list(row.prompt_ids) for row in rows], [row.answer for row in rows],
                            k=cfg.mask.k, tokenizer=run.tokenizer)


def score_and_advantages(run: Run, batch, step: int):
    """Rewards (a failed verification leaves the sample out of the loss, logged), then GRPO
    advantages over each prompt's group (complete inside this data-parallel group); under tensor
    parallelism each rank keeps its own sequences. Returns (batch, rewards, ok, Â)."""
    cfg, lay = run.cfg, run.lay
    scores = score_responses(run.verifier, batch.texts, batch.answers, on_error=cfg.reward.on_error)
    for msg in scores.errors[:3]:
        run.say(f"[reward] step {step}: skipped {msg}")
    rewards = torch.tensor(scores.rewards, dtype=torch.float32)
    ok = torch.tensor(scores.ok, dtype=torch.bool)
    overflow = ~torch.isfinite(rewards)  # finite as a Python float, beyond float32's range (|r| > 3.4e38)
    if bool(overflow.any()):  # skipped like a non-finite reward (score_responses)
        run.say(f"[reward] step {step}: skipped {int(overflow.sum())} samples whose reward overflows float32 "
                f"(e.g. {scores.rewards[int(overflow.nonzero()[0, 0])]!r})")
        ok &= ~overflow
        rewards = torch.where(overflow, 0.0, rewards)
    batch.response_mask &= ok[:, None]
    adv = group_advantages(rewards, batch.group, ok, scale_by_std=cfg.algo.norm_by_std, eps=cfg.algo.std_eps)
    if lay.tp > 1:  # the ranks of a tensor-parallel group train on different sequences
        part = list(range(lay.tp_rank * run.per_rank, (lay.tp_rank + 1) * run.per_rank))
        batch, rewards, ok, adv = batch.select(part), rewards[part], ok[part], adv[part]
    return batch, rewards, ok, adv


def audit_hook(run: Run, batch, adv, lr: float) -> MiniBatchAudit:
    """The direction audit on this batch (SPEC §6c), as the update's ``before_step`` hook: at the
    audited mini-batch j (``audit.mini_batch``), from the run's state when its mask acts on j (after
    the j real optimiser steps, with their AdamW state), one step per rule on mini-batch j, ΔD
    measured, everything restored bit-exactly before the real step on j."""
    return MiniBatchAudit(run.policy, run.optimizer, batch, adv, cfg=run.cfg, vocab_size=run.model_info["vocab_size"],
                          pad_id=run.pad_id, lr=lr, device=run.lay.device)


def audit_metrics(run: Run, step: int, audit: MiniBatchAudit, times: dict[str, float]) -> dict[str, float]:
    """The audit's records to ``audit.jsonl`` (one line per audited mini-batch) and its flat
    metrics: ``audit/...`` of the last audited mini-batch (``audit/mini_batch`` says which) and,
    with ``audit.mini_batch: all``, every one's as ``audit/mb{j}/...``."""
    times["audit"] = audit.seconds
    for line in audit.skipped:
        run.say(f"[audit] step {step}: not audited at {line}")
    out = {"audit/skipped_nonfinite": 1.0} if audit.skipped else {}
    for record in audit.records:
        if run.lay.is_main:
            write_record(run.run_dir, step, run.cfg.seed, record)
        flat = {**flat_metrics(record, record["rules"]), "audit/mini_batch": float(record["mini_batch"])}
        if len(audit.audited) > 1:
            out.update({key.replace("audit/", f"audit/mb{record['mini_batch']}/", 1): v for key, v in flat.items()})
        out.update(flat)
    if audit.records:
        out["time/probe_s"] = sum(r.get("time/probe_s", 0.0) for r in audit.records)
    return out


def train_on_batch(run: Run, step: int, batch, adv, lr: float, times: dict[str, float],
                   audit: MiniBatchAudit | None = None) -> tuple[dict[str, float], list[NonFinite]]:
    """The update: the registry's mask and loss on π over μ's support; returns its metrics and the
    optimiser steps it skipped as non-finite. ``audit``: run at its mini-batch inside the update
    (its seconds are not counted in ``time/train_s``)."""
    with timed(times, "train"):
        upd = update_policy(run.policy, run.optimizer, batch, adv, cfg=run.cfg,
                            vocab_size=run.model_info["vocab_size"], pad_id=run.pad_id, lr=lr,
                            device=run.lay.device, before_step=audit,
                            mismatch_sample=lambda stats, a, r, mini_batch: run.mismatch_sample.write(
                                step, stats, a, r, mini_batch=mini_batch))
    if audit is not None:
        times["train"] -= audit.seconds
    times["loss"] = upd.times["loss"]
    if "coupled" in upd.times:  # pdm_coupled's extra passes (SPEC §3b), its own timing line
        times["coupled"] = upd.times["coupled"]
    return dict(upd.metrics), upd.nonfinite


def rollout_metrics(run: Run, batch, rewards, ok, adv, lr: float) -> dict[str, float]:
    """Reward, length, truncation and skipped samples, global over ranks."""
    resp_len = batch.response_mask.sum(dim=1).float()
    tot = all_reduce_sum([float(rewards[ok].sum()), float(ok.sum()), float(len(ok)),
                          float((rewards[ok] >= 1.0).sum()), float(resp_len.sum()),
                          float(batch.truncated.sum()), float((adv != 0).sum())])
    return {
        "reward/mean": tot[0] / max(tot[1], 1.0), "reward/accuracy": tot[3] / max(tot[1], 1.0),
        "rollout/skipped_samples": tot[2] - tot[1], "rollout/response_len": tot[4] / max(tot[2], 1.0),
        "rollout/truncated_frac": tot[5] / max(tot[2], 1.0),
        "rollout/nonzero_adv_frac": tot[6] / max(tot[2], 1.0),
        "data/epoch": float(run.sampler.epoch), "optim/lr": lr,
    }


def log_step(run: Run, step: int, metrics: dict[str, float], times: dict[str, float]) -> None:
    """Log (times: the slowest rank's) and print every ``log.print_every`` steps. Called before
    the checkpoint: a step whose checkpoint exists has its metrics line (a step logged but not
    checkpointed is redone and re-logged)."""
    cfg = run.cfg
    keys = sorted(times)
    slowest = all_reduce_max([times[k] for k in keys] +
                             [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)])
    metrics.update({f"time/{k}_s": v for k, v in zip(keys, slowest)})
    metrics["time/mask_loss_share"] = times["loss"] / max(times["step"], 1e-9)
    if "audit" in times:
        metrics["time/audit_share"] = times["audit"] / max(times["step"], 1e-9)
    metrics["mem/peak_rss_gib"] = slowest[-1]
    run.log.log(step, metrics)
    if step % cfg.log.print_every == 0 or step == cfg.total_steps:
        ev = " ".join(f"{k.split('/')[1]}={v:.3f}" for k, v in metrics.items() if k.startswith("eval/") and "@" in k)
        run.say(f"[train] step {step}/{cfg.total_steps} reward {metrics['reward/mean']:.3f} "
                f"len {metrics['rollout/response_len']:.1f} kl {metrics.get('mismatch/topk_kl_mean', math.nan):.2e} "
                f"drop {metrics.get('mask/frac_dropped', math.nan):.3f} | gen {metrics['time/generate_s']:.2f}s "
                f"train {metrics['time/train_s']:.2f}s sync {metrics['time/sync_s']:.3f}s "
                f"step {metrics['time/step_s']:.2f}s {ev}")


def checkpoint(run: Run, step: int) -> None:
    """Save after the step's sync: a resume re-syncs from these exact weights."""
    t0 = time.perf_counter()
    save_checkpoint(run.run_dir, step, run.policy, run.optimizer, {"step": step, "sampler": run.sampler.state_dict()},
                    run.cfg.checkpoint.keep_last)
    run.say(f"[train] checkpoint at step {step} ({time.perf_counter() - t0:.2f}s)")


def main(argv: list[str] | None = None) -> int:
    """Worker entry: ``torchrun ... -m pdm_lab.scaling.loop --config FILE [key=value ...]``."""
    import argparse

    from .config import load_config

    ap = argparse.ArgumentParser(prog="pdm_lab.scaling.loop", description=main.__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    guard_rank()  # die with the launcher, even when it is SIGKILLed
    cfg = load_config(args.config, args.overrides)
    run_training(cfg)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
