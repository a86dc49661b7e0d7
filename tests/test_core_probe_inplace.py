"""The loop's own-update probe kernel (``InPlaceKernel``: central differences of a float32 model,
parameters perturbed in place) against the exact float64 kernel (``FunctionalKernel`` with
forward-mode AD) on a real tiny Qwen3 from ``transformers``, and the probe's sign of the own ΔD
against an actual tiny float64 step on the token's own surrogate (SPEC §6d).

The loop measures its headline figures (each rule's sign agreement with the own update) through
this kernel, so it must be right about the sign of ⟨∇_z D, K v⟩ on the tokens that decide them.
"""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from pdm_lab.coupled import differentiable_topk_kl  # noqa: E402
from pdm_lab.audit.probe import divergence_grads, own_direction  # noqa: E402
from pdm_lab.policy_side import policy_on_support  # noqa: E402
from pdm_lab.audit.probe_kernel import FunctionalKernel, InPlaceKernel  # noqa: E402
from pdm_lab.support import support_from_topk  # noqa: E402

VOCAB, SEQ, K = 96, 8, 20


def _model(tied: bool) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    cfg._attn_implementation = "eager"  # forward-mode AD (the exact kernel) has no CPU flash-attention rule
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # a peaked output layer, as a trained LM's
        model.lm_head.weight.mul_(8.0)
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))


def _exact(model64) -> FunctionalKernel:
    params = {k: p.detach() for k, p in model64.named_parameters()}
    ids = _ids()
    fn = lambda p: torch.func.functional_call(model64, p, (ids,)).logits[0]  # noqa: E731
    return FunctionalKernel(fn, params, method="jvp")


def _inplace(model32) -> InPlaceKernel:
    ids = _ids()
    params = list(model32.parameters())
    return InPlaceKernel(params, lambda: model32(ids).logits[0].double(), compute_dtype=torch.float32)


def _v(model64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        z = model64(_ids()).logits[0].double()
    sampled = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(2))
    return z, sampled, own_direction(z, sampled)


@pytest.mark.parametrize("tied", [True, False])
def test_inplace_kernel_of_a_float32_qwen3_matches_the_exact_float64_kernel(tied):
    model32 = _model(tied)
    model64 = copy.deepcopy(model32).double()
    z, _, v = _v(model64)
    rows = torch.arange(SEQ)
    exact = _exact(model64).kernel_v(rows, v)
    approx = _inplace(model32).kernel_v(rows, v)
    rel = (approx - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert float(rel.max()) < 2e-2, rel
    cos = torch.nn.functional.cosine_similarity(approx, exact, dim=-1)
    assert float(cos.min()) > 0.999
    # planted: a kernel that returns v itself (the tabular K = I) is far from the model's
    cos_v = torch.nn.functional.cosine_similarity(v, exact, dim=-1)
    assert float(cos_v.max()) < 0.9


def test_the_probes_own_delta_d_sign_is_an_actual_float64_steps():
    """For each row: the actual change of the top-K KL(μ‖π) at that row after a tiny float64 SGD
    step on the row's own surrogate Â·log π(k) has the sign of Â·⟨∇_z D, K v⟩ (K from the float32
    in-place kernel), where the first-order term is not negligible."""
    model32 = _model(True)
    model64 = copy.deepcopy(model32).double()
    z, sampled, v = _v(model64)
    rows = torch.arange(SEQ)
    mu_logits = z + 0.3 * torch.randn(z.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    mu_logp = torch.log_softmax(mu_logits, -1)
    top = mu_logp.topk(K, dim=-1)
    support = support_from_topk(top.indices, top.values, sampled, mu_logp.gather(1, sampled[:, None])[:, 0],
                                vocab_size=VOCAB, k=K)
    kv = _inplace(model32).kernel_v(rows, v)
    grads, _ = divergence_grads(support, z, None)
    g = grads["topk_kl"]
    adv = torch.where(torch.arange(SEQ) % 2 == 0, 1.0, -1.0).double()
    predicted = adv * (g * kv).sum(-1)

    def topk_kl_at(model, t):
        with torch.no_grad():
            logp = torch.log_softmax(model(_ids()).logits[0, t].double(), -1)
        sup = support_from_topk(top.indices[t:t + 1], top.values[t:t + 1], sampled[t:t + 1],
                                mu_logp[t:t + 1].gather(1, sampled[t:t + 1, None])[:, 0], vocab_size=VOCAB, k=K)
        return float(differentiable_topk_kl(sup, policy_on_support(logp[None], sup.ids))[0])

    checked = 0
    for t in range(SEQ):
        if abs(float(predicted[t])) < 1e-3 * float((g[t].abs() * kv[t].abs()).sum()):
            continue  # first order too small to decide a sign against the step's second order
        stepped = copy.deepcopy(model64)
        logits = stepped(_ids()).logits[0, t]
        (float(adv[t]) * torch.log_softmax(logits, -1)[sampled[t]]).backward()
        eta = 1e-6
        with torch.no_grad():
            for p in stepped.parameters():
                p.add_(p.grad, alpha=eta)
        before = topk_kl_at(model64, t)
        after = topk_kl_at(stepped, t)
        assert float(after - before) * float(predicted[t]) > 0, (t, float(after - before), float(predicted[t]))
        checked += 1
    assert checked >= SEQ // 2
