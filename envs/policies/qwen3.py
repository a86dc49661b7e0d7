"""The loop's own model family as a toy policy: a ``transformers`` Qwen3 inside the token MDP (SPEC §6d).

logits(obs) = prior[row(obs)] + W h(obs), with h the final normed hidden state of a
``Qwen3Model`` built from its config (RoPE, grouped-query attention with q/k RMSNorm, SwiGLU,
random weights at ``initializer_range`` 0.02, as the loop's ``scaling.tiny_model.build_model``)
read at the last position of the transformer toy's context window (``context_window``), and W the
unembedding: the token embedding's first n rows (``qwen3``, tied as the loop's tiny model and
Qwen3 0.6B–4B) or an ``lm_head`` of its own (``qwen3_untied``), no bias. The shape is the loop's
at ``hidden`` 64: 2 layers, 4 query and 2 key/value heads of width hidden/2, MLP width 2·hidden.

With the loop's architecture in the toy, ``transfer`` can tell whether the architecture or the
training sets the loop's kernel (measured: the training history; ``docs/findings/faithful-toy.md``).
``sft_steps`` gives the toy a training history (``envs.audit.sft``).

The engine's hooks: ``activation_round`` rounds every linear layer's input (W8A8 for
``fp8_engine``), the final hidden state and the logits; ``FP8_WEIGHTS`` names the decoder's
projection weights (e4m3 in the fp8 engine; the embedding stays bf16); ``w2`` is Wᵀ [d, n].
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from pdm_lab.config import ConfigError
from pdm_lab.envs.policies.base import Rounding, prior_rows
from pdm_lab.envs.policies.transformer import PROMPT_BUCKETS, WINDOW, context_window

QWEN3_KINDS = ("qwen3", "qwen3_untied")
WIDE_ATTENTION = "pdm_lab_wide_eager"
LAYERS = 2
HEADS = 4
KV_HEADS = 2


def _wide_eager_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                          scaling: float, dropout: float = 0.0, **kwargs):
    """transformers' eager attention with the softmax in the wider of float32 and the inputs' dtype
    (its own takes the softmax in float32, which would round a float64 audit; its sdpa path has no
    forward-mode derivative on the CPU, which the probe's J·u needs)."""
    groups = module.num_key_value_groups
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def qwen3_config(vocab_rows: int, hidden: int, *, tied: bool):
    """The loop's tiny-model shape at width `hidden` over `vocab_rows` embedding rows."""
    try:
        from transformers import AttentionInterface, Qwen3Config
    except ImportError as exc:  # transformers comes with the scaling extra
        raise ConfigError("policy: qwen3 needs transformers (pip install 'pdm-lab[scaling]')") from exc
    AttentionInterface.register(WIDE_ATTENTION, _wide_eager_attention)
    if hidden % 2:
        raise ConfigError(f"hidden: the qwen3 toy's width must be even (head width hidden/2), got {hidden}")
    return Qwen3Config(vocab_size=vocab_rows, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       head_dim=hidden // 2, max_position_embeddings=WINDOW + 1, tie_word_embeddings=tied,
                       attention_dropout=0.0, attn_implementation=WIDE_ATTENTION, pad_token_id=None,
                       bos_token_id=None, eos_token_id=None)


class _WideRMSNorm:
    """transformers' RMSNorm computes in float32 (a bf16 model's habit), which would round a float64
    audit to float32: this one computes in the wider of float32 and the input's dtype."""

    _made: dict = {}

    @classmethod
    def of(cls, base: type) -> type:
        if base not in cls._made:
            def forward(self, hidden_states: Tensor) -> Tensor:
                dtype = hidden_states.dtype
                x = hidden_states.to(torch.promote_types(dtype, torch.float32))
                x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
                return self.weight * x.to(dtype)
            cls._made[base] = type(f"Wide{base.__name__}", (base,), {"forward": forward})
        return cls._made[base]


class Qwen3Policy(Rounding, nn.Module):
    """logits = prior[s] + W h with h the last hidden state of a ``transformers`` Qwen3.

    Args:
        encoder: the problem's encoder (rows of the prior: ``encoder.prior_index``).
        prior: [R, n] float32 initial logits.
        hidden: the model width d (even).
        tied: W is the token embedding's first n rows.
        seed: seeds the initial weights (``transformers`` draws them from torch's global generator,
            forked here so the caller's stream is untouched).
    """

    def __init__(self, encoder, prior: Tensor, *, hidden: int = 64, tied: bool = True, seed: int = 0):
        super().__init__()
        self.encoder = encoder
        self.tied = tied
        self.register_buffer("prior", prior.clone().float())
        n = prior.shape[1]
        self.vocab = n
        config = qwen3_config(n + 1 + PROMPT_BUCKETS, hidden, tied=tied)  # tokens, the pad, prompt buckets
        from transformers import Qwen3Model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = Qwen3Model(config).float()
            self.head = None if tied else nn.Parameter(torch.randn(n, hidden) * config.initializer_range)
        for module in self.model.modules():
            if type(module).__name__ == "Qwen3RMSNorm":
                module.__class__ = _WideRMSNorm.of(type(module))
        # the engine's copy rounds each linear layer's input; a bound method, so a deep copy's hook
        # reads the copy's ``activation_round``
        for module in self.model.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_pre_hook(self._round_input)
        self.FP8_WEIGHTS = tuple(name for name, _ in self.named_parameters() if name.endswith("proj.weight"))

    def _round_input(self, module: nn.Module, args: tuple) -> tuple | None:
        if self.activation_round is None:
            return None
        return (self._act(args[0]), *args[1:])

    def unembedding(self) -> Tensor:
        """W [n, d]: the rows the final hidden state is read out with."""
        return self.model.embed_tokens.weight[: self.vocab] if self.tied else self.head

    @property
    def w2(self) -> Tensor:
        """Wᵀ [d, n] (the shape the ``outlier`` mismatch reads)."""
        return self.unembedding().T

    def hidden_state(self, obs: Tensor) -> Tensor:
        """[B, D] int64 → [B, d] the final normed hidden state at the last position."""
        ids, real = context_window(obs, self.vocab)
        # left-padded: positions count real tokens only; causal, pads masked as keys, and a pad query
        # reads itself (never a real one) so no softmax row is empty. An additive 4D mask, which
        # transformers takes as it is.
        position = (real.long().cumsum(dim=1) - 1).clamp(min=0)
        t = ids.shape[1]
        eye = torch.eye(t, dtype=torch.bool)
        allowed = torch.tril(torch.ones(t, t, dtype=torch.bool)) & (real[:, None, :] | eye)
        dtype = self.model.embed_tokens.weight.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[:, None]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position, use_cache=False)
        return self._act(out.last_hidden_state[:, -1])

    def trainable_logits(self, obs: Tensor) -> Tensor:
        """[B, D] int64 → [B, n] W h (plus the engine's ``output_error(h)`` in its copy)."""
        h = self.hidden_state(obs)
        out = h @ self.unembedding().T
        return out if self.output_error is None else out + self.output_error(h)

    def forward(self, obs: Tensor) -> Tensor:
        """[B, D] int64 observations → [B, n] logits (the parameters' dtype)."""
        return self._act(self.prior[prior_rows(self.encoder, obs)] + self.trainable_logits(obs), logits=True)
