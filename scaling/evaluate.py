"""Periodic evaluation: avg@k (mean reward over k samples per held-out prompt) and pass@k.

The data-parallel groups split each evaluation set; every group gets the same number of prompts
(the last ones padded with repeats that are not counted), because the engines of a data-parallel
run step in lock-step and every rank must call ``generate`` the same number of times.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .rollout import generate, request_seed, sampling_params
from .verifiers import score_responses


def evaluate(llm, eval_sets: dict, tokenizer, verifier, cfg, *, step: int, dp_rank: int,
             dp_size: int, count_here: bool, stop_token_ids: list[int]) -> dict[str, float]:
    """avg@k, pass@k and mean response length per evaluation set (collective over ranks).

    Args:
        eval_sets: name → list of PromptRow.
        count_here: this rank's results count (False on all but one rank of a tensor-parallel
            group, whose engines produce identical outputs).
    """
    ecfg = cfg.eval
    k = ecfg.k
    max_tokens = ecfg.max_tokens or cfg.rollout.max_tokens
    out: dict[str, float] = {}
    for name, rows in eval_sets.items():
        rows = rows[:ecfg.max_prompts] if ecfg.max_prompts else rows
        per_rank = -(-len(rows) // dp_size)
        mine = list(range(dp_rank, len(rows), dp_size))
        counted = [True] * len(mine) + [False] * (per_rank - len(mine))
        mine = mine + [mine[0] if mine else 0] * (per_rank - len(mine))
        params = [sampling_params(n=k, temperature=ecfg.temperature, top_p=cfg.rollout.top_p,
                                  top_k=cfg.rollout.top_k, min_p=cfg.rollout.min_p, max_tokens=max_tokens, logprobs=None,
                                  seed=request_seed(cfg.seed, "eval", name, step, i),
                                  stop_token_ids=stop_token_ids) for i in mine]
        outputs = generate(llm, [list(rows[i].prompt_ids) for i in mine], params)
        sums = torch.zeros(5, dtype=torch.float64)  # reward sum, samples, pass, prompts, tokens
        for i, is_counted, res in zip(mine, counted, outputs):
            if not (is_counted and count_here):
                continue
            texts = tokenizer.batch_decode([c.token_ids for c in res.outputs], skip_special_tokens=True)
            scores = score_responses(verifier, texts, [rows[i].answer] * len(texts), on_error="skip")
            sums += torch.tensor([sum(scores.rewards), len(texts), float(max(scores.rewards) >= 1.0),
                                  1.0, sum(len(c.token_ids) for c in res.outputs)], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(sums)
        out[f"eval/{name}/avg@{k}"] = float(sums[0] / sums[1].clamp(min=1))
        out[f"eval/{name}/pass@{k}"] = float(sums[2] / sums[3].clamp(min=1))
        out[f"eval/{name}/response_len"] = float(sums[4] / sums[1].clamp(min=1))
    return out
