"""The trainer's policy π: a Hugging Face causal LM under FSDP2, returning π on the support.

``PolicyModel.forward`` runs the decoder, keeps only the hidden states that predict response
tokens, applies ``lm_head`` to those rows alone and hands the logits to
``pdm_lab.policy_side.policy_on_support`` at the rollout temperature (SPEC §1). With
``trainer.logits_chunk_tokens`` the lm_head + support gather run chunk by chunk under activation
checkpointing, so no [N, V] logits tensor survives into backward (the train-side memory story of
the bench).

Sharding: ``fully_shard`` on each decoder layer, then on the wrapper (root: embeddings, final
norm, lm_head), over gloo on CPU or nccl on GPU; a single fp32 rank stays unsharded.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pdm_lab.policy_side import policy_on_support

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PREFIX = "lm."  # parameter-name prefix the wrapper adds to the HF names


def _support_chunk(h: Tensor, weight: Tensor, ids: Tensor, temperature: float,
                   head_dtype: torch.dtype | None = None, sampling=None, keep_on_support: Tensor | None = None):
    if head_dtype is not None:  # the audit's measurement: lm_head and the softmax in float64
        h, weight = h.to(head_dtype), weight.to(head_dtype)
    logits = h @ weight.t()  # [c, V] in the compute dtype
    pi = policy_on_support(logits, ids, temperature=temperature, sampling=sampling, keep_on_support=keep_on_support)
    out = (pi.logp, pi.tail_logp, pi.tail_log_sumsq)
    return out if pi.tail_count is None else (*out, pi.tail_count)


class PolicyModel(nn.Module):
    """Wraps ``lm`` (``*ForCausalLM``): π on given support ids at given positions."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    @property
    def vocab_size(self) -> int:
        return self.lm.config.vocab_size

    def forward(self, input_ids: Tensor, attention_mask: Tensor, positions: Tensor,
                support_ids: Tensor, temperature: float, chunk_tokens: int | None = None,
                head_dtype: torch.dtype | None = None, sampling=None,
                keep_on_support: Tensor | None = None,
                on_head: Callable[[Tensor, Tensor], None] | None = None) -> tuple[Tensor, ...]:
        """π on the support at selected positions.

        Args:
            input_ids: [b, L] prompt + response, right-padded.
            attention_mask: [b, L] 1 on real tokens.
            positions: [N] flat indices into b·L of the hidden states that predict each
                response token (the position before it).
            support_ids: [N, m] support ids per response token (−1 pad).
            temperature: rollout temperature T.
            chunk_tokens: rows per lm_head chunk, recomputed in backward (None: one pass).
            head_dtype: cast the hidden states and lm_head to this dtype first (None: the
                compute dtype); the direction audit measures D with float64.
            sampling, keep_on_support: the engine's sampling mask (``policy_on_support``).
            on_head: called once, without gradient, with the detached hidden states h [N, H] of
                the selected positions and lm_head's weight [V, H] as this forward holds it (under
                FSDP2 the root's gathered weight, in the compute dtype; tied: the embedding), for
                what needs the full output layer (``pdm_kernel``'s c_t, ``train_step``). A callable,
                so FSDP2's cast of the forward inputs leaves what it closes over alone.

        Returns:
            (logp [N, m] differentiable, tail_logp [N], tail_log_sumsq [N]): the fields of
            ``PolicyOnSupport``, as a tuple so FSDP sees the tensors it must hook for backward;
            with an active sampling mask also tail_count [N] (t = |C ∖ S|).
        """
        hidden = self.lm.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        h = hidden.reshape(-1, hidden.shape[-1])[positions]  # [N, H]
        weight = self.lm.lm_head.weight
        if on_head is not None:
            with torch.no_grad():
                on_head(h.detach(), weight.detach())
        if chunk_tokens is None or h.shape[0] <= chunk_tokens:
            return _support_chunk(h, weight, support_ids, temperature, head_dtype, sampling, keep_on_support)
        rows = lambda x, i: None if x is None else x[i:i + chunk_tokens]  # noqa: E731
        parts = [checkpoint(_support_chunk, h[i:i + chunk_tokens], weight, support_ids[i:i + chunk_tokens],
                            temperature, head_dtype, sampling, rows(keep_on_support, i), use_reentrant=False)
                 for i in range(0, h.shape[0], chunk_tokens)]
        return tuple(torch.cat([p[j] for p in parts]) for j in range(len(parts[0])))


def load_lm(model_dir: str, *, seed: int):
    """The HF causal LM in float32 (master weights), eval-free training mode, no KV cache."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lm.config.use_cache = False
    lm.train()
    return lm


def shard_policy(lm: nn.Module, *, param_dtype: str, reduce_dtype: str,
                 gradient_checkpointing: bool) -> PolicyModel:
    """FSDP2: ``fully_shard`` every decoder layer, then the root wrapper.

    A world of one in fp32 has nothing to shard, gather or cast: the model stays plain (FSDP's
    hooks, DTensor gradient clipping and per-parameter DTensor ops cost more than the tiny
    model's whole backward). Checkpoints (``torch.distributed.checkpoint``) read either form.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = PolicyModel(lm)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world == 1 and param_dtype == "fp32" and reduce_dtype == "fp32":
        return policy
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    for layer in lm.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(policy, mp_policy=mp)
    return policy


@torch.no_grad()
def sequence_logprobs(policy: PolicyModel, token_ids: list[int]) -> Tensor:
    """log π(token_t | <t) at T = 1 for a fixed sequence, t = 1..L−1 (the sync check). [L−1]

    Collective under FSDP: every rank must call it.
    """
    ids = torch.tensor([token_ids], dtype=torch.long)
    n = len(token_ids) - 1
    positions = torch.arange(n)
    support = torch.tensor(token_ids[1:], dtype=torch.long)[:, None]
    logp, _, _ = policy(ids, torch.ones_like(ids), positions, support, 1.0)
    return logp[:, 0].double()
