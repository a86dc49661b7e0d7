"""Metrics as sums: one merge, exact across mini-batches, ranks (real gloo) and seeds; a key
with nothing behind it is NaN (n/a), never 0.0."""
from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from pdm_lab.mask_config import MaskConfig
from pdm_lab.metrics import (MISMATCH_KEYS, all_reduce_metrics, as_mismatch, finalize, finalize_floats,
                             merge_metrics, metric, step_metric_sums)
from pdm_lab.policy_side import policy_on_support
from pdm_lab.tokenwise import token_stats
from pdm_lab.support import support_from_full


def batch(n=240, vocab=50, seed=0, noise=1.5):
    gen = torch.Generator().manual_seed(seed)
    mu = torch.log_softmax(torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 2, -1)
    pi = torch.log_softmax(mu + noise * torch.randn(n, vocab, generator=gen, dtype=torch.float64), -1)
    sampled = torch.multinomial(mu.exp(), 1, generator=gen)[:, 0]
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    adv[::7] = 0.0
    support = support_from_full(mu, sampled, k=5)
    stats = token_stats(support, policy_on_support(pi, support.ids), mu_full=mu, pi_full=pi)
    keep = (torch.rand(n, generator=gen) > 0.3).double()
    resp = torch.rand(n, generator=gen) > 0.2
    return stats, keep, adv, resp


def _slice(stats, rows):
    import dataclasses
    fields = {}
    for f in dataclasses.fields(stats):
        v = getattr(stats, f.name)
        fields[f.name] = {k: t[rows] for k, t in v.items()} if isinstance(v, dict) else (None if v is None else v[rows])
    return type(stats)(**fields)


CFG = MaskConfig(rule="pdm_topk", delta=0.1, delta_neg=0.3, k=5)


def test_merging_parts_equals_the_whole_batch():
    stats, keep, adv, resp = batch()
    whole = finalize(step_metric_sums(stats, keep, adv, resp, CFG))
    cuts = [0, 17, 100, 101, 240]  # uneven parts, one of a single token
    parts = [step_metric_sums(_slice(stats, slice(a, b)), keep[a:b], adv[a:b], resp[a:b], CFG)
             for a, b in zip(cuts, cuts[1:])]
    merged = finalize(merge_metrics(*parts))
    assert set(merged) == set(whole)
    for key in whole:
        assert torch.allclose(merged[key], whole[key], rtol=1e-12, atol=0), key
    # the direction metric is the rule's own estimator (pdm_topk → Ḋ_topk), among outside tokens
    outside = resp & (stats.topk_kl > torch.where(adv < 0, 0.3, 0.1))
    want = (torch.sign(stats.log_ratio) != torch.sign(stats.ddot["topk"]))[outside].double().mean()
    assert whole["mask/dir_disagree"] == pytest.approx(float(want), abs=1e-12)
    assert whole["tokens/response"] == int(resp.sum())
    assert whole["ratio/max"] == stats.ratio[resp].max() and whole["ratio/min"] == stats.ratio[resp].min()


def test_a_key_with_no_tokens_is_nan_not_zero():
    stats, keep, adv, resp = batch(n=30)
    cfg = MaskConfig(rule="pdm_topk", delta=1e9, k=5)  # nothing outside
    m = finalize_floats(step_metric_sums(stats, keep, adv, resp, cfg))
    assert m["mask/frac_outside"] == 0.0
    assert math.isnan(m["mask/dir_disagree"]) and math.isnan(m["mask/ddot_sign_certified"])
    none = torch.zeros_like(resp)
    m = finalize_floats(step_metric_sums(stats, keep, adv, none, cfg))
    assert math.isnan(m["div/topk_kl_max"]) and math.isnan(m["ratio/min"]) and m["tokens/response"] == 0
    # merged with a part that has tokens, the empty part changes nothing
    full = step_metric_sums(stats, keep, adv, resp, CFG)
    merged = finalize_floats(merge_metrics(step_metric_sums(stats, keep, adv, none, CFG), full))
    assert merged == pytest.approx(finalize_floats(full), nan_ok=True)


def test_merge_refuses_mixed_reductions_and_mismatch_view():
    with pytest.raises(ValueError, match="reduction 'mean' merged with 'max'"):
        merge_metrics({"a": metric("mean", 1.0, 2)}, {"a": metric("max", 3.0)})
    with pytest.raises(ValueError, match="unknown 'median'"):
        metric("median", 1.0)
    stats, keep, adv, resp = batch(n=40)
    sums = step_metric_sums(stats, None, adv, resp, CFG)
    assert not any(k.startswith("mask/frac_dropped") for k in sums)  # no mask yet: no dropped keys
    view = as_mismatch(sums)
    mismatch_view = {k for k in view if k.startswith("mismatch/")}  # rollout_corr/*: test_core_rollout_metrics
    assert mismatch_view == set(MISMATCH_KEYS.values()) and view["mismatch/ratio_min"] is sums["ratio/min"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        stats, keep, adv, resp = batch()
        rows = slice(rank * 100, (rank + 1) * 100 + 40 * rank)  # unequal shares: 100 and 140 tokens
        local = step_metric_sums(_slice(stats, rows), keep[rows], adv[rows], resp[rows], CFG)
        local["loss/grad_norm"] = metric("mean", 2.5)
        reduced = finalize_floats(all_reduce_metrics(local))
        try:
            renamed = {("ratio/min2" if k == "ratio/min" else k): v for k, v in local.items()}
            all_reduce_metrics(renamed if rank else local)  # same sizes, different keys
            mismatch = "no error"
        except RuntimeError as err:
            mismatch = str(err)
        queue.put((rank, reduced, mismatch))
    finally:
        dist.destroy_process_group()


def test_all_reduce_over_two_gloo_ranks_equals_one_process():
    stats, keep, adv, resp = batch()
    whole = finalize_floats(merge_metrics(step_metric_sums(stats, keep, adv, resp, CFG),
                                          {"loss/grad_norm": metric("mean", 2.5)}))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for _, reduced, mismatch in results:
        assert reduced == pytest.approx(whole, rel=1e-12, nan_ok=True)
        assert "ranks hold different metric keys" in mismatch


@pytest.mark.parametrize("cfg", [CFG, MaskConfig(rule="pdm_topk", delta=0.1, k=5)], ids=["delta_neg", "one_delta"])
def test_every_key_equals_its_plain_definition(cfg):
    """Each key against boolean indexing in float64: the fractions (counts of bools), the region
    with one threshold or two, the means and extremes over response tokens."""
    stats, keep, adv, resp = batch()
    got = finalize_floats(step_metric_sums(stats, keep, adv, resp, cfg))
    threshold = torch.where(adv < 0, cfg.delta_for_negative, cfg.delta)
    outside = resp & (stats.topk_kl > threshold)
    dropped = keep == 0
    certified = (stats.ddot_lower > 0) | (stats.ddot_upper < 0)
    disagree = torch.sign(stats.log_ratio) != torch.sign(stats.ddot["topk"])
    want = {"mask/frac_dropped": dropped[resp], "mask/frac_dropped_pos": dropped[resp & (adv > 0)],
            "mask/frac_dropped_neg": dropped[resp & (adv < 0)], "mask/frac_outside": outside[resp],
            "div/topk_kl_mean": stats.topk_kl[resp], "div/topk_tv_mean": stats.topk_tv[resp],
            "div/mu_tail_mean": stats.mu_tail[resp], "div/pi_tail_mean": stats.pi_tail[resp],
            "ratio/mean": stats.ratio[resp], "div/full_kl_mean": stats.full_kl[resp],
            "mask/dir_disagree": disagree[outside], "mask/ddot_sign_certified": certified[outside]}
    for key, values in want.items():
        assert got[key] == pytest.approx(float(values.double().mean()), rel=1e-12, abs=1e-15), key
    assert 0 < outside.sum() < resp.sum()  # the region splits the batch: the test can tell
    assert got["div/topk_kl_max"] == float(stats.topk_kl[resp].max())
    assert got["tokens/response"] == int(resp.sum())
