"""The RL loop, top to bottom (run on every rank; see ``scaling/README.md`` for the picture).

    prompts ─► vLLM (μ, top-K log-probs) ─► verifier ─► GRPO advantages
       ▲                                                      │
       │                                                      ▼
    in-place weight sync ◄── optimiser ◄── pdm_policy_loss(π on support, mask registry)

Every rank holds an FSDP shard of the policy and its own vLLM engine (external launcher). One
step = one rollout batch = ``trainer.mini_batches`` optimiser steps, then one weight sync.
"""
from __future__ import annotations

import functools
import math
import random
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pdm_lab.advantages import group_advantages
from pdm_lab.runtime.lifetime import guard_rank

from pdm_lab.audit_live import flat_metrics

from .assets import check_model_config, load_data, load_tokenizer, model_dir, stop_token_ids
from .audit_step import audit_live_batch, write_record
from .checkpoint import intact_checkpoint, load_checkpoint, save_checkpoint, set_rng_state
from .config import TrainConfig, save_config
from .data import PromptSampler
from .distributed import Layout, all_reduce_max, all_reduce_sum, init_distributed, threads_per_rank
from .evaluate import evaluate
from .metrics_log import MetricsLog
from .mismatch_sample import MismatchSample
from .policy_model import DTYPES, PREFIX, load_lm, sequence_logprobs, shard_policy
from .rollout import (engine_dtype, generate, make_engine, outputs_to_batch, request_seed,
                      sampling_params, score_sequence, shutdown_engine, updates_in_place)
from .train_step import update_policy
from .verifiers import get_verifier, score_responses
from .weight_sync import check_names, check_sync, push_weights, rollout_weights, sync_tolerance


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def learning_rate(cfg: TrainConfig, optimizer_step: int) -> float:
    """Linear warm-up over ``trainer.warmup_steps`` optimiser steps, then constant (SPEC §7)."""
    warm = cfg.trainer.warmup_steps
    return cfg.trainer.lr * min(1.0, (optimizer_step + 1) / warm) if warm else cfg.trainer.lr


def make_optimizer(policy, t) -> torch.optim.Optimizer:
    """AdamW over the policy, fused (one kernel over all parameters) where this torch can."""
    kwargs = dict(lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay)
    try:
        return torch.optim.AdamW(policy.parameters(), fused=True, **kwargs)
    except (RuntimeError, TypeError):  # no fused kernel for this device or dtype
        return torch.optim.AdamW(policy.parameters(), foreach=True, **kwargs)


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


def check_layout(cfg: TrainConfig, lay: Layout) -> int:
    """Validate batch divisibility for this world; returns sequences per rank."""
    r, t = cfg.rollout, cfg.trainer
    if r.prompts_per_step % lay.dp:
        raise ValueError(f"rollout.prompts_per_step={r.prompts_per_step} must be divisible by the "
                         f"{lay.dp} data-parallel groups")
    seqs_group = r.prompts_per_step // lay.dp * r.group_size
    if seqs_group % lay.tp:
        raise ValueError(f"{seqs_group} sequences per data-parallel group do not split over "
                         f"tensor_parallel_size={lay.tp}")
    per_rank = seqs_group // lay.tp
    if per_rank % t.mini_batches:
        raise ValueError(f"{per_rank} sequences per rank do not split into trainer.mini_batches="
                         f"{t.mini_batches}")
    return per_rank


def run_training(cfg: TrainConfig) -> Path:
    """Train; returns the run directory. Collective: every rank calls it."""
    lay = init_distributed("auto", cfg.rollout.tensor_parallel_size)
    say = functools.partial(print, flush=True) if lay.is_main else (lambda *_: None)
    run_dir = cfg.resolved_run_dir
    per_rank = check_layout(cfg, lay)

    # ---- model, tokenizer, data (rank 0 builds cached assets first, the others then read them)
    if lay.is_main:
        path = model_dir(cfg)
    torch.distributed.barrier()
    path = model_dir(cfg)
    model_info = check_model_config(path)
    tokenizer = load_tokenizer(path)
    if lay.is_main:
        train_rows, eval_sets, reports = load_data(cfg, tokenizer, log=say)
    torch.distributed.barrier()
    train_rows, eval_sets, reports = load_data(cfg, tokenizer, log=lambda *_: None)
    stops = stop_token_ids(tokenizer, path)
    verifier = get_verifier(cfg.reward.verifier)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    longest = max(len(r.prompt_ids) for rows in [train_rows, *eval_sets.values()] for r in rows)
    max_len = cfg.rollout.max_model_len or longest + max(cfg.rollout.max_tokens, cfg.eval.max_tokens or 0)
    if lay.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml", header="# resolved config of this run")
        say(f"[train] {lay.world} ranks (dp {lay.dp} × tp {lay.tp}), model {model_info['architecture']} "
            f"vocab {model_info['vocab_size']}, {len(train_rows)} train prompts, eval sets "
            f"{ {k: len(v) for k, v in eval_sets.items()} }, run_dir {run_dir}")

    # ---- threads: before the engine, which then forbids changing them (on a tiny model one
    #      thread per rank beats several: per-matmul work is too small to split)
    threads = threads_per_rank(cfg.launch.threads_per_rank, model_info["hidden_size"], lay.local_world)
    torch.set_num_threads(threads)

    # ---- the rollout engine (seeds the global RNG: seed explicitly afterwards)
    llm = make_engine(str(path), cfg.rollout, k=cfg.mask.k, max_model_len=max_len, seed=cfg.seed,
                      data_parallel_size=lay.dp, distributed=True)
    seed_everything(cfg.seed * 1000 + lay.rank)

    # ---- the trainer
    lm = load_lm(str(path), seed=cfg.seed).to(lay.device)
    policy = shard_policy(lm, param_dtype=cfg.trainer.param_dtype, reduce_dtype=cfg.trainer.reduce_dtype,
                          gradient_checkpointing=cfg.trainer.gradient_checkpointing)
    check_names(policy, PREFIX)
    optimizer = make_optimizer(policy, cfg.trainer)
    sampler = PromptSampler(len(train_rows), seed=cfg.seed, shuffle=cfg.data.shuffle)

    # ---- resume
    start = 0
    resume = cfg.checkpoint.resume
    ckpt = None if resume == "never" else (intact_checkpoint(run_dir, say) if resume == "auto" else Path(resume))
    if ckpt is not None:
        extra = load_checkpoint(ckpt, policy, optimizer)
        sampler.load_state_dict(extra["sampler"])
        set_rng_state(extra["rng"])
        start = extra["step"]
        say(f"[train] resumed from {ckpt} at step {start}")
    log = MetricsLog(run_dir, tensorboard=cfg.log.tensorboard, resume_step=start, enabled=lay.is_main)
    mismatch_sample = MismatchSample(run_dir, enabled=lay.is_main)  # for `pdm-lab calibrate --from-run`

    # ---- the engine starts from the trainer's exact weights (after a resume too), checked once
    in_place = updates_in_place(cfg.rollout)
    push_weights(llm, rollout_weights(policy, cfg.rollout, PREFIX), in_place=in_place)
    fixed_seq = list(train_rows[0].prompt_ids) + tokenizer.encode(train_rows[0].answer, add_special_tokens=False)
    sync_error(llm, policy, fixed_seq, cfg, start)

    if start == 0 and cfg.eval.every and cfg.eval.at_start and eval_sets:
        t0 = time.perf_counter()
        ev = evaluate(llm, eval_sets, tokenizer, verifier, cfg, step=0, dp_rank=lay.dp_rank,
                      dp_size=lay.dp, count_here=lay.tp_rank == 0, stop_token_ids=stops)
        ev["time/eval_s"] = time.perf_counter() - t0
        log.log(0, ev)
        say("[eval] step 0 " + " ".join(f"{k}={v:.3f}" for k, v in ev.items() if k.startswith("eval/")))

    prompts_per_dp = cfg.rollout.prompts_per_step // lay.dp
    G = cfg.rollout.group_size
    for step in range(start + 1, cfg.total_steps + 1):
        t_step, cpu_step = time.perf_counter(), time.process_time()
        times: dict[str, float] = {}

        # 1. prompts: every rank draws the same global batch and takes its group's slice
        batch_idx = sampler.next_batch(cfg.rollout.prompts_per_step)
        lo = lay.dp_rank * prompts_per_dp
        mine = batch_idx[lo:lo + prompts_per_dp]
        rows = [train_rows[i] for i in mine]

        # 2. rollout with μ's top-K log-probs
        t0 = time.perf_counter()
        params = [sampling_params(n=G, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                  top_k=cfg.rollout.top_k, max_tokens=cfg.rollout.max_tokens,
                                  logprobs=cfg.mask.k, seed=request_seed(cfg.seed, cfg.rollout.seed,
                                                                         "train", step, lo + j),
                                  stop_token_ids=stops) for j in range(len(rows))]
        outputs = generate(llm, [list(r.prompt_ids) for r in rows], params)
        batch = outputs_to_batch(outputs, [list(r.prompt_ids) for r in rows], [r.answer for r in rows],
                                 k=cfg.mask.k, tokenizer=tokenizer)
        times["generate"] = time.perf_counter() - t0

        # 3. rewards; a failed verification leaves the sample out of the loss (logged)
        t0 = time.perf_counter()
        scores = score_responses(verifier, batch.texts, batch.answers, on_error=cfg.reward.on_error)
        for msg in scores.errors[:3]:
            say(f"[reward] step {step}: skipped {msg}")
        rewards = torch.tensor(scores.rewards, dtype=torch.float32)
        ok = torch.tensor(scores.ok, dtype=torch.bool)
        batch.response_mask &= ok[:, None]

        # 4. GRPO advantages over each prompt's group (complete inside this data-parallel group)
        adv = group_advantages(rewards, batch.group, ok, scale_by_std=cfg.algo.norm_by_std,
                               eps=cfg.algo.std_eps)
        if lay.tp > 1:  # the ranks of a tensor-parallel group train on different sequences
            part = list(range(lay.tp_rank * per_rank, (lay.tp_rank + 1) * per_rank))
            batch, rewards, ok, adv = batch.select(part), rewards[part], ok[part], adv[part]
        times["reward"] = time.perf_counter() - t0

        opt_step = (step - 1) * cfg.trainer.mini_batches
        # 5a. the direction audit on this batch (SPEC §6c): one step per rule from the same
        #     parameters and AdamW state, ΔD measured, everything restored bit-exactly
        audit_metrics = {}
        if cfg.audit.every and step % cfg.audit.every == 0:
            t0 = time.perf_counter()
            record = audit_live_batch(policy, optimizer, batch, adv, cfg=cfg, vocab_size=model_info["vocab_size"],
                                      pad_id=pad_id, lr=learning_rate(cfg, opt_step), device=lay.device)
            times["audit"] = time.perf_counter() - t0
            if lay.is_main:
                write_record(run_dir, step, cfg.seed, {**record, "time_s": times["audit"]})
            audit_metrics = flat_metrics(record, record["rules"])

        # 5. update: the registry's mask and loss on π over μ's support
        t0 = time.perf_counter()
        upd = update_policy(policy, optimizer, batch, adv, cfg=cfg, vocab_size=model_info["vocab_size"],
                            pad_id=pad_id, lr=learning_rate(cfg, opt_step), device=lay.device,
                            mismatch_sample=lambda stats, a, r: mismatch_sample.write(step, stats, a, r))
        times["train"] = time.perf_counter() - t0
        times["loss"] = upd.times["loss"]
        if "coupled" in upd.times:  # pdm_coupled's extra passes (SPEC §3b), its own timing line
            times["coupled"] = upd.times["coupled"]

        # 6. in-place weight sync into the running engine
        t0 = time.perf_counter()
        push_weights(llm, rollout_weights(policy, cfg.rollout, PREFIX), in_place=in_place)
        times["sync"] = time.perf_counter() - t0

        metrics = dict(upd.metrics)
        metrics.update(audit_metrics)
        if cfg.log.sync_check_every and step % cfg.log.sync_check_every == 0:
            metrics["sync/logp_max_abs_err"] = sync_error(llm, policy, fixed_seq, cfg, step)

        # 7. rollout metrics (global over ranks)
        resp_len = batch.response_mask.sum(dim=1).float()
        tot = all_reduce_sum([float(rewards[ok].sum()), float(ok.sum()), float(len(ok)),
                              float((rewards[ok] >= 1.0).sum()), float(resp_len.sum()),
                              float(batch.truncated.sum()), float((adv != 0).sum())])
        metrics.update({
            "reward/mean": tot[0] / max(tot[1], 1.0), "reward/accuracy": tot[3] / max(tot[1], 1.0),
            "rollout/skipped_samples": tot[2] - tot[1], "rollout/response_len": tot[4] / max(tot[2], 1.0),
            "rollout/truncated_frac": tot[5] / max(tot[2], 1.0),
            "rollout/nonzero_adv_frac": tot[6] / max(tot[2], 1.0),
            "data/epoch": float(sampler.epoch), "optim/lr": learning_rate(cfg, opt_step),
        })

        # 8. periodic evaluation
        if cfg.eval.every and step % cfg.eval.every == 0 and eval_sets:
            t0 = time.perf_counter()
            metrics.update(evaluate(llm, eval_sets, tokenizer, verifier, cfg, step=step, dp_rank=lay.dp_rank,
                                    dp_size=lay.dp, count_here=lay.tp_rank == 0, stop_token_ids=stops))
            times["eval"] = time.perf_counter() - t0
        times["step"] = time.perf_counter() - t_step
        # CPU seconds of this process (all its threads): on a shared machine, less load-dependent
        times["step_cpu"] = time.process_time() - cpu_step

        # 9. log (times: the slowest rank), before the checkpoint: a step whose checkpoint exists
        #    has its metrics line (a step logged but not checkpointed is redone and re-logged)
        keys = sorted(times)
        slowest = all_reduce_max([times[k] for k in keys] +
                                 [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)])
        metrics.update({f"time/{k}_s": v for k, v in zip(keys, slowest)})
        metrics["time/mask_loss_share"] = times["loss"] / max(times["step"], 1e-9)
        if "audit" in times:
            metrics["time/audit_share"] = times["audit"] / max(times["step"], 1e-9)
        metrics["mem/peak_rss_gib"] = slowest[-1]
        log.log(step, metrics)
        if step % cfg.log.print_every == 0 or step == cfg.total_steps:
            ev = " ".join(f"{k.split('/')[1]}={v:.3f}" for k, v in metrics.items() if k.startswith("eval/") and "@" in k)
            say(f"[train] step {step}/{cfg.total_steps} reward {metrics['reward/mean']:.3f} "
                f"len {metrics['rollout/response_len']:.1f} kl {metrics.get('mismatch/topk_kl_mean', math.nan):.2e} "
                f"drop {metrics.get('mask/frac_dropped', math.nan):.3f} | gen {metrics['time/generate_s']:.2f}s "
                f"train {metrics['time/train_s']:.2f}s sync {metrics['time/sync_s']:.3f}s "
                f"step {metrics['time/step_s']:.2f}s {ev}")

        # 10. checkpoint (after the step's sync: a resume re-syncs from these exact weights)
        every = cfg.checkpoint.every
        if (every and step % every == 0) or step == cfg.total_steps:
            t0 = time.perf_counter()
            save_checkpoint(run_dir, step, policy, optimizer,
                            {"step": step, "sampler": sampler.state_dict()}, cfg.checkpoint.keep_last)
            say(f"[train] checkpoint at step {step} ({time.perf_counter() - t0:.2f}s)")

    log.close()
    torch.distributed.barrier()
    shutdown_engine(llm)  # vLLM's shutdown also tears down the process group
    return run_dir


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
