"""The chunked train-side gather agrees with the naive log-softmax, values and gradients."""
import pytest
import torch
from hypothesis import given, strategies as st

from pdm_lab.policy_side import policy_on_support, policy_on_support_reference


@given(n=st.integers(1, 40), vocab=st.integers(2, 3000), m=st.integers(1, 22),
       temperature=st.sampled_from([0.6, 1.0, 1.3]), chunk=st.integers(1, 7), seed=st.integers(0, 10**6))
def test_chunked_matches_reference(n, vocab, m, temperature, chunk, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    m = min(m, vocab)
    ids = torch.argsort(torch.rand(n, vocab, generator=gen), dim=1)[:, :m]
    ids[:, -1] = torch.where(torch.rand(n, generator=gen) < 0.3, -1, ids[:, -1]) if m > 1 else ids[:, -1]
    weights = torch.randn(n, m, generator=gen, dtype=torch.float64).masked_fill(ids < 0, 0)

    fast = policy_on_support(logits, ids, temperature=temperature, chunk_size=chunk)
    (grad_fast,) = torch.autograd.grad((fast.logp.masked_fill(ids < 0, 0) * weights).sum(), logits)
    ref = policy_on_support_reference(logits, ids, temperature=temperature)
    (grad_ref,) = torch.autograd.grad((ref.logp.masked_fill(ids < 0, 0) * weights).sum(), logits)
    torch.testing.assert_close(fast.logp, ref.logp)
    torch.testing.assert_close(fast.tail_logp, ref.tail_logp)
    torch.testing.assert_close(fast.tail_log_sumsq, ref.tail_log_sumsq)
    torch.testing.assert_close(grad_fast, grad_ref)


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_gather_equals_eager(dtype):
    torch.manual_seed(1)
    for n in (37, 5):  # two sizes: the dynamic-shape graph is reused
        logits = (torch.randn(n, 3000) * 4).to(dtype).requires_grad_()
        ids = torch.stack([torch.randperm(3000)[:21] for _ in range(n)])
        ids[::3, -1] = -1
        outs = []
        for compiled in (False, True):
            pol = policy_on_support(logits, ids, temperature=0.8, chunk_size=4, compiled=compiled)
            (grad,) = torch.autograd.grad(pol.logp[:, 0].sum(), logits)
            outs.append((pol.logp, pol.tail_logp, pol.tail_log_sumsq, grad.float()))
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_logits_computed_in_float32(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(16, 1000) * 5).to(dtype).requires_grad_()
    ids = torch.stack([torch.randperm(1000)[:21] for _ in range(16)])
    fast = policy_on_support(logits, ids, temperature=0.7)
    ref = policy_on_support_reference(logits, ids, temperature=0.7)
    assert fast.logp.dtype == torch.float32
    torch.testing.assert_close(fast.logp, ref.logp, rtol=1e-5, atol=1e-5)
    fast.logp[:, 0].sum().backward()
    assert logits.grad.dtype == dtype and torch.isfinite(logits.grad.float()).all()


def test_tail_far_below_float32_underflow_is_finite():
    """Log-probs of −150 are ordinary in float32 logits; exp underflows, the log-sum-exp does not."""
    logits = torch.full((1, 50), -150.0)
    logits[0, 0] = 0.0
    out = policy_on_support(logits, torch.tensor([[0]]))
    assert torch.isfinite(out.tail_logp).all() and out.tail_logp.item() < -140
    assert torch.isfinite(out.tail_log_sumsq).all()


@pytest.mark.compile
def test_compiled_stats_equal_eager():
    """The compiled fast path runs the very same functions; it must agree with eager."""
    from core_helpers import mismatched_pair, sample_from
    from pdm_lab.tokenwise import token_stats
    from pdm_lab.support import support_from_full

    for n_rows in (64, 33):  # a second size exercises the dynamic-shape graph
        mu, pi = mismatched_pair(n_rows, 300, n_rows, noise=1.0)
        support = support_from_full(mu, sample_from(mu, 0), k=20)
        pol = policy_on_support(pi, support.ids)
        # binary=False: the graph the loss runs for rules that do not read the binary divergences
        for full, binary in ((False, True), (True, True), (False, False)):
            kw = {"mu_full": mu, "pi_full": pi} if full else {}
            a = token_stats(support, pol, compiled=True, binary=binary, **kw)
            b = token_stats(support, pol, compiled=False, binary=binary, **kw)
            for field in ("topk_kl", "topk_tv", "binary_kl", "binary_tv", "ratio", "mu_tail", "pi_tail",
                          "ddot_lower", "ddot_upper"):
                if not binary and field.startswith("binary"):
                    assert getattr(a, field) is None and getattr(b, field) is None
                    continue
                torch.testing.assert_close(getattr(a, field), getattr(b, field), rtol=1e-12, atol=1e-14)
            assert a.ddot.keys() == b.ddot.keys()
            for name in a.ddot:
                torch.testing.assert_close(a.ddot[name], b.ddot[name], rtol=1e-12, atol=1e-14)
    # a caller's π tails as two columns of one tensor: inputs that alias reach the graph unaliased
    from pdm_lab.policy_side import PolicyOnSupport
    both = torch.stack([pol.tail_logp, pol.tail_log_sumsq], dim=1)
    aliased = PolicyOnSupport(logp=pol.logp, tail_logp=both[:, 0], tail_log_sumsq=both[:, 1])
    a, b = (token_stats(support, aliased, compiled=c) for c in (True, False))
    torch.testing.assert_close(a.topk_kl, b.topk_kl, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(a.ddot["topk"], b.ddot["topk"], rtol=1e-12, atol=1e-14)


def test_unaliased_copies_each_later_tensor_on_a_storage_already_used():
    """What the compiled path hands torch.compile: no two tensors on one storage (direct
    arguments, dataclass fields, dict values of a field), the same values, gradients still flow."""
    import dataclasses

    from pdm_lab.fast.compiled import unaliased

    @dataclasses.dataclass(frozen=True)
    class Pair:
        x: torch.Tensor
        parts: dict

    base = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    whole = base * 1.0
    other = torch.randn(5)
    pair = Pair(x=whole[:, 1], parts={"a": other, "b": torch.randn(3), "c": whole[:, 0]})
    args = (whole, whole[:, 0], pair, other, None, "s", torch.empty(0), torch.empty(0))
    out = unaliased(args)
    assert out[0] is whole and out[4] is None and out[5] == "s"
    tensors = [out[0], out[1], out[2].x, *out[2].parts.values(), out[3]]
    ptrs = [t.untyped_storage().data_ptr() for t in tensors]
    assert len(set(ptrs)) == len(ptrs)
    torch.testing.assert_close(out[1], whole[:, 0])
    torch.testing.assert_close(out[2].x, whole[:, 1])
    torch.testing.assert_close(out[2].parts["c"], whole[:, 0])
    assert out[2].parts["a"] is other and out[3] is not other  # the first user keeps the original
    (out[1].sum() + out[2].x.sum()).backward()
    assert torch.equal(base.grad, torch.ones_like(base))
    untouched = (torch.randn(3), Pair(x=torch.randn(2), parts={}))
    assert all(u is v for u, v in zip(unaliased(untouched), untouched))


@pytest.mark.compile
def test_pads_to_real_compiles_to_the_same_ids():
    """The compiled pad redirection equals the eager one. Inductor's AVX2 code for an int64
    ``torch.where`` gave wrong ids (80 of 84 on this batch, ATEN_CPU_CAPABILITY=avx2 on an AVX-512
    CPU), which the blend in ``_pads_to_real`` avoids; under that setting the test is skipped with
    the other compile tests, since inductor's cache does not tell the two code paths apart."""
    from pdm_lab.policy_side import _pads_to_real

    torch.manual_seed(1)
    ids = torch.stack([torch.randperm(3000)[:21] for _ in range(4)])
    ids[::3, -1] = -1
    torch._dynamo.reset()
    out = torch.compile(_pads_to_real)(ids)
    assert torch.equal(out, _pads_to_real(ids)) and int(out.min()) >= 0
    assert torch.equal(out[ids >= 0], ids[ids >= 0])
