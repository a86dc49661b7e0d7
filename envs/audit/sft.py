"""Supervised fine-tuning of a toy policy on its own accepted responses, before the audited training.

The loop's model is a network trained by supervised warm-up (``model.tiny.sft_steps``) before RL;
its kernel K = J Jᵀ is a trained network's. A toy's network starts untrained beside the frozen
prior (the "pretrained model"). ``sft_on_accepted`` gives it the loop's history: each step samples
responses from the policy itself (no mismatch), keeps the accepted ones (reward > 0: rejection
sampling, as in RFT/STaR) and takes one AdamW step on their token-mean cross-entropy. The prior
already is the best fit to its own samples, so only the filtering moves the network: what it
learns is the task, as the loop's SFT does.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from pdm_lab.envs.problems.mismatch import Mismatch
from pdm_lab.envs.problems.rollout import RolloutRNG
from pdm_lab.envs.train.grpo import make_optimizer

#: RolloutRNG seeds of the SFT rollouts (apart from the training and audit batches).
SFT_SEED_BASE = 30_000


def sft_on_accepted(policy: nn.Module, problem, *, steps: int, lr: float, groups: int, group_size: int,
                    run: int = 0) -> dict:
    """`steps` AdamW steps of cross-entropy on the accepted responses of the policy's own samples.

    Returns ``{"sft/steps", "sft/accepted_first", "sft/accepted_last", "sft/nll_first", "sft/nll_last"}``
    (the accepted fraction of a step's samples, and the mean NLL of its accepted tokens); a step with
    no accepted response takes no optimiser step.
    """
    opt = make_optimizer("adamw", policy.parameters(), lr)
    rng = RolloutRNG(SFT_SEED_BASE + run)
    history = []
    for step in range(steps):
        batch = problem.collect(policy, Mismatch(), groups, group_size, rng)
        accepted = batch.rewards > 0
        mask = batch.response_mask & accepted[:, None]
        if not bool(mask.any()):
            history.append((0.0, float("nan")))
            continue
        logp = torch.log_softmax(policy(batch.obs[mask]), dim=-1)
        nll = -logp.gather(1, batch.tokens[mask][:, None]).mean()
        if not torch.isfinite(nll):
            raise FloatingPointError(f"sft step {step}: the cross-entropy is {float(nll)} (lr {lr} too large?)")
        opt.zero_grad(set_to_none=True)
        nll.backward()
        opt.step()
        history.append((float(accepted.float().mean()), float(nll.detach())))
    out = {"sft/steps": steps, "sft/accepted_first": history[0][0], "sft/accepted_last": history[-1][0],
           "sft/nll_first": history[0][1], "sft/nll_last": history[-1][1]}
    print(f"sft (run {run}): accepted {out['sft/accepted_first']:.2f} → {out['sft/accepted_last']:.2f}, "
          f"NLL {out['sft/nll_first']:.3g} → {out['sft/nll_last']:.3g} over {steps} steps", file=sys.stderr)
    return out
