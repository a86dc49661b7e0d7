"""The own-update probe's view of the loop's policy (SPEC §6d): the probed rows' processed logits
z = h·Wᵀ/T with lm_head in float64, and a ``pdm_lab.audit.probe_kernel.InPlaceKernel`` over them.

The decoder runs through ``PolicyModel.forward`` (so FSDP gathers and reshards as in training);
a forward hook on the decoder keeps its last hidden state, from which the probed rows' full
logits are formed in float64. Every rank runs one forward per call, even with no probed row
(it then forwards one sequence and returns [0, V]). Per probed token, K v's passes forward the
token's own sequence alone (``row_logits_fn``), not every probed sequence.
"""
from __future__ import annotations

import torch
from torch import Tensor

from pdm_lab.audit.live import ProbeView, support_in_float64
from pdm_lab.audit.probe_kernel import InPlaceKernel
from pdm_lab.support import support_from_topk

from .policy_model import DTYPES
from .train_step import make_micro_batch


def reshard(policy) -> None:
    """Free FSDP2's gathered parameters after a no-grad forward. The root module keeps its gathered
    copy after a forward (for the backward that usually follows), and ``parameters()`` then yields
    that copy; the snapshot is taken and restored on the shards, so the next forward must gather
    them afresh."""
    from torch.distributed.fsdp import FSDPModule

    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def loop_probe_view(stage, rows: Tensor, preconditioner) -> ProbeView:
    """``LoopAuditStage.probe_view``: rows index the stage's audited tokens (this rank's)."""
    policy, cfg, temperature = stage.policy, stage.cfg, stage.cfg.rollout.temperature
    seq, col = stage.token_seq[rows], stage.token_col[rows]
    seqs = sorted(set(seq.tolist())) or [0]
    pmb = make_micro_batch(stage.batch, seqs, stage.seq_adv, stage.pad_id).to(stage.device or "cpu")
    pr, pc = pmb.response_mask.cpu().nonzero(as_tuple=True)
    where = {(seqs[int(a)], int(b)): i for i, (a, b) in enumerate(zip(pr, pc))}
    index = torch.tensor([where[(int(s), int(c))] for s, c in zip(seq, col)], dtype=torch.long)
    positions = pmb.positions[index.to(pmb.positions.device)]
    lm = policy.lm
    dummy = torch.zeros(1, 1, dtype=torch.long, device=pmb.input_ids.device)

    def hidden_of(mb, at: Tensor) -> Tensor:
        captured = {}
        handle = lm.model.register_forward_hook(lambda _m, _i, out: captured.__setitem__("h", out.last_hidden_state))
        try:
            policy(mb.input_ids, mb.attention_mask, mb.positions[:1], dummy, temperature)
        finally:
            handle.remove()
        h = captured["h"]
        if not torch.is_grad_enabled():  # the root keeps its gathered copy after a forward (a backward frees it)
            reshard(policy)
        return h.reshape(-1, h.shape[-1])[at]

    def hidden() -> Tensor:
        return hidden_of(pmb, positions)

    def weight() -> Tensor:
        w = lm.lm_head.weight
        return w.full_tensor() if hasattr(w, "full_tensor") else w

    def logits_fn() -> Tensor:
        return hidden().double() @ weight().double().t() / temperature

    single: dict[int, tuple] = {}  # sequence → its own micro-batch and response column → flat position

    def row_logits_fn(t: int | None) -> Tensor:
        """[1, V] probed row t's logits from a forward of its sequence alone (None: this rank's first
        probed sequence, or sequence 0: a rank that only joins the collective)."""
        s = int(seq[t]) if t is not None else (int(seq[0]) if seq.numel() else 0)
        if s not in single:
            mb = make_micro_batch(stage.batch, [s], stage.seq_adv, stage.pad_id).to(stage.device or "cpu")
            cols = mb.response_mask.cpu().nonzero(as_tuple=True)[1]
            single[s] = (mb, {int(c): i for i, c in enumerate(cols)})
        mb, where_col = single[s]
        i = where_col[int(col[t])] if t is not None else 0
        at = mb.positions[i:i + 1]
        return hidden_of(mb, at).double() @ weight().double().t() / temperature

    with torch.no_grad():
        h0 = hidden().double()
        w0 = weight().detach().double().cpu()
        logits = (h0 @ weight().double().t() / temperature).cpu()
    valid = [torch.nonzero(mb.response_mask.reshape(-1), as_tuple=True)[0] for mb in stage.micros]
    cat = lambda f: torch.cat([f(mb)[v] for mb, v in zip(stage.micros, valid)])  # noqa: E731
    r = rows.to(valid[0].device)
    support = support_in_float64(support_from_topk(
        cat(lambda mb: mb.topk_ids)[r].cpu(), cat(lambda mb: mb.topk_logp)[r].cpu(), cat(lambda mb: mb.sampled)[r].cpu(),
        cat(lambda mb: mb.sampled_logp)[r].cpu(), vocab_size=stage.vocab_size, k=cfg.mask.k,
        convention=cfg.mask.convention))
    head_sq = (h0.norm(dim=-1) ** 2 / temperature ** 2).cpu()
    kernel = InPlaceKernel(stage.params, logits_fn, preconditioner=preconditioner,
                           head_fn=lambda _rows, v: head_sq[:, None] * v, unembedding=w0 / temperature,
                           compute_dtype=DTYPES[cfg.trainer.param_dtype], row_logits_fn=row_logits_fn)
    return ProbeView(support=support, logits=logits, kernel=kernel)
