"""One RL update on a rollout batch: mini-batches of micro-batches, the registry's mask and loss.

For each micro-batch: the support from the rollout's top-K (``pdm_lab.support.support_from_topk``,
padding rows replaced by trivial rows via ``row_mask``), π on it from the FSDP policy
(``pdm_lab.policy_side.policy_on_support`` inside ``PolicyModel``), then
``pdm_lab.loss.pdm_policy_loss`` — the same function the toys call. Nothing here re-derives a
mask, a divergence or Ḋ.

Aggregation across micro-batches and ranks: the core aggregates over the tokens it is given; to
get the aggregate over the whole mini-batch on all ranks (DAPO's token-mean is over every token
of the batch), each micro-batch's loss is scaled by (its share of the global count) × world size,
since FSDP averages gradients over ranks.
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from torch import Tensor

from pdm_lab.loss import pdm_policy_loss
from pdm_lab.metrics import step_metrics
from pdm_lab.policy_side import PolicyOnSupport
from pdm_lab.stats import TokenStats
from pdm_lab.support import support_from_topk

from .coupled import coupled_for_minibatch
from .policy_model import DTYPES
from .rollout import RolloutBatch


@dataclasses.dataclass
class MicroBatch:
    """Trainer tensors for b sequences; T = longest response, L = longest prompt + response.

    input_ids [b, L], attention_mask [b, L]; positions [N] flat (b·L) indices of the hidden
    states predicting the N response tokens (row-major over [b, T] with the response mask);
    response_mask [b, T]; advantages [b, T]; topk_ids [b·T, K]; topk_logp [b·T, K];
    sampled [b·T]; sampled_logp [b·T].
    """

    input_ids: Tensor
    attention_mask: Tensor
    positions: Tensor
    response_mask: Tensor
    advantages: Tensor
    topk_ids: Tensor
    topk_logp: Tensor
    sampled: Tensor
    sampled_logp: Tensor

    def to(self, device) -> "MicroBatch":
        return MicroBatch(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})

    @property
    def n_tokens(self) -> int:
        return int(self.response_mask.sum())

    @property
    def n_seqs(self) -> int:
        return int(self.response_mask.any(dim=1).sum())


def make_micro_batch(batch: RolloutBatch, rows: list[int], seq_adv: Tensor, pad_id: int) -> MicroBatch:
    """Assemble rows of a rollout batch (``seq_adv`` [B]: one advantage per sequence)."""
    sub = batch.select(rows)
    resp_len = sub.response_mask.sum(dim=1)
    t_max = max(int(resp_len.max()) if len(rows) else 1, 1)
    plens = [len(p) for p in sub.prompt_ids]
    width = max(p + int(r) for p, r in zip(plens, resp_len))
    b = len(rows)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    for i, (p, r) in enumerate(zip(sub.prompt_ids, resp_len.tolist())):
        input_ids[i, :len(p)] = torch.as_tensor(p)
        input_ids[i, len(p):len(p) + r] = sub.response_ids[i, :r]
        attention[i, :len(p) + r] = 1
    resp = sub.response_mask[:, :t_max]
    plen = torch.tensor(plens, dtype=torch.long)
    # response token j of row i is predicted by the hidden state at position plen_i + j − 1
    row, col = resp.nonzero(as_tuple=True)
    positions = row * width + plen[row] + col - 1
    k = sub.topk_ids.shape[-1]
    adv = seq_adv[torch.as_tensor(rows)].to(torch.float32)[:, None] * resp
    return MicroBatch(
        input_ids=input_ids, attention_mask=attention, positions=positions, response_mask=resp,
        advantages=adv, topk_ids=sub.topk_ids[:, :t_max].reshape(-1, k),
        topk_logp=sub.topk_logp[:, :t_max].reshape(-1, k),
        sampled=sub.response_ids[:, :t_max].reshape(-1),
        sampled_logp=sub.sampled_logp[:, :t_max].reshape(-1))


def micro_batch_support(mb: MicroBatch, mask_cfg, vocab_size: int):
    """μ's support for every [b·T] row (padding rows: the core's trivial rows)."""
    return support_from_topk(mb.topk_ids, mb.topk_logp, mb.sampled, mb.sampled_logp,
                             vocab_size=vocab_size, k=mask_cfg.k, convention=mask_cfg.convention,
                             row_mask=mb.response_mask.reshape(-1))


def micro_batch_policy(policy, mb: MicroBatch, support, temperature: float,
                       chunk_tokens: int | None) -> PolicyOnSupport:
    """π on the support for every [b·T] row: computed on response rows, padding rows set equal to
    the (trivial) μ row so they carry no divergence and no gradient."""
    valid = mb.response_mask.reshape(-1).nonzero(as_tuple=True)[0]
    logp_v, tail_v, sumsq_v = policy(mb.input_ids, mb.attention_mask, mb.positions,
                                     support.ids[valid], temperature, chunk_tokens)
    logp = support.mu_logp.to(logp_v.dtype).index_put((valid,), logp_v)
    tail = support.mu_tail_logp.to(tail_v.dtype).index_put((valid,), tail_v)
    sumsq = torch.full_like(tail, float("-inf")).index_put((valid,), sumsq_v)
    return PolicyOnSupport(logp=logp, tail_logp=tail, tail_log_sumsq=sumsq)


def _concat_stats(parts: list[TokenStats]) -> TokenStats:
    fields = {}
    for f in dataclasses.fields(TokenStats):
        vals = [getattr(p, f.name) for p in parts]
        if f.name == "ddot":
            fields[f.name] = {key: torch.cat([v[key] for v in vals]) for key in vals[0]}
        elif vals[0] is None:
            fields[f.name] = None
        else:
            fields[f.name] = torch.cat(vals)
    return TokenStats(**fields)


# metrics combined across ranks: weight of each key (default: response tokens)
_WEIGHT_OF = {"mask/dir_disagree": "outside", "mask/ddot_sign_certified": "outside",
              "mask/frac_dropped_pos": "pos", "mask/frac_dropped_neg": "neg"}


# the first mini-batch sees the rollout's μ against the trainer's π before any update
_MISMATCH_KEYS = {"div/topk_kl_mean": "mismatch/topk_kl_mean", "div/topk_kl_max": "mismatch/topk_kl_max",
                  "div/topk_tv_mean": "mismatch/topk_tv_mean", "ratio/min": "mismatch/ratio_min",
                  "ratio/max": "mismatch/ratio_max", "mask/frac_outside": "mismatch/frac_outside",
                  "mask/dir_disagree": "mismatch/dir_disagree"}


def reduce_metrics(local: dict[str, float], counts: dict[str, float]) -> dict[str, float]:
    """Combine per-rank metric dicts: weighted means, max of ``*_max``, min of ``*_min``, sums of
    ``tokens/*``. ``counts``: this rank's tokens / outside / pos / neg counts."""
    keys = sorted(local)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(local)
    sums = torch.zeros(2 * len(keys), dtype=torch.float64)
    maxes = torch.full((len(keys),), float("-inf"), dtype=torch.float64)
    mins = torch.full((len(keys),), float("inf"), dtype=torch.float64)
    for i, key in enumerate(keys):
        w = counts[_WEIGHT_OF.get(key, "tokens")]
        if key.endswith("_max"):
            maxes[i] = local[key] if counts["tokens"] > 0 else float("-inf")
        elif key.endswith("_min"):
            mins[i] = local[key] if counts["tokens"] > 0 else float("inf")
        elif key.startswith("tokens/"):
            sums[2 * i], sums[2 * i + 1] = local[key], 1.0
        else:
            sums[2 * i], sums[2 * i + 1] = local[key] * w, w
    dist.all_reduce(sums)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    dist.all_reduce(mins, op=dist.ReduceOp.MIN)
    out = {}
    for i, key in enumerate(keys):
        if key.endswith("_max"):
            out[key] = float(maxes[i]) if maxes[i] > float("-inf") else 0.0
        elif key.endswith("_min"):
            out[key] = float(mins[i]) if mins[i] < float("inf") else 0.0
        elif key.startswith("tokens/"):
            out[key] = float(sums[2 * i])
        else:
            out[key] = float(sums[2 * i] / sums[2 * i + 1]) if sums[2 * i + 1] > 0 else 0.0
    return out


def _global_counts(n_tokens: int, n_seqs: int) -> tuple[float, float]:
    t = torch.tensor([float(n_tokens), float(n_seqs)], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return float(t[0]), float(t[1])


def _all_sum(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return float(t[0])


def split(n: int, parts: int) -> list[list[int]]:
    """``range(n)`` in ``parts`` contiguous chunks of equal size (n must divide)."""
    if n % parts:
        raise ValueError(f"{n} sequences do not split into {parts} equal parts")
    size = n // parts
    return [list(range(i, i + size)) for i in range(0, n, size)]


@dataclasses.dataclass
class UpdateResult:
    """Metrics of the update (floats, reduced over ranks) and its time split (seconds, rank-local)."""

    metrics: dict[str, float]
    times: dict[str, float]


def update_policy(policy, optimizer, batch: RolloutBatch, seq_adv: Tensor, *, cfg, vocab_size: int,
                  pad_id: int, lr: float, device=None) -> UpdateResult:
    """One pass over the batch: ``trainer.mini_batches`` optimiser steps (SPEC §7: one PPO epoch).

    Args:
        policy: the FSDP-wrapped ``PolicyModel``.
        optimizer: over ``policy.parameters()``.
        batch: this rank's rollouts (B sequences).
        seq_adv: [B] per-sequence advantages (0 for skipped samples, whose tokens are masked).
        cfg: the TrainConfig (mask, trainer, rollout sections).
        vocab_size: the model's vocabulary size n.
        pad_id: padding token id for the trainer's inputs.
        lr: learning rate for these optimiser steps.
        device: where the trainer runs (default CPU).
    """
    mask_cfg, tcfg = cfg.mask, cfg.trainer
    world = dist.get_world_size() if dist.is_initialized() else 1
    per_token = mask_cfg.aggregation == "token-mean"
    for group in optimizer.param_groups:
        group["lr"] = lr
    times = {"forward_backward": 0.0, "loss": 0.0, "optimizer": 0.0}
    metrics: dict[str, float] = {}
    for mb_index, mini in enumerate(split(len(batch), tcfg.mini_batches)):
        micro_rows = [mini[i:i + tcfg.micro_batch_size] for i in range(0, len(mini), tcfg.micro_batch_size)]
        micros = [make_micro_batch(batch, rows, seq_adv, pad_id).to(device or "cpu") for rows in micro_rows]
        n_tok, n_seq = _global_counts(sum(m.n_tokens for m in micros), sum(m.n_seqs for m in micros))
        stats_parts, keep_parts, adv_parts, resp_parts = [], [], [], []
        loss_total = 0.0
        coupled, coupled_info = [None] * len(micros), {}
        if "coupled" in mask_cfg.rule_record.needs:  # SPEC §3b: c_t before the loss (scaling/coupled.py)
            t0 = time.perf_counter()
            coupled, coupled_info = coupled_for_minibatch(
                policy, optimizer, micros, [micro_batch_support(mb, mask_cfg, vocab_size) for mb in micros],
                lambda m, s: micro_batch_policy(policy, m, s, cfg.rollout.temperature, tcfg.logits_chunk_tokens),
                mask_cfg, compute_dtype=DTYPES[tcfg.param_dtype])
            times["coupled"] = times.get("coupled", 0.0) + time.perf_counter() - t0
        for mb, c in zip(micros, coupled):
            t0 = time.perf_counter()
            support = micro_batch_support(mb, mask_cfg, vocab_size)
            pi = micro_batch_policy(policy, mb, support, cfg.rollout.temperature, tcfg.logits_chunk_tokens)
            t1 = time.perf_counter()
            out = pdm_policy_loss(pi, support, mb.advantages, mb.response_mask, mask_cfg, coupled=c)
            t2 = time.perf_counter()
            share = (mb.n_tokens / max(n_tok, 1.0)) if per_token else (mb.n_seqs / max(n_seq, 1.0))
            (out.loss * (share * world)).backward()
            t3 = time.perf_counter()
            times["loss"] += t2 - t1
            times["forward_backward"] += (t1 - t0) + (t3 - t2)
            loss_total += float(out.loss.detach()) * share
            stats_parts.append(out.stats)
            keep_parts.append(out.keep.reshape(-1))
            adv_parts.append(mb.advantages.reshape(-1))
            resp_parts.append(mb.response_mask.reshape(-1))
        t0 = time.perf_counter()
        grad_norm = None
        if tcfg.grad_clip is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), tcfg.grad_clip)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times["optimizer"] += time.perf_counter() - t0
        t1 = time.perf_counter()
        adv, resp = torch.cat(adv_parts), torch.cat(resp_parts).bool()
        local = {k: float(v) for k, v in step_metrics(_concat_stats(stats_parts), torch.cat(keep_parts),
                                                       adv, resp, mask_cfg).items()}
        times["loss"] += time.perf_counter() - t1
        counts = {"tokens": float(resp.sum()), "pos": float((resp & (adv > 0)).sum()),
                  "neg": float((resp & (adv < 0)).sum()),
                  "outside": local.get("mask/frac_outside", 0.0) * float(resp.sum())}
        reduced = reduce_metrics(local, counts)
        reduced.update(coupled_info)  # already global
        reduced["loss/policy"] = _all_sum(loss_total)  # the shares sum to 1 over micro-batches and ranks
        if grad_norm is not None:
            reduced["loss/grad_norm"] = float(grad_norm)
        if mb_index == 0:  # before any optimiser step of this batch: the realised mismatch
            metrics.update({new: reduced[old] for old, new in _MISMATCH_KEYS.items() if old in reduced})
        for key, value in reduced.items():
            metrics.setdefault(key, 0.0)
            if key.endswith("_max"):
                metrics[key] = max(metrics[key], value) if mb_index else value
            elif key.endswith("_min"):
                metrics[key] = min(metrics[key], value) if mb_index else value
            elif key.startswith("tokens/"):
                metrics[key] += value
            else:
                metrics[key] += value / tcfg.mini_batches
    return UpdateResult(metrics=metrics, times=times)
