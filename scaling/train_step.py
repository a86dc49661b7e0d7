"""One RL update on a rollout batch: mini-batches of micro-batches, the registry's mask and loss.

For each micro-batch: the support from the rollout's top-K (``pdm_lab.support.support_from_topk``,
padding rows replaced by trivial rows via ``row_mask``), π on it from the FSDP policy
(``pdm_lab.policy_side.policy_on_support`` inside ``PolicyModel``), then
``pdm_lab.loss.pdm_policy_loss`` — the same function the toys call. Nothing here re-derives a
mask, a divergence or Ḋ.

Aggregation across micro-batches and ranks: the mini-batch's counts over every micro-batch and
rank are gathered once (``pdm_lab.aggregation.DPInfo.all_reduce``) and handed to the core's loss,
whose aggregate is then each micro-batch's share of the whole mini-batch's (DAPO's token-mean is
over every token of the batch; FSDP averages the ranks' gradients).

The kernel-aware rule (``pdm_kernel``, SPEC §6d): its h_t = ⟨Wᵀg, Wᵀv⟩ is computed in the same
forward as π (``PolicyModel.forward(on_head=...)``: the hidden states of the response tokens and
lm_head's weight as the forward holds it, so under FSDP2 the gathered weight and no extra
collective), without gradient, by the core's ``kernel_direction.kernel_scores`` on the processed
logits z = h Wᵀ/T with the unembedding of those logits, W/T (the probe's ``unembedding``, so a λ
fitted by ``probe/kernel_fit`` applies as is; W itself at T = 1), rows in chunks of at most
``KERNEL_CHUNK_ELEMENTS`` logits (``head_kernel_scores``); padding rows get c = 0.

Non-finite numbers: a mini-batch whose loss (on any rank) or global gradient norm is NaN or ±inf
is not stepped on: its gradients are dropped, the weights and the optimiser state stay as they
were, and ``UpdateResult.nonfinite`` says which mini-batch and which quantity (``loss``,
``gradient``, ``grad_norm``). Every rank makes the same decision (the loss flags are all-reduced,
the norm is global), and a rank whose loss failed still runs a zero backward through the same
graph, so FSDP's gradient collectives stay in step. ``scaling.loop`` counts such steps.

Staleness (SPEC §6b): mini-batch j is trained after j optimiser steps on the same rollouts, so the
D the mask sees there is numerics plus j steps of staleness. ``update_policy`` logs the regime
table of every mini-batch and pooled (``mismatch_sample.MiniBatchRegime``: ``mismatch/mb{j}/…``,
``mismatch/pooled/…``), hands every mini-batch's stats to the per-token sample, and calls
``before_step(j, rows)`` at the start of each mini-batch — the state the mask acts in on
mini-batch j, after the j real steps and their AdamW state — where the live audit runs (SPEC §6c).

One module of about 470 lines on purpose: a single update's order (micro-batches, support, π and
c, loss, the non-finite guard, the optimiser step) reads top to bottom here, and its pieces share
``MicroBatch`` and ``UpdateResult``.
"""
from __future__ import annotations

import dataclasses
import math
import time
import types

import torch
from torch import Tensor

from pdm_lab.aggregation import DPInfo
from pdm_lab.errors import PDMInputError, one_line
from pdm_lab.kernel_direction import kernel_scores
from pdm_lab.loss import LossOutput, pdm_policy_loss
from pdm_lab.loss_checks import gradient_flags
from pdm_lab.metrics import MetricSums, all_reduce_metrics, as_mismatch, finalize_floats, merge_metrics, metric
from pdm_lab.padding import policy_with_padding_rows
from pdm_lab.policy_side import PolicyOnSupport
from pdm_lab.sampling_mask import SamplingMask, engine_kept, on_sampling_set
from pdm_lab.support import Support, support_from_topk

from pdm_lab.lab.minibatches import split  # noqa: F401  (the one split, shared with the toy audit)

from .coupled_fd import coupled_for_minibatch
from .distributed import all_reduce_max
from .mismatch_sample import MiniBatchRegime
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


KERNEL_CHUNK_ELEMENTS = 1 << 22
"""``head_kernel_scores``: at most this many [rows, V] logits per chunk (each float64 [rows, V]
tensor of ``kernel_scores`` is then ≤ 32 MiB, whatever N)."""


@torch.no_grad()
def head_kernel_scores(h: Tensor, weight: Tensor, support: Support, temperature: float, *,
                       chunk_elements: int | None = None) -> Tensor:
    """[n] float64 c_t = ⟨W̃ᵀg_t, W̃ᵀv_t⟩ of ``pdm_kernel`` (``kernel_direction.kernel_scores``) for the
    processed logits z = h Wᵀ / T and their unembedding W̃ = W/T (module docstring).

    Args:
        h: [n, H] the hidden states of the rows (the compute dtype).
        weight: W [V, H], lm_head's full weight (tied models: the embedding).
        support: μ's support of the same n rows.
        temperature: T.
        chunk_elements: rows are processed in chunks of at most this many logits, at least one row
            (None: ``KERNEL_CHUNK_ELEMENTS``).

    z is h Wᵀ in the compute dtype (the loss's own logits), then divided by T in float64; W̃ is
    cast to float64 once ([V, H]: the one extra tensor besides each chunk's).
    """
    w = weight.detach().double() / temperature
    out = [torch.zeros(0, dtype=torch.float64, device=h.device)]
    step = max(1, (chunk_elements or KERNEL_CHUNK_ELEMENTS) // max(w.shape[0], 1))
    for i in range(0, h.shape[0], step):
        z = (h[i:i + step].detach() @ weight.detach().t()).double() / temperature
        out.append(kernel_scores(z, w, support.take_rows(slice(i, i + step))))
    return torch.cat(out)


def micro_batch_policy(policy, mb: MicroBatch, support, temperature: float,
                       chunk_tokens: int | None, sampling: SamplingMask | None = None) -> PolicyOnSupport:
    """π on the support for every [b·T] row: computed on response rows, padding rows set equal to
    the (trivial) μ row so they carry no divergence and no gradient. With the engine's sampling
    mask (``rollout.keep_sampling_mask``), π over the sampling set, the engine's own cut on S
    (``pdm_lab.sampling_mask``), and ``tail_count`` = |C ∖ S| (padding rows: the support's)."""
    return _policy_rows(policy, mb, support, temperature, chunk_tokens, sampling)[0]


def micro_batch_policy_kernel(policy, mb: MicroBatch, support: Support, temperature: float,
                              chunk_tokens: int | None) -> tuple[PolicyOnSupport, Tensor]:
    """``micro_batch_policy`` and, from the same forward, ``pdm_kernel``'s c [b·T] float64
    (``head_kernel_scores`` on the response rows; 0 on padding rows). No sampling mask: c is
    defined on the full softmax."""
    return _policy_rows(policy, mb, support, temperature, chunk_tokens, None, kernel=True)


def _policy_rows(policy, mb: MicroBatch, support: Support, temperature: float, chunk_tokens: int | None,
                 sampling: SamplingMask | None, kernel: bool = False) -> tuple[PolicyOnSupport, Tensor | None]:
    valid = mb.response_mask.reshape(-1).nonzero(as_tuple=True)[0]
    extra = {} if sampling is None else {"sampling": sampling, "keep_on_support": engine_kept(support)[valid]}
    scores: dict[str, Tensor] = {}
    if kernel:
        rows = support.take_rows(valid)
        extra["on_head"] = lambda h, weight: scores.__setitem__(
            "c", head_kernel_scores(h, weight, rows, temperature))
    out = policy(mb.input_ids, mb.attention_mask, mb.positions, support.ids[valid], temperature, chunk_tokens,
                 **extra)
    pi = policy_with_padding_rows(support, valid, PolicyOnSupport(logp=out[0], tail_logp=out[1],
                                                                  tail_log_sumsq=out[2]))
    if len(out) == 4:
        pi = dataclasses.replace(pi, tail_count=support.tail_count.index_put((valid,), out[3]))
    if not kernel:
        return pi, None
    c = torch.zeros(support.ids.shape[0], dtype=torch.float64, device=scores["c"].device)
    return pi, c.index_put((valid.to(c.device),), scores["c"])


def policy_and_support(policy, mb: MicroBatch, support: Support, temperature: float, chunk_tokens: int | None,
                       sampling: SamplingMask | None = None,
                       kernel: bool = False) -> tuple[PolicyOnSupport, Support, Tensor | None]:
    """π on the support, the support whose tail is counted inside the sampling set
    (``sampling_mask.on_sampling_set``; unchanged without a sampling mask) and, with ``kernel``,
    ``pdm_kernel``'s c from the same forward (``micro_batch_policy_kernel``; else None)."""
    if kernel and sampling is not None:
        raise PDMInputError("pdm_kernel: h_t = ⟨Wᵀg, Wᵀv⟩ is defined on the full softmax, not on the engine's "
                            "sampling set (set rollout.keep_sampling_mask: false, or no top-k/top-p/min-p cut)")
    pi, c = _policy_rows(policy, mb, support, temperature, chunk_tokens, sampling, kernel=kernel)
    return pi, on_sampling_set(support, pi.tail_count), c


def micro_batch_loss(policy, mb: MicroBatch, mask_cfg, *, vocab_size: int, temperature: float,
                     chunk_tokens: int | None, dp: DPInfo | None = None, coupled: Tensor | None = None,
                     sampling: SamplingMask | None = None) -> tuple[LossOutput, float]:
    """The loop's loss path for one micro-batch: μ's support, π on it (over the engine's
    sampling set when `sampling` is given), the core's loss (this micro-batch's share of the
    mini-batch's aggregate, `dp`). A rule that needs ``kernel`` (``pdm_kernel``) gets its c from
    the same forward. Also returns the seconds spent in the support and π (the rest is the loss's)."""
    t0 = time.perf_counter()
    pi, support, kernel = policy_and_support(policy, mb, micro_batch_support(mb, mask_cfg, vocab_size), temperature,
                                             chunk_tokens, sampling, kernel=needs_kernel(mask_cfg))
    t1 = time.perf_counter()
    return pdm_policy_loss(pi, support, mb.advantages, mb.response_mask, mask_cfg, coupled=coupled, kernel=kernel,
                           dp=dp), t1 - t0


def needs_kernel(mask_cfg) -> bool:
    """The rule reads ``TokenStats.kernel`` (``pdm_kernel``): the loss path computes c_t."""
    return "kernel" in mask_cfg.rule_record.needs


def guarded_loss(policy, mb: MicroBatch, mask_cfg, *, vocab_size: int, temperature: float,
                 chunk_tokens: int | None, dp: DPInfo | None = None, coupled: Tensor | None = None,
                 sampling: SamplingMask | None = None) -> tuple[LossOutput | None, Tensor, str | None, float]:
    """``micro_batch_loss`` for the update: a non-finite loss (the core's ``loss: ...`` error) is
    returned, not raised. Returns (the loss output or None, the tensor to backward, the error's
    line or None, the seconds in the support and π). On a non-finite loss the tensor is a zero
    through π's graph: its backward reaches every parameter (FSDP's reduce-scatter runs as on the
    other ranks) and adds nothing. ``pdm_kernel``: c as in ``micro_batch_loss``."""
    t0 = time.perf_counter()
    pi, support, kernel = policy_and_support(policy, mb, micro_batch_support(mb, mask_cfg, vocab_size), temperature,
                                             chunk_tokens, sampling, kernel=needs_kernel(mask_cfg))
    t1 = time.perf_counter()
    try:
        out = pdm_policy_loss(pi, support, mb.advantages, mb.response_mask, mask_cfg, coupled=coupled, kernel=kernel,
                              dp=dp)
    except PDMInputError as err:
        if not str(err).startswith("loss:"):  # bad input, not a non-finite result
            raise
        return None, (pi.logp * 0.0).sum(), one_line(err, limit=600), t1 - t0
    return out, out.loss, None, t1 - t0


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """A mini-batch that was not stepped on: which quantity was NaN or ±inf, and where."""

    mini_batch: int
    quantity: str  # "loss" (on some rank), "gradient" (an entry), "grad_norm" (entries finite, the norm overflows)
    detail: str    # one line: the core's message, the first offending parameter, or the norm


class NonFiniteUpdate(RuntimeError):
    """Raised (on every rank together, after the skip) by ``update_policy`` when a caller that
    reads every micro-batch's output (``on_loss``: the direction audit) met a non-finite one."""

    def __init__(self, nonfinite: list[NonFinite]):
        first = nonfinite[0]
        super().__init__(f"non-finite {first.quantity} in mini-batch {first.mini_batch}: {first.detail}")
        self.nonfinite = nonfinite


@dataclasses.dataclass
class UpdateResult:
    """Metrics of the update (floats, reduced over ranks), its time split (seconds, rank-local)
    and the mini-batches skipped as non-finite (the same on every rank; empty: none)."""

    metrics: dict[str, float]
    times: dict[str, float]
    nonfinite: list[NonFinite] = dataclasses.field(default_factory=list)


def _local_grad(param) -> Tensor | None:
    grad = param.grad
    return grad.to_local() if grad is not None and hasattr(grad, "to_local") else grad


def gradient_norm(policy) -> tuple[Tensor | None, float | None]:
    """The global 2-norm of the gradients (over FSDP shards and ranks): the tensor to clip with and
    its value. Collective under FSDP; (None, None) without gradients."""
    grads = [p.grad for p in policy.parameters() if p.grad is not None]
    if not grads:
        return None, None
    norm = torch.nn.utils.get_total_norm(grads)
    value = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return norm, float(value)


def nonfinite_check(policy, mb_index: int, loss_error: str | None, norm: float | None) -> NonFinite | None:
    """The mini-batch's verdict, the same on every rank: a loss that failed on any rank (one
    all-reduce of a flag), else a non-finite global gradient norm, named by this rank's first
    non-finite gradient entry (``pdm_lab.loss_checks.gradient_flags`` on its shards)."""
    failed = all_reduce_max([1.0 if loss_error is not None else 0.0])[0] > 0
    if failed:
        return NonFinite(mb_index, "loss", loss_error or "non-finite loss on another rank")
    if norm is None or math.isfinite(norm):
        return None
    _, first = gradient_flags((name, types.SimpleNamespace(grad=_local_grad(p)))
                              for name, p in policy.named_parameters())
    if first is not None:
        return NonFinite(mb_index, "gradient", f"gradient norm {norm}; first non-finite entry: {first}")
    return NonFinite(mb_index, "grad_norm", f"gradient norm {norm}: every entry on this rank is finite; "
                     "the squared sum overflows (or another rank's shard holds the non-finite entry)")


def update_policy(policy, optimizer, batch: RolloutBatch, seq_adv: Tensor, *, cfg, vocab_size: int,
                  pad_id: int, lr: float, device=None, mismatch_sample=None, on_loss=None,
                  before_step=None) -> UpdateResult:
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
        mismatch_sample: callable ``(stats, adv, resp, mini_batch=j)`` given each micro-batch of
            every mini-batch j, its per-token stats as the mask sees them (after j steps on this
            batch; ``mismatch_sample.MismatchSample``); None: no sample.
        on_loss: callable ``(mb_index, micro_index, out)`` given each micro-batch's ``LossOutput``
            (its keep mask and stats; the direction audit reads them); None: nothing. With it, a
            non-finite mini-batch raises ``NonFiniteUpdate`` (after the skip, on every rank).
        before_step: callable ``(mb_index, rows)`` called at the start of each mini-batch, before
            its forward (``rows``: its sequences in ``batch``): the run's state when its mask acts on
            that mini-batch (the live audit, SPEC §6c, runs here and must leave the state as it found
            it); None: nothing.

    Metrics: the update's, the plain ``mismatch/*`` keys of mini-batch 0 (before any step), and the
    regime table per mini-batch and pooled (module docstring; ``mismatch_sample`` module docstring).

    A mini-batch whose loss or gradient is non-finite is not stepped on (module docstring): the
    result's ``nonfinite`` lists them and ``train/nonfinite`` & co. are in its metrics.
    """
    mask_cfg, tcfg = cfg.mask, cfg.trainer
    per_token = mask_cfg.aggregation == "token-mean"
    for group in optimizer.param_groups:
        group["lr"] = lr
    times = {"forward_backward": 0.0, "loss": 0.0, "optimizer": 0.0}
    sums: MetricSums = {}
    skipped: list[NonFinite] = []
    agreed = {"loss/policy", "loss/grad_norm"}  # keys every rank adds whatever its losses did
    regime = MiniBatchRegime(mask_cfg)
    for mb_index, mini in enumerate(split(len(batch), tcfg.mini_batches)):
        if before_step is not None:  # the state the mask acts in on this mini-batch (SPEC §6c)
            before_step(mb_index, mini)
        micro_rows = [mini[i:i + tcfg.micro_batch_size] for i in range(0, len(mini), tcfg.micro_batch_size)]
        micros = [make_micro_batch(batch, rows, seq_adv, pad_id).to(device or "cpu") for rows in micro_rows]
        dp = DPInfo.all_reduce(sum(m.n_tokens for m in micros), sum(m.n_seqs for m in micros))
        parts: list[MetricSums] = []
        loss_sum = loss_weight = 0.0  # Σ loss·w and Σ w over micro-batches (w: tokens or sequences)
        coupled, coupled_info = [None] * len(micros), {}
        if "coupled" in mask_cfg.rule_record.needs:  # SPEC §3b: c_t before the loss (scaling/coupled_fd.py)
            t0 = time.perf_counter()
            coupled, coupled_info = coupled_for_minibatch(
                policy, optimizer, micros, [micro_batch_support(mb, mask_cfg, vocab_size) for mb in micros],
                lambda m, s: micro_batch_policy(policy, m, s, cfg.rollout.temperature, tcfg.logits_chunk_tokens),
                mask_cfg, compute_dtype=DTYPES[tcfg.param_dtype])
            times["coupled"] = times.get("coupled", 0.0) + time.perf_counter() - t0
        loss_error = None  # this rank's first non-finite loss in the mini-batch
        for micro_index, (mb, c) in enumerate(zip(micros, coupled)):
            t0 = time.perf_counter()
            out, loss, error, t_policy = guarded_loss(policy, mb, mask_cfg, vocab_size=vocab_size,
                                                      temperature=cfg.rollout.temperature,
                                                      chunk_tokens=tcfg.logits_chunk_tokens, dp=dp, coupled=c,
                                                      sampling=getattr(cfg.rollout, "sampling_mask", None))
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
            times["loss"] += t2 - t0 - t_policy
            times["forward_backward"] += t_policy + (t3 - t2)
            loss_weight += mb.n_tokens if per_token else mb.n_seqs
            if out is None:  # non-finite: no metrics, and a NaN logged loss
                loss_error = loss_error or error
                loss_sum += math.nan
                continue
            # the logged loss is the mini-batch's aggregate: this micro-batch's loss times the
            # mini-batch's count over world is its Σ, and its local count its weight
            loss_sum += float(out.loss.detach()) * dp.count(mask_cfg.aggregation) / dp.world
            parts.append(out.metric_sums)
            if on_loss is not None:
                on_loss(mb_index, micro_index, out)
            regime.add(mb_index, out.stats, mb.advantages, mb.response_mask)  # D as the mask sees it here
            if mismatch_sample is not None:  # after mb_index steps on this batch (SPEC §6b)
                mismatch_sample(out.stats, mb.advantages, mb.response_mask, mini_batch=mb_index)
        t0 = time.perf_counter()
        norm_tensor, norm = gradient_norm(policy)  # global; computed with or without clipping
        bad = nonfinite_check(policy, mb_index, loss_error, norm)
        if bad is None:
            if tcfg.grad_clip is not None and norm_tensor is not None:
                torch.nn.utils.clip_grads_with_norm_(policy.parameters(), tcfg.grad_clip, norm_tensor)
            optimizer.step()
        else:  # never step on it: the weights and the optimiser's moments would take the NaN/inf
            skipped.append(bad)
        optimizer.zero_grad(set_to_none=True)
        times["optimizer"] += time.perf_counter() - t0
        parts.append({"loss/policy": metric("mean", loss_sum, loss_weight)})
        if tcfg.grad_clip is not None:  # already global: every rank adds the same value once
            parts.append({"loss/grad_norm": metric("mean", math.nan if norm is None else norm)})
        if coupled_info:  # already global: every rank adds the same value once
            parts.append({key: metric("mean", value) for key, value in coupled_info.items()})
            agreed.update(coupled_info)
        mini_sums = merge_metrics(*parts)
        if mb_index == 0:  # before any optimiser step of this batch: the realised mismatch
            parts.append(as_mismatch(mini_sums))
        parts.append(_renamed_mismatch(mini_sums, f"mb{mb_index}"))  # after mb_index steps (staleness)
        sums = merge_metrics(sums, *parts)
    sums = merge_metrics(sums, _renamed_mismatch(sums, "pooled"))  # the div/* sums of every mini-batch
    t1 = time.perf_counter()
    if skipped:  # a rank whose loss failed lacks that micro-batch's keys: merge only those every rank has
        sums = {key: value for key, value in sums.items() if key in agreed}
    metrics = finalize_floats(all_reduce_metrics(sums))  # one exact merge over ranks: 3 collectives
    times["loss"] += time.perf_counter() - t1
    metrics.update(nonfinite_metrics(skipped))  # already global
    metrics.update(regime.metrics())  # gathered from every rank: the same on each
    if skipped and on_loss is not None:  # the caller reads every micro-batch's output: some are missing
        raise NonFiniteUpdate(skipped)
    return UpdateResult(metrics=metrics, times=times, nonfinite=skipped)


def _renamed_mismatch(sums: MetricSums, name: str) -> MetricSums:
    """``as_mismatch``'s ``mismatch/*`` keys of `sums` as ``mismatch/{name}/*`` (one mini-batch, or pooled)."""
    return {key.replace("mismatch/", f"mismatch/{name}/", 1): value for key, value in as_mismatch(sums).items()
            if key.startswith("mismatch/")}


def nonfinite_metrics(skipped: list[NonFinite]) -> dict[str, float]:
    """``train/nonfinite`` (1: some optimiser step of this update was skipped), the skipped steps,
    and how many for each quantity (``train/nonfinite_loss``, ``_gradient``, ``_grad_norm``)."""
    counts = {q: float(sum(s.quantity == q for s in skipped)) for q in ("loss", "gradient", "grad_norm")}
    return {"train/nonfinite": float(bool(skipped)), "train/skipped_optimizer_steps": float(len(skipped)),
            **{f"train/nonfinite_{q}": n for q, n in counts.items()}}
