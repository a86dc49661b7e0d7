"""Policy loss: gradients, ratio cap, aggregations, response mask, metrics."""
import pytest
import torch

from core_helpers import mismatched_pair, sample_from
from pdm_lab import MaskConfig, aggregate, pdm_policy_loss, policy_on_support, support_from_full


def _setup(b=3, t=4, n=30, seed=0, noise=1.0):
    mu, pi_lp = mismatched_pair(b * t, n, seed, noise=noise)
    sampled = sample_from(mu, seed)
    support = support_from_full(mu, sampled, k=5)
    logits = pi_lp.clone().requires_grad_()
    adv = torch.randn(b, t, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return mu, logits, sampled, support, adv


@pytest.mark.parametrize("cap", [None, 1.1])
def test_gradient_is_masked_capped_ratio_times_advantage(cap):
    mu, logits, sampled, support, adv = _setup()
    resp = torch.ones_like(adv, dtype=torch.bool)
    resp[0, -1] = False
    cfg = MaskConfig(rule="pdm_uniform", delta=0.05, k=5, clip_ratio_c=cap, aggregation="seq-mean-token-sum")
    pol = policy_on_support(logits, support.ids)
    out = pdm_policy_loss(pol, support, adv, resp, cfg, mu_full=mu, pi_full=logits.detach())
    out.loss.backward()
    # manual: ∇ = −(1/B) Σ_tokens M·min(r, c)·Â·∇ log π_k
    lp = torch.log_softmax(logits.detach(), -1)
    r = torch.exp(lp.gather(1, sampled[:, None])[:, 0] - mu.gather(1, sampled[:, None])[:, 0])
    coef = r if cap is None else torch.clamp(r, max=cap)
    w = out.keep.reshape(-1) * coef * adv.reshape(-1) * resp.reshape(-1)
    grad_logp = -torch.nn.functional.one_hot(sampled, 30).double() + torch.exp(lp)
    expected = (w[:, None] * grad_logp) / 3
    torch.testing.assert_close(logits.grad, expected)
    assert out.keep[0, -1] == 1.0  # padding is never dropped (nor counted)


def test_aggregations():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((6 / 3 + 4 / 3) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", horizon=10).item() == pytest.approx((0.6 + 0.4) / 2)
    garbage = loss.clone()
    garbage[1, 1:] = 1e6
    assert aggregate(garbage, mask, "token-mean").item() == pytest.approx(10 / 4)


def test_metrics_keys_and_ranges():
    mu, logits, _, support, adv = _setup(noise=2.0)
    resp = torch.ones_like(adv, dtype=torch.bool)
    out = pdm_policy_loss(policy_on_support(logits, support.ids), support, adv, resp,
                          MaskConfig(rule="dppo_topk_kl", delta=0.05, k=5), mu_full=mu, pi_full=logits.detach())
    m = out.metrics
    for key in ("mask/frac_dropped", "mask/frac_dropped_pos", "mask/frac_dropped_neg", "mask/frac_outside",
                "mask/dir_disagree", "div/topk_kl_mean", "div/topk_kl_max", "div/mu_tail_mean",
                "div/pi_tail_mean", "ratio/mean", "ratio/min", "ratio/max", "div/full_kl_mean"):
        assert key in m and m[key].dim() == 0 and torch.isfinite(m[key]), key
    assert 0 <= m["mask/frac_dropped"] <= m["mask/frac_outside"] <= 1
    assert m["ratio/min"] <= m["ratio/mean"] <= m["ratio/max"]


def test_binary_divergences_are_computed_only_for_the_rules_that_read_them():
    """DPPO's binary KL/TV (two more passes over [N, m]) only for a rule that reads them; the
    other statistics are the same numbers either way, and a rule that reads them without
    thresholding them says so at registration (``binary_stats=True``)."""
    from pdm_lab import token_stats
    from pdm_lab.errors import PDMInputError
    from pdm_lab.masks import MASK_RULES, compute_mask, register_mask

    mu, logits, sampled, support, adv = _setup()
    resp = torch.ones_like(adv, dtype=torch.bool)
    pol = policy_on_support(logits, support.ids)
    full = token_stats(support, pol)
    lean = token_stats(support, pol, binary=False)
    assert lean.binary_kl is None and lean.binary_tv is None
    for name in ("topk_kl", "topk_tv", "log_ratio", "ratio", "mu_tail", "pi_tail", "ddot_lower", "ddot_upper"):
        assert torch.equal(getattr(lean, name), getattr(full, name)), name
    assert all(torch.equal(lean.ddot[e], full.ddot[e]) for e in full.ddot)
    for rule in ("pdm_topk", "dppo_topk_kl", "dppo_binary_kl", "dppo_binary_tv", "ppo_clip"):
        out = pdm_policy_loss(pol, support, adv, resp, MaskConfig(rule=rule, delta=0.05, k=5))
        if MASK_RULES[rule].binary_stats:
            assert torch.equal(out.stats.binary_kl, full.binary_kl) and torch.equal(out.stats.binary_tv, full.binary_tv)
        else:
            assert out.stats.binary_kl is None, rule
    assert MASK_RULES["dppo_binary_kl"].binary_stats and not MASK_RULES["pdm_topk"].binary_stats
    with pytest.raises(PDMInputError, match=r"dppo_binary_kl.*binary=True"):
        compute_mask(MaskConfig(rule="dppo_binary_kl"), lean, adv.reshape(-1))

    @register_mask("test_reads_binary_kl", divergence="binary_kl", uses_delta=True, binary_stats=True)
    def reads_binary_kl(stats, advantages, cfg):
        return stats.binary_kl > cfg.delta

    try:
        out = pdm_policy_loss(pol, support, adv, resp, MaskConfig(rule="test_reads_binary_kl", delta=0.05, k=5))
        assert torch.equal(out.keep.reshape(-1), (~(full.binary_kl > 0.05)).to(out.keep.dtype))
    finally:
        MASK_RULES.pop("test_reads_binary_kl")


@pytest.mark.compile
@pytest.mark.extended
def test_compiled_loss_equals_eager_and_a_delta_schedule_does_not_recompile():
    """``compiled=True`` runs the stats and the per-token tail (surrogate, aggregation, metric
    sums, and their backward) as compiled graphs: the same loss, gradient, mask and metrics as
    eager; and since the tail never reads δ, a new δ each step compiles nothing new."""
    from torch._dynamo.utils import counters

    mu, logits, sampled, support, adv = _setup(b=4, t=6, n=40, seed=3)
    resp = torch.ones_like(adv, dtype=torch.bool)
    resp[1, -2:] = False
    cases = [MaskConfig(rule="pdm_topk", delta=0.05, k=5),
             MaskConfig(rule="dppo_binary_kl", delta=0.02, k=5, clip_ratio_c=1.5,
                        aggregation="seq-mean-token-sum-norm", horizon=8)]
    for cfg in cases:
        runs = {}
        for compiled in (False, True):
            lg = logits.detach().clone().requires_grad_()
            out = pdm_policy_loss(policy_on_support(lg, support.ids), support, adv, resp, cfg, compiled=compiled)
            out.loss.backward()
            runs[compiled] = (out, lg.grad)
        (eager, g_eager), (comp, g_comp) = runs[False], runs[True]
        torch.testing.assert_close(comp.loss, eager.loss, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(g_comp, g_eager, rtol=1e-12, atol=1e-14)
        assert torch.equal(comp.keep, eager.keep) and 0 < int((eager.keep == 0).sum()) < eager.keep.numel()
        assert comp.metrics.keys() == eager.metrics.keys()
        for key in eager.metrics:
            torch.testing.assert_close(comp.metrics[key], eager.metrics[key], rtol=1e-12, atol=1e-14,
                                       equal_nan=True, msg=key)
    graphs = counters["stats"]["unique_graphs"]
    for delta in (0.01, 0.03, 0.07):
        lg = logits.detach().clone().requires_grad_()
        pdm_policy_loss(policy_on_support(lg, support.ids), support, adv, resp,
                        MaskConfig(rule="pdm_topk", delta=delta, k=5), compiled=True).loss.backward()
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.compile
def test_compiled_loss_takes_a_new_cap_and_horizon_as_inputs():
    """The cap c and the horizon reach the compiled tail as 0-d tensors: each new value gives the
    eager loss and compiles nothing new (as Python floats read off the config, a changed c became
    a symbolic float, and torch 2.13 failed building the graph's guards)."""
    from torch._dynamo.utils import counters

    mu, logits, sampled, support, adv = _setup(b=4, t=6, n=40, seed=5)
    resp = torch.ones_like(adv, dtype=torch.bool)
    resp[2, -3:] = False
    graphs = None
    for cap, horizon in ((1.5, 8), (2.0, 9), (1.25, 12), (3.0, None)):
        cfg = MaskConfig(rule="dppo_binary_kl", delta=0.02, k=5, clip_ratio_c=cap,
                         aggregation="seq-mean-token-sum-norm", horizon=horizon)
        runs = {}
        for compiled in (False, True):
            lg = logits.detach().clone().requires_grad_()
            out = pdm_policy_loss(policy_on_support(lg, support.ids), support, adv, resp, cfg, compiled=compiled)
            out.loss.backward()
            runs[compiled] = (out.loss.detach(), lg.grad)
        torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(runs[True][1], runs[False][1], rtol=1e-12, atol=1e-14)
        if graphs is None:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs


def test_compiled_tail_inputs_are_tensors_none_of_them_a_view_of_another(monkeypatch):
    """What the compiled tail is handed: torch 2.13's guard builder fails, depending on the hash
    seed, on an input that is a view of another input (its base gets a symbol with no source)
    and on a Python number read off the config. So: tensors (a cap and horizon as 0-d tensors),
    strings and None only, and no two tensor inputs sharing storage. Checked eagerly (no compile)."""
    import dataclasses

    import pdm_lab.loss as loss_mod

    seen = []

    def record(fn, compiled):
        def run(*args):
            seen.append(args)
            return fn(*args)
        return run

    monkeypatch.setattr(loss_mod, "maybe_compiled", record)
    mu, logits, sampled, support, adv = _setup(b=4, t=6, n=40, seed=3)
    resp = torch.ones_like(adv, dtype=torch.bool)
    cfg = MaskConfig(rule="dppo_binary_kl", delta=0.02, k=5, clip_ratio_c=1.5,
                     aggregation="seq-mean-token-sum-norm", horizon=8)
    pdm_policy_loss(policy_on_support(logits, support.ids), support, adv, resp, cfg, compiled=False)
    assert not seen  # eager: the tail is called directly
    eager_stats = loss_mod.token_stats  # the stats' own compiled path is tested elsewhere
    monkeypatch.setattr(loss_mod, "token_stats", lambda *a, **k: eager_stats(*a, **{**k, "compiled": False}))
    pdm_policy_loss(policy_on_support(logits, support.ids), support, adv, resp, cfg, compiled=True)
    (args,) = seen
    leaves = []
    for a in args:
        if dataclasses.is_dataclass(a):
            for f in dataclasses.fields(a):
                v = getattr(a, f.name)
                leaves.extend(v.values() if isinstance(v, dict) else [v])
        else:
            leaves.append(a)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    assert all(x is None or isinstance(x, (torch.Tensor, str)) for x in leaves), [type(x) for x in leaves]
    storages = [x.untyped_storage().data_ptr() for x in tensors]
    assert len(set(storages)) == len(storages), "two inputs of the compiled tail share storage"


AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_two_ranks_losses_sum_to_the_single_rank_loss(mode):
    """Data parallel: each rank's loss with the whole batch's counts (``DPInfo``, given once) is
    its share of the whole batch's aggregate — value and gradient. Summed gradients: world = 1;
    averaged (FSDP): world = 2 and the mean is the whole. A rank that normalises by its own count
    (the planted bug: no ``dp``) misses, since the two ranks hold different counts."""
    from pdm_lab.aggregation import DPInfo

    mu, logits, sampled, support, adv = _setup(b=4, t=5, n=30, seed=7)
    resp = torch.ones_like(adv, dtype=torch.bool)
    resp[0, 3:] = False
    resp[2, 1:] = False
    resp[3, :] = False  # a sequence with no response token counts nowhere
    cfg = MaskConfig(rule="pdm_topk", delta=0.02, k=5, aggregation=mode, horizon=7)
    pol = policy_on_support(logits, support.ids)
    whole = pdm_policy_loss(pol, support, adv, resp, cfg)
    (whole_grad,) = torch.autograd.grad(whole.loss, logits)
    assert whole.keep.eq(0).any()  # the mask is part of what the split must preserve

    ranks = (torch.tensor([0, 1]), torch.tensor([2, 3]))  # sequences: ranks of unequal counts
    rows = [(r[:, None] * 5 + torch.arange(5)).reshape(-1) for r in ranks]
    counts = [(int(resp[r].sum()), int(resp[r].any(1).sum())) for r in ranks]

    def rank_loss(r, rr, dp):
        part = type(support)(**{f: getattr(support, f)[rr] for f in ("ids", "k_index", "mu_logp", "mu_tail_logp",
                                                                      "mu_kth_logp", "tail_count")},
                             vocab_size=support.vocab_size)
        pi = policy_on_support(logits[rr], part.ids)
        return pdm_policy_loss(pi, part, adv[r], resp[r], cfg, dp=dp).loss

    for world in (1, 2):
        dp = DPInfo(tokens=sum(c[0] for c in counts), sequences=sum(c[1] for c in counts), world=world)
        losses = [rank_loss(r, rr, dp) for r, rr in zip(ranks, rows)]
        total = (losses[0] + losses[1]) / world
        (grad,) = torch.autograd.grad(total, logits)
        torch.testing.assert_close(total, whole.loss, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(grad, whole_grad, rtol=1e-10, atol=1e-15)
    local = rank_loss(ranks[0], rows[0], None) + rank_loss(ranks[1], rows[1], None)
    assert not torch.isclose(local, whole.loss, rtol=1e-6)


def test_dp_counts_are_required_for_the_mode_and_reach_the_compiled_tail_as_inputs():
    """A DPInfo without the count a mode divides by is refused, naming the field; the compiled
    tail takes new counts as inputs (no recompile) and equals eager."""
    from torch._dynamo.utils import counters

    from pdm_lab.aggregation import DPInfo
    from pdm_lab.errors import PDMInputError

    mu, logits, sampled, support, adv = _setup(b=2, t=4, n=30, seed=2)
    resp = torch.ones_like(adv, dtype=torch.bool)
    with pytest.raises(PDMInputError, match="DPInfo.sequences"):
        aggregate(adv, resp, "seq-mean-token-sum", dp=DPInfo(tokens=8))
    cfg = MaskConfig(rule="pdm_topk", delta=0.02, k=5)
    graphs = None
    for tokens in (13.0, 21.0):
        runs = {}
        for compiled in (False, True):
            out = pdm_policy_loss(policy_on_support(logits, support.ids), support, adv, resp, cfg,
                                  dp=DPInfo(tokens=tokens, world=2), compiled=compiled)
            runs[compiled] = (out.loss, torch.autograd.grad(out.loss, logits)[0])
        torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(runs[True][1], runs[False][1], rtol=1e-12, atol=1e-15)
        graphs = counters["stats"]["unique_graphs"] if graphs is None else graphs
    assert counters["stats"]["unique_graphs"] == graphs
