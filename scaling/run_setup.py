"""What a run builds once before its first step (run on every rank): the layout, the model's
files, tokenizer and data, the rollout engine, the sharded trainer and its optimiser, a resume,
and the first weight sync. ``scaling.loop.run_training`` then steps over the ``Run`` it returns.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .assets import check_model_config, load_data, load_tokenizer, model_dir, stop_token_ids
from .checkpoint import intact_checkpoint, load_checkpoint, set_rng_state
from .config import TrainConfig, save_config
from .data import PromptSampler
from .distributed import Layout, init_distributed, threads_per_rank
from .metrics_log import MetricsLog
from .mismatch_sample import MismatchSample
from .policy_model import PREFIX, load_lm, shard_policy
from .rollout import make_engine, updates_in_place
from .verifiers import get_verifier
from .weight_sync import check_names, push_weights, rollout_weights


@dataclass
class Run:
    """Everything a step reads: the config, this rank's place, the data, engine and trainer."""

    cfg: TrainConfig
    lay: Layout
    say: Callable[..., None]             # prints on rank 0 only
    run_dir: Path
    per_rank: int                        # sequences each rank trains on per step
    model_info: dict[str, Any]
    tokenizer: Any
    train_rows: list
    eval_sets: dict[str, list]
    stops: list[int]                     # stop token ids
    verifier: Callable
    pad_id: int
    llm: Any = None                      # the vLLM engine
    policy: Any = None                   # the FSDP2-sharded policy
    optimizer: torch.optim.Optimizer | None = None
    sampler: PromptSampler | None = None
    log: MetricsLog | None = None
    mismatch_sample: MismatchSample | None = None
    in_place: bool = True                # weights pushed into the running engine in place
    fixed_seq: list[int] | None = None   # the sequence the weight-sync check scores
    start: int = 0                       # the last completed step (a resume's)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def make_optimizer(policy, t) -> torch.optim.Optimizer:
    """AdamW over the policy, fused (one kernel over all parameters) where this torch can."""
    kwargs = dict(lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay)
    try:
        return torch.optim.AdamW(policy.parameters(), fused=True, **kwargs)
    except (RuntimeError, TypeError):  # no fused kernel for this device or dtype
        return torch.optim.AdamW(policy.parameters(), foreach=True, **kwargs)


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


def load_assets(cfg: TrainConfig, lay: Layout, per_rank: int) -> tuple[Run, Path]:
    """Model files, tokenizer, data, verifier (rank 0 builds cached assets first, the others then
    read them); writes the resolved config on rank 0."""
    say = functools.partial(print, flush=True) if lay.is_main else (lambda *_: None)
    run_dir = cfg.resolved_run_dir
    if lay.is_main:
        model_dir(cfg)
    torch.distributed.barrier()
    path = model_dir(cfg)
    model_info = check_model_config(path)
    tokenizer = load_tokenizer(path)
    if lay.is_main:
        load_data(cfg, tokenizer, log=say)
    torch.distributed.barrier()
    train_rows, eval_sets, _ = load_data(cfg, tokenizer, log=lambda *_: None)
    stops = stop_token_ids(tokenizer, path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    if lay.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml", header="# resolved config of this run")
        say(f"[train] {lay.world} ranks (dp {lay.dp} × tp {lay.tp}), model {model_info['architecture']} "
            f"vocab {model_info['vocab_size']}, {len(train_rows)} train prompts, eval sets "
            f"{ {k: len(v) for k, v in eval_sets.items()} }, run_dir {run_dir}")
    return Run(cfg=cfg, lay=lay, say=say, run_dir=run_dir, per_rank=per_rank, model_info=model_info,
               tokenizer=tokenizer, train_rows=train_rows, eval_sets=eval_sets, stops=stops,
               verifier=get_verifier(cfg.reward.verifier), pad_id=pad_id), path


def start_engine(run: Run, path: Path) -> None:
    """Threads, then the rollout engine (which forbids changing them afterwards and seeds the
    global RNG: seeded explicitly after it)."""
    cfg, lay = run.cfg, run.lay
    # on a tiny model one thread per rank beats several: per-matmul work is too small to split
    torch.set_num_threads(threads_per_rank(cfg.launch.threads_per_rank, run.model_info["hidden_size"],
                                           lay.local_world))
    longest = max(len(r.prompt_ids) for rows in [run.train_rows, *run.eval_sets.values()] for r in rows)
    max_len = cfg.rollout.max_model_len or longest + max(cfg.rollout.max_tokens, cfg.eval.max_tokens or 0)
    run.llm = make_engine(str(path), cfg.rollout, k=cfg.mask.k, max_model_len=max_len, seed=cfg.seed,
                          data_parallel_size=lay.dp, distributed=True)
    seed_everything(cfg.seed * 1000 + lay.rank)


def build_trainer(run: Run, path: Path) -> None:
    """The sharded policy, its optimiser and the prompt sampler."""
    cfg = run.cfg
    lm = load_lm(str(path), seed=cfg.seed).to(run.lay.device)
    run.policy = shard_policy(lm, param_dtype=cfg.trainer.param_dtype, reduce_dtype=cfg.trainer.reduce_dtype,
                              gradient_checkpointing=cfg.trainer.gradient_checkpointing)
    check_names(run.policy, PREFIX)
    run.optimizer = make_optimizer(run.policy, cfg.trainer)
    run.sampler = PromptSampler(len(run.train_rows), seed=cfg.seed, shuffle=cfg.data.shuffle)


def resume(run: Run) -> None:
    """Load the checkpoint ``checkpoint.resume`` names (``auto``: the last intact one), then open
    the metrics log truncated after the resumed step."""
    cfg, say = run.cfg, run.say
    mode = cfg.checkpoint.resume
    ckpt = None if mode == "never" else (intact_checkpoint(run.run_dir, say) if mode == "auto" else Path(mode))
    if ckpt is not None:
        extra = load_checkpoint(ckpt, run.policy, run.optimizer)
        run.sampler.load_state_dict(extra["sampler"])
        set_rng_state(extra["rng"])
        run.start = extra["step"]
        say(f"[train] resumed from {ckpt} at step {run.start}")
    run.log = MetricsLog(run.run_dir, tensorboard=cfg.log.tensorboard, resume_step=run.start,
                         enabled=run.lay.is_main, config=cfg)
    # for `pdm-lab calibrate --from-run`
    run.mismatch_sample = MismatchSample(run.run_dir, enabled=run.lay.is_main)


def first_sync(run: Run) -> None:
    """The engine starts from the trainer's exact weights (after a resume too)."""
    run.in_place = updates_in_place(run.cfg.rollout)
    push_weights(run.llm, rollout_weights(run.policy, run.cfg.rollout, PREFIX), in_place=run.in_place)
    row = run.train_rows[0]
    run.fixed_seq = list(row.prompt_ids) + run.tokenizer.encode(row.answer, add_special_tokens=False)


def set_up_run(cfg: TrainConfig) -> Run:
    """Every rank: the layout, assets, engine, trainer, resume and first weight push."""
    lay = init_distributed("auto", cfg.rollout.tensor_parallel_size)
    run, path = load_assets(cfg, lay, check_layout(cfg, lay))
    start_engine(run, path)
    build_trainer(run, path)
    resume(run)
    first_sync(run)
    return run
