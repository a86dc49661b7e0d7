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


def test_the_kernel_reuses_its_logits_and_pullbacks_and_returns_the_same_values():
    """A probe asks one kernel for K v, J P Jᵀ v and (the decomposition) J P' Jᵀ v of the same v:
    each row's pullback and the logits at θ are computed once; the values are those of a kernel
    that recomputes everything (no cache), bit for bit."""
    model32 = _model(True)
    z, _, v = _v(copy.deepcopy(model32).double())
    rows = torch.arange(SEQ)
    pre = [torch.rand(p.shape, generator=torch.Generator().manual_seed(4)) + 0.5 for p in model32.parameters()]
    cached, fresh = _inplace(model32), _inplace(model32)
    fresh.pullback_cache_bytes = 0
    for kern in (cached, fresh):
        kern.preconditioner = pre
    got = [cached.kernel_v(rows, v), cached.kernel_v(rows, v, precondition=True)]
    want = [fresh.kernel_v(rows, v), fresh.kernel_v(rows, v, precondition=True)]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert cached.passes["backward"] == SEQ and fresh.passes["backward"] == 2 * SEQ
    assert cached.passes["forward"] < fresh.passes["forward"]
    # another v for the same rows is another pullback (a stale cache would return the old K v)
    v2 = v.roll(1, dims=-1)
    assert torch.equal(cached.kernel_v(rows, v2), fresh.kernel_v(rows, v2))
    assert cached.passes["backward"] == 2 * SEQ


def test_a_row_forward_of_the_tokens_own_sequence_gives_the_batched_kernel():
    """``row_logits_fn``: each probed row's passes forward its own sequence alone. K v equals the
    exact float64 kernel as the batched forward's does, on rows from two sequences."""
    model32 = _model(True)
    model64 = copy.deepcopy(model32).double()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    params64 = {k: p.detach() for k, p in model64.named_parameters()}
    exact = FunctionalKernel(lambda p: torch.func.functional_call(model64, p, (ids,)).logits.reshape(2 * SEQ, -1),
                             params64, method="jvp")
    with torch.no_grad():
        z = model64(ids).logits.reshape(2 * SEQ, -1).double()
    rows = torch.tensor([1, 5, SEQ + 2, SEQ + 6])
    sampled = torch.randint(0, VOCAB, (rows.numel(),), generator=torch.Generator().manual_seed(6))
    v = own_direction(z[rows], sampled)
    want = exact.kernel_v(rows, v)
    # the kernel's rows index the probed rows (0 … 3); the batched forward returns only those
    flat = lambda: model32(ids).logits.reshape(2 * SEQ, -1)[rows].double()  # noqa: E731

    def one(t):
        r = int(rows[0 if t is None else t])
        return model32(ids[r // SEQ:r // SEQ + 1]).logits[0, r % SEQ:r % SEQ + 1].double()

    batched = InPlaceKernel(list(model32.parameters()), flat, compute_dtype=torch.float32)
    per_row = InPlaceKernel(list(model32.parameters()), flat, compute_dtype=torch.float32, row_logits_fn=one)
    probe_rows = torch.arange(rows.numel())
    for kern in (batched, per_row):
        got = kern.kernel_v(probe_rows, v)
        rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
        assert float(rel.max()) < 2e-2, rel
    # planted: a row function that forwards the wrong sequence is far from the exact kernel
    wrong = InPlaceKernel(list(model32.parameters()), flat, compute_dtype=torch.float32,
                          row_logits_fn=lambda t: one(None if t is None else (t + 2) % rows.numel()))
    bad = wrong.kernel_v(probe_rows, v)
    assert float(((bad - want).norm(dim=-1) / want.norm(dim=-1)).max()) > 0.1
