"""TRL's side of the one live audit (``pdm_lab.audit.live.run_live_audit``; SPEC §6c, §6d).

``TRLAuditStage`` is what ``run_live_audit`` asks of a trainer (``audit_live.LiveAuditStage``),
for ``PDMGRPOTrainer``'s generation batch; the snapshot, the per-rule and per-scale steps, the
restores, the probe, the decomposition and the merge over processes are ``run_live_audit``'s:

* ``step`` — one optimiser step over the audited batch: micro-batches of
  ``per_device_train_batch_size``, each loss ``trainer.pdm_loss_output`` with the rule's mask
  (the audit's δ, the rule's own estimator), weighted by its share of the batch's tokens
  (``token-mean``) or sequences (the other aggregations); TRL's ``max_grad_norm`` clip; the wrapped
  torch optimiser at ``lr_scale`` × its current learning rate;
* ``measure`` — D per completion token at the current θ in float64 (μ's support as the rules build
  it, then cast; the logits cast before the softmax). D is taken on the full softmax, as in the
  loop: the sampling mask is not applied here;
* ``probe_view`` — the probed rows' processed logits z = h·Wᵀ/T with the output layer in float64
  (h the decoder's last hidden state, kept by a forward hook) and a
  ``pdm_lab.audit.probe_kernel.InPlaceKernel`` over the model's trainable parameters (central
  differences at θ ± εu, restored bit-exactly), as the loop's ``scaling/audit_probe.py``.

Under several processes the audited passes run on the unwrapped model, outside Accelerate's
gradient synchronisation: each process steps on its own batch, and its kernel is its own (see
``_OwnGradientKernel``).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from pdm_lab.audit.live import ProbeView, StepOutcome, support_in_float64
from pdm_lab.audit.central_difference import _world
from pdm_lab.policy_side import policy_on_support
from pdm_lab.sampling_mask import engine_kept, on_sampling_set
from pdm_lab.audit.probe_kernel import InPlaceKernel
from pdm_lab.audit.probe_record import token_weights
from pdm_lab.tokenwise import token_stats
from pdm_lab.support import support_from_topk

BATCH_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
              "pdm_topk_ids", "pdm_topk_logp", "pdm_mu_logp")


def batch_rows(batch: dict, lo: int, hi: int) -> dict:
    """Rows lo:hi of the audit's keys of a TRL generation batch."""
    return {key: batch[key][lo:hi] for key in BATCH_KEYS}


@torch.no_grad()  # read only (the audit runs under enable_grad): no graph, no checkpointed recompute
def measured_divergence(trainer, model, inputs: dict) -> tuple[Tensor, Tensor]:
    """([n] top-K KL D(μ‖π), [n] μ_T) of the completion tokens in float64 (μ's support as the rules build it,
    then cast; the logits cast before the softmax; π over the engine's sampling set when the
    trainer keeps the sampling mask, as its loss does)."""
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    b, t = completion_ids.shape
    logits = model(input_ids=torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
                   attention_mask=torch.cat([inputs["prompt_mask"], completion_mask], dim=1),
                   logits_to_keep=t + 1).logits[:, :-1]
    flat = completion_mask.bool().reshape(-1)
    support = support_in_float64(support_from_topk(
        inputs["pdm_topk_ids"].reshape(b * t, -1)[flat], inputs["pdm_topk_logp"].reshape(b * t, -1)[flat],
        completion_ids.reshape(-1)[flat], inputs["pdm_mu_logp"].reshape(-1)[flat],
        vocab_size=logits.size(-1), k=trainer.pdm_mask.k, convention=trainer.pdm_mask.convention))
    # with the engine's sampling mask kept, π over the sampling set (SPEC §1), as the loss computes it
    pi = policy_on_support(logits.reshape(b * t, -1)[flat].double(), support.ids, temperature=trainer.temperature,
                           sampling=trainer.pdm_sampling, keep_on_support=engine_kept(support))
    support = on_sampling_set(support, pi.tail_count)
    stats = token_stats(support, pi, binary=False)
    return stats.topk_kl, stats.mu_tail


def _token_advantages(mb: dict) -> Tensor:
    adv, mask = mb["advantages"], mb["completion_mask"]
    adv = adv[:, None].expand_as(mask) if adv.dim() == 1 else adv
    return adv.reshape(-1)[mask.bool().reshape(-1)].float()


class _OwnGradientKernel(InPlaceKernel):
    """``InPlaceKernel`` for a replicated model whose backward is not averaged over processes (TRL's
    audited passes, several processes without FSDP): ``InPlaceKernel`` multiplies each pullback by
    the world size to undo FSDP's average, so K v is divided by it again (K v is linear in the
    pullback). The collectives (row owners, ε's slope) are ``InPlaceKernel``'s."""

    def kernel_v(self, rows: Tensor, v: Tensor, *, precondition: bool | list[Tensor] = False) -> Tensor:
        return super().kernel_v(rows, v, precondition=precondition) / _world()


class TRLAuditStage:
    """``PDMGRPOTrainer``'s side of ``run_live_audit`` on this process's audited generation batch.

    Args:
        trainer: the ``PDMGRPOTrainer`` (its model, optimiser, mask section, arguments).
        batch: the audited rows of the generation batch (``BATCH_KEYS``).
        delta: the audit's δ (the audited rules' and the outside set's).
    """

    def __init__(self, trainer, batch: dict, *, delta: float):
        self.trainer, self.model, self.batch, self.delta = trainer, trainer.model, batch, delta
        self.optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # Accelerate's wrapper → torch's
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        n, size = batch["completion_ids"].size(0), trainer.args.per_device_train_batch_size
        self.micros = [batch_rows(batch, lo, lo + size) for lo in range(0, n, size)]
        self.resp = [mb["completion_mask"].bool().reshape(-1) for mb in self.micros]
        mask = trainer.pdm_mask
        per_token = mask.aggregation == "token-mean"
        counts = [float(r.sum()) if per_token else float(mb["completion_mask"].any(1).sum())
                  for r, mb in zip(self.resp, self.micros)]
        total = max(sum(counts), 1.0)
        self.shares = [c / total for c in counts]
        # w_t: each micro-batch's loss is aggregated alone (no DPInfo), then weighted by its share
        self.weights = torch.cat([
            token_weights(mb["completion_mask"].cpu(), mask.aggregation, horizon=mask.horizon).reshape(-1)[r.cpu()] * s
            for mb, r, s in zip(self.micros, self.resp, self.shares)])
        self.advantages = torch.cat([_token_advantages(mb) for mb in self.micros])
        # audited token → (sequence, completion column): the micro-batches are consecutive rows
        self.token_seq, self.token_col = batch["completion_mask"].bool().cpu().nonzero(as_tuple=True)

    def step(self, rule: str, optimizer, *, lr_scale: float, zero_advantages: bool) -> StepOutcome:
        trainer, model = self.trainer, self.model
        mask = dataclasses.replace(trainer.pdm_mask, rule=rule, delta=self.delta, delta_neg=None, estimator=None)
        groups = self.optimizer.param_groups
        lrs = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = g["lr"] * lr_scale
        try:
            optimizer.zero_grad(set_to_none=True)
            outs = []
            for mb, share in zip(self.micros, self.shares):
                if zero_advantages:
                    mb = {**mb, "advantages": torch.zeros_like(mb["advantages"])}
                out = trainer.pdm_loss_output(model, mb, mask=mask)
                (out.loss * share).backward()
                outs.append(out)
            clip, max_norm = 1.0, trainer.args.max_grad_norm
            if max_norm:
                norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
                clip = min(1.0, max_norm / (norm + 1e-6))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        finally:
            for g, lr in zip(groups, lrs):
                g["lr"] = lr
        cat = lambda f: torch.cat([f(o)[r] for o, r in zip(outs, self.resp)])  # noqa: E731
        return StepOutcome(keep=cat(lambda o: o.keep.reshape(-1)) > 0, topk_kl=cat(lambda o: o.stats.topk_kl),
                           mu_tail=cat(lambda o: o.stats.mu_tail), advantages=self.advantages,
                           ratio=cat(lambda o: o.stats.ratio), weights=self.weights, clip_factor=clip)

    def measure(self) -> Tensor:
        parts = [measured_divergence(self.trainer, self.model, mb) for mb in self.micros]
        self.mu_tail = torch.cat([tail for _, tail in parts])  # μ_T of the measured tokens (an idle batch's regime)
        return torch.cat([d for d, _ in parts])

    def probe_view(self, rows: Tensor, preconditioner) -> ProbeView:
        """The probed rows (indices into this process's audited tokens): one forward of the
        sequences holding them (of the first sequence when there are none)."""
        model, batch, temperature = self.model, self.batch, self.trainer.temperature
        rows = rows.cpu()
        seq, col = self.token_seq[rows], self.token_col[rows]
        seqs = sorted(set(seq.tolist())) or [0]
        where = {s: i for i, s in enumerate(seqs)}
        pick = torch.tensor(seqs, dtype=torch.long, device=batch["prompt_ids"].device)
        input_ids = torch.cat([batch["prompt_ids"][pick], batch["completion_ids"][pick]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"][pick], batch["completion_mask"][pick]], dim=1)
        local = torch.tensor([where[int(s)] for s in seq], dtype=torch.long)
        position = batch["prompt_ids"].size(1) - 1 + col  # the hidden state that predicts completion token col
        decoder, head = model.get_decoder(), model.get_output_embeddings()

        def hidden() -> Tensor:
            captured = {}
            handle = decoder.register_forward_hook(lambda _m, _i, out: captured.__setitem__("h", out[0]))
            try:
                model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=1)
            finally:
                handle.remove()
            h = captured["h"]
            return h[local.to(h.device), position.to(h.device)]

        def logits_fn() -> Tensor:
            z = hidden().double() @ head.weight.double().t()
            if getattr(head, "bias", None) is not None:
                z = z + head.bias.double()
            return z / temperature

        with torch.no_grad():
            h0 = hidden().double()
            w0 = head.weight.detach().double().cpu()
            logits = logits_fn().cpu()
        mask = self.trainer.pdm_mask
        support = support_in_float64(support_from_topk(
            batch["pdm_topk_ids"][seq, col].cpu(), batch["pdm_topk_logp"][seq, col].cpu(),
            batch["completion_ids"][seq, col].cpu(), batch["pdm_mu_logp"][seq, col].cpu(),
            vocab_size=w0.shape[0], k=mask.k, convention=mask.convention))
        bias = 1.0 if getattr(head, "bias", None) is not None else 0.0
        head_sq = ((h0.norm(dim=-1) ** 2 + bias) / temperature ** 2).cpu()  # the output layer's own K: (‖h‖² + 1_bias)/T²
        sharded = any(hasattr(p, "to_local") for p in self.params)
        kind = InPlaceKernel if sharded or _world() == 1 else _OwnGradientKernel
        kernel = kind(self.params, logits_fn, preconditioner=preconditioner,
                      head_fn=lambda _rows, v: head_sq[:, None] * v, unembedding=w0 / temperature,
                      compute_dtype=self.params[0].dtype)
        return ProbeView(support=support, logits=logits, kernel=kernel)
