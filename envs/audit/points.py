"""The audited policy at a training step: plain GRPO under the audited mismatch (SPEC §6, audit
points).

The paper audits mid-training batches, so the audit trains its policy before drawing a batch:
``train_runs`` independent runs (run r: its own initial weights and rollouts), each trained with
rule ``none`` and Adam under the audited mismatch, and read at every step of ``audit_at``. Audit
seed s reads run s mod ``train_runs`` and draws its own fresh batch there, as the paper's 61
seeds each drew a fresh rollout. Trained weights are kept in memory and, with a store folder,
as ``policy_<r>_at_<step>.pt`` (tensors only, read back with ``weights_only=True``) beside the
training configuration they came from, so a resumed audit does not retrain and an audit with
another training configuration in the same folder retrains instead of reading them.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from pdm_lab.lab.advantages import group_advantages
from pdm_lab.mask_config import MaskConfig

from pdm_lab.envs.audit.config import TRAIN_PRECISIONS
from pdm_lab.envs.audit.sft import sft_on_accepted
from pdm_lab.envs.problems.mismatch import Mismatch
from pdm_lab.envs.policies.models import make_policy
from pdm_lab.envs.problems.rollout import RolloutRNG
from pdm_lab.envs.train.grpo import TrainConfig, make_optimizer
from pdm_lab.envs.train.update import masked_loss, token_batch

#: RolloutRNG seeds of the training runs (apart from the audit seeds' own batches).
TRAIN_SEED_BASE = 20_000


def plain_config(cfg) -> TrainConfig:
    """The plain GRPO run the audit trains with (rule ``none``, Adam — AdamW when the audited step is
    AdamW's, whose state the audit then carries — the audited mismatch)."""
    return TrainConfig(problem=cfg.problem, policy=cfg.policy, hidden=cfg.hidden,
                       optimizer="adamw" if cfg.optimizer == "adamw" else "adam",
                       mask=MaskConfig(rule="none", k=cfg.k, convention=cfg.convention),
                       mismatch=cfg.mismatch, lr=cfg.train_lr, groups_per_step=cfg.train_groups,
                       group_size=cfg.group_size)


def training_key(cfg) -> str:
    """Everything a trained policy depends on (the audit-only fields left out), as stored text."""
    plain = plain_config(cfg)
    doc = {"problem": repr(cfg.problem), "policy": cfg.policy, "hidden": cfg.hidden, "init_scale": cfg.init_scale,
           "train_precision": cfg.train_precision,
           "context_features": cfg.context_features, "warmup_steps": cfg.warmup_steps, "mismatch": cfg.mismatch,
           **({"sft_steps": cfg.sft_steps, "sft_lr": cfg.sft_lr} if cfg.sft_steps else {}),
           "mask": repr(plain.mask), "lr": plain.lr, "optimizer": plain.optimizer,
           "groups_per_step": plain.groups_per_step, "group_size": plain.group_size}
    return json.dumps(doc, sort_keys=True)


def plain_step(plain: TrainConfig, policy: nn.Module, opt, batch) -> None:
    """One GRPO step on `batch` with the plain rule (the core's loss, token-mean)."""
    tokens = token_batch(batch, group_advantages(batch.rewards, batch.groups), plain.mask)
    out = masked_loss(policy, tokens, plain.mask)
    opt.zero_grad(set_to_none=True)
    out.loss.backward()
    opt.step()


def new_policy(cfg, problem, run: int) -> nn.Module:
    """Run `run`'s initial policy (seeded by the run, in ``cfg.train_precision``: the same initial
    draw in either dtype)."""
    policy = make_policy(cfg.policy, problem.encoder, problem.prior, seed=run, hidden=cfg.hidden,
                         init_scale=cfg.init_scale, context_features=cfg.context_features)
    return policy.to(TRAIN_PRECISIONS[cfg.train_precision])


class TrainedPolicies:
    """Run r's policy at step s, trained once and reused by every audit seed that reads it."""

    def __init__(self, cfg, problem, store: str | Path | None = None):
        self.cfg, self.problem = cfg, problem
        self.store = None if store is None else Path(store)
        self._runs: dict[int, tuple[int, nn.Module, object, RolloutRNG]] = {}
        self._snapshots: dict[tuple[int, int], dict] = {}

    def _path(self, run: int, step: int) -> Path | None:
        return None if self.store is None else self.store / f"policy_{run}_at_{step}.pt"

    def at(self, run: int, step: int) -> nn.Module:
        """Run `run`'s policy after `step` training steps (a fresh module each call); with AdamW its
        optimiser's state at that step rides along as ``policy.trained_optimizer_state``."""
        saved = self._snapshots.get((run, step))
        path = self._path(run, step)
        if saved is None and path is not None and path.exists():
            stored = torch.load(path, weights_only=True)  # tensors only: a crafted file runs no code
            if isinstance(stored, dict) and stored.get("training") == training_key(self.cfg):
                saved = {"state": stored["state"], "optimizer": stored.get("optimizer")}
        if saved is not None:
            self._snapshots[(run, step)] = saved
            policy = new_policy(self.cfg, self.problem, run)
            policy.load_state_dict(saved["state"])
            if saved["optimizer"] is not None:
                policy.trained_optimizer_state = saved["optimizer"]
            return policy
        state = self._runs.get(run)
        if state is None or state[0] > step:
            state = self._start(run)
        done, policy, opt, rng = state
        plain = plain_config(self.cfg)
        mismatch = Mismatch.parse(self.cfg.mismatch)
        for now in range(done, step + 1):
            if now in self.cfg.audit_at or now == step:  # every audit point on the way is kept
                self._save_point(run, now, policy, opt)
            if now < step:
                batch = self.problem.collect(policy, mismatch, plain.groups_per_step, plain.group_size, rng)
                plain_step(plain, policy, opt, batch)
        self._runs[run] = (step, policy, opt, rng)
        return self.at(run, step)

    def _save_point(self, run: int, step: int, policy: nn.Module, opt) -> None:
        state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
        memory = None
        if isinstance(opt, torch.optim.AdamW):  # per parameter (in order): step, exp_avg, exp_avg_sq
            memory = [{k: v.detach().clone() for k, v in opt.state[p].items()} if p in opt.state else {}
                      for p in policy.parameters()]
        saved = {"state": state, "optimizer": memory}
        self._snapshots[(run, step)] = saved
        path = self._path(run, step)
        if path is not None:  # written anew when it holds another training configuration's weights
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            torch.save({"training": training_key(self.cfg), **saved}, tmp)
            tmp.replace(path)

    def _start(self, run: int):
        policy = new_policy(self.cfg, self.problem, run)
        plain = plain_config(self.cfg)
        if self.cfg.sft_steps:  # the loop's supervised warm-up, on the policy's own accepted responses
            sft_on_accepted(policy, self.problem, steps=self.cfg.sft_steps, lr=self.cfg.sft_lr,
                            groups=plain.groups_per_step, group_size=plain.group_size, run=run)
        if self.cfg.warmup_steps:  # on-policy steps without mismatch, before the audited training
            warm = make_optimizer(plain.optimizer, policy.parameters(), plain.lr)
            rng = RolloutRNG(10_000 + run)
            for _ in range(self.cfg.warmup_steps):
                plain_step(plain, policy, warm, self.problem.collect(policy, Mismatch(), plain.groups_per_step,
                                                                    plain.group_size, rng))
        opt = make_optimizer(plain.optimizer, policy.parameters(), plain.lr)
        return (0, policy, opt, RolloutRNG(TRAIN_SEED_BASE + run))
