"""The own-update probe and the step decomposition of SPEC §6d (core: no stage imports).

Every direction test of SPEC §3 assumes a step on token t moves only its own logits, along
v = e_k − π. A network moves them along K v (``pdm_lab.audit.probe_kernel``: K = J Jᵀ, or J P Jᵀ under a
diagonal preconditioner), so to first order the token's own update changes a divergence D by

    ΔD_own = η·Â·r·⟨∇_z D, K v⟩.

``own_update_probe`` takes K v from the stage and, per probed token, computes ⟨∇_z D, K v⟩ for the
top-K KL and the full KL by autograd of the core's own divergence functions
(``coupled.differentiable_topk_kl``, ``divergence.full_kl``), then scores each rule's predicted
direction (read off its registry record: Â(r − 1) for a ratio test, Â·Ḋ_estimator for PDM, through
``masks.ratio_outward``/``predictive_outward``) against the sign of ΔD_own, beside the
kernel-aware test Â·⟨∇_z D, (a·I + b·W Wᵀ) v⟩ with (a, b) fitted on a calibration sample.

``step_decomposition`` splits each kept outside token's realised ΔD into its own first-order
term, the rest of the batch's, the optimiser's memory (the same step with every Â = 0) and a
higher-order remainder. The toy, the loop and the TRL audits report both under the same keys;
``"probe/data"`` and ``"decomp/data"`` hold the per-token values so records pool exactly
(``pool_probe``, ``pool_decomposition``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch
from torch import Tensor

from pdm_lab.audit.intervals import mean_ci, median_ci, paired_rate_diff_ci, wilson_ci
from pdm_lab.divergence import full_kl
from pdm_lab.errors import PDMInputError, check_same, check_tensor
from pdm_lab.kernel_direction import kernel_scores, own_direction, topk_kl_logit_grad
from pdm_lab.masks import MaskRule, get_mask_rule, kernel_outward, predictive_outward, ratio_outward
from pdm_lab.policy_side import policy_on_support
from pdm_lab.audit.probe_kernel import FunctionalKernel, LogitKernel
from pdm_lab.tokenwise import token_stats
from pdm_lab.support import Support

__all__ = ["FunctionalKernel", "LogitKernel", "own_direction", "fit_kernel_ab", "own_update_probe",
           "probe_with_kernel", "divergence_grads", "step_decomposition", "pool_probe", "pool_decomposition", "probe_rows",
           "support_in_float64", "DECOMP_PARTS", "SUBSETS"]

SUBSETS = ("outside", "disagreement")
DECOMP_PARTS = ("own", "rest", "memory", "remainder")


def support_in_float64(support: Support) -> Support:
    """μ's support as the rules built it (in the engine's dtype, whose rounding its checks allow),
    with μ cast to float64 for a measurement. Casting first and building in float64 would
    re-check a float32 head mass of 1 + 1e-8 against float64 rounding and refuse it."""
    return dataclasses.replace(support, mu_logp=support.mu_logp.double(), mu_tail_logp=support.mu_tail_logp.double(),
                               mu_kth_logp=support.mu_kth_logp.double())


def fit_kernel_ab(kv: Tensor, v: Tensor, unembedding: Tensor) -> tuple[float, float]:
    """Least squares K v ≈ a·v + b·W Wᵀ v over every entry of a calibration sample ([M, V] each)."""
    check_same(("kv", "v"), kv, v)
    x1, x2 = v.double().reshape(-1), (v.double() @ unembedding.double() @ unembedding.double().t()).reshape(-1)
    design = torch.stack([x1, x2], dim=1)
    if design.shape[0] == 0:
        raise PDMInputError("kv: an empty calibration sample; nothing to fit a and b on")
    sol = torch.linalg.lstsq(design, kv.double().reshape(-1, 1)).solution
    return float(sol[0, 0]), float(sol[1, 0])


def direction_rules(rules: Sequence[str]) -> list[MaskRule]:
    """The rules whose record predicts a direction from the token's own stats: PDM (an estimator)
    and the ratio test (a thresholded divergence with no estimator and nothing beyond the stats)."""
    out = []
    for name in dict.fromkeys(rules):
        rule = get_mask_rule(name)
        if rule.level == "token" and (rule.estimator is not None or (rule.divergence is not None and not rule.needs)):
            out.append(rule)
    return out


def _outward(rule: MaskRule, stats, adv: Tensor, cfg: Any = None) -> Tensor | None:
    if "kernel" in rule.needs:  # pdm_kernel: Â·(Ḋ_topk + λ·h_t), with W given and λ from the mask config
        ratio = getattr(cfg, "kernel_ratio", None)
        return None if stats.kernel is None or ratio is None else kernel_outward(stats, adv, ratio)
    if rule.estimator is None:
        return ratio_outward(stats, adv)
    return predictive_outward(stats, adv, rule.estimator) if rule.estimator in stats.ddot else None


def divergence_grads(support: Support, logits: Tensor, mu_full_logp: Tensor | None):
    """∇_z D for each measured divergence, by autograd of the core's functions; and π on S."""
    grads = {"topk_kl": topk_kl_logit_grad(logits, support)}
    z = logits.detach().double().requires_grad_(True)
    if mu_full_logp is not None:
        grads["full_kl"] = torch.autograd.grad(full_kl(mu_full_logp.double(), torch.log_softmax(z, -1)).sum(), z)[0]
    return grads, policy_on_support(z.detach(), support.ids)


def own_update_probe(support: Support, logits: Tensor, kv: dict[str, Tensor], advantages: Tensor, ratio: Tensor, *,
                     rules: Sequence[str], cfg: Any = None, disagreement: Tensor,
                     mu_full_logp: Tensor | None = None, unembedding: Tensor | None = None,
                     kernel_fit: tuple[float, float] | None = None) -> dict:
    """SPEC §6d's probe on M probed outside tokens (all float64).

    Args:
        support: μ's support of the probed rows (``support_in_float64``).
        logits: [M, V] π's processed logits (after temperature) at θ₀.
        kv: ``"K"`` [M, V] K v; optionally ``"JPJ"`` (J P Jᵀ v) and ``"head"`` (the output layer's part).
        advantages, ratio: [M] Â and r (r > 0 scales ΔD_own, never its sign).
        rules: the compared rules (those predicting a direction are scored: ``direction_rules``).
        cfg: the mask config: ``pdm_kernel`` is scored with its λ (``kernel_ratio``) when it and
            ``unembedding`` are given; the other rules' scores do not read it.
        disagreement: [M] bool, the compared rules' decisions differ on the token.
        mu_full_logp: [M, V] μ's full log-probabilities (toys): adds the full KL.
        unembedding: W [V, d] for the kernel-aware test; kernel_fit: (a, b), else fitted here on
            the probed tokens outside ``disagreement`` (all of them when there are none).

    Returns the summary dict (``summarize_probe``): ``probe/tokens``, ``probe/disagreement_tokens``,
    ``probe/agree[_precond]/<rule>/<subset>/<divergence>``, ``probe/kernel_test[_precond]/…``,
    ``probe/kernel_vs/<rule>/…``, ``probe/cos_kv_v``, ``probe/head_share``, ``probe/kernel_fit``,
    ``probe/data``.
    """
    check_tensor("logits", logits, ndim=2, floating=True)
    check_same(("advantages", "ratio"), advantages, ratio)
    check_same(("advantages", "disagreement"), advantages, disagreement)
    if "K" not in kv:
        raise PDMInputError("kv: needs 'K' (K v per probed row)")
    for key, value in kv.items():
        check_same((f"kv[{key!r}]", "logits"), value, logits)
    adv, r = advantages.double(), ratio.double()
    grads, pi = divergence_grads(support, logits, mu_full_logp)
    logp_full = torch.log_softmax(logits.detach().double(), -1)
    stats = token_stats(support, pi, mu_full=None if mu_full_logp is None else mu_full_logp.double(),
                        pi_full=None if mu_full_logp is None else logp_full)
    if unembedding is not None and any("kernel" in rule.needs for rule in direction_rules(rules)):
        # pdm_kernel's h_t = ⟨Wᵀg, Wᵀv⟩ (kernel_direction), for its predicted sign
        stats = dataclasses.replace(stats, kernel=kernel_scores(logits, unembedding, support))
    v = own_direction(logits, support.sampled)
    k = kv["K"].double()
    data: dict[str, Any] = {"disagreement": disagreement.bool().tolist(), "grows": {}, "grows_precond": {},
                            "outward": {}, "kernel_outward": {}}
    for name, g in grads.items():
        data["grows"][name] = (adv * r * (g * k).sum(-1) > 0).tolist()
        if "JPJ" in kv:
            data["grows_precond"][name] = (adv * r * (g * kv["JPJ"].double()).sum(-1) > 0).tolist()
    for rule in direction_rules(rules):
        out = _outward(rule, stats, adv, cfg)
        if out is not None:
            data["outward"][rule.name] = out.tolist()
    if unembedding is not None and k.shape[0]:
        w = unembedding.double()
        if kernel_fit is None:
            calib = ~disagreement.bool() if bool((~disagreement.bool()).any()) else torch.ones_like(disagreement.bool())
            a, b = fit_kernel_ab(k[calib], v[calib], w)
            data["kernel_fit"] = {"a": a, "b": b, "n": int(calib.sum()), "sample": "probed non-disagreement tokens"}
        else:
            a, b = kernel_fit
            data["kernel_fit"] = {"a": a, "b": b, "n": None, "sample": "given"}
        wv = v @ w
        for name, g in grads.items():
            score = adv * (a * (g * v).sum(-1) + b * ((g @ w) * wv).sum(-1))
            data["kernel_outward"][name] = (score > 0).tolist()
    norm_k, norm_v = k.norm(dim=-1), v.norm(dim=-1)
    data["cos_kv_v"] = ((k * v).sum(-1) / (norm_k * norm_v).clamp(min=1e-300)).tolist()
    head = kv.get("head")
    data["head_share"] = None if head is None else ((head.double() * k).sum(-1) / (norm_k ** 2).clamp(min=1e-300)).tolist()
    return summarize_probe(data)


def probe_with_kernel(kernel: LogitKernel, rows: Tensor, support: Support, logits: Tensor, advantages: Tensor,
                      ratio: Tensor, *, precondition: bool = False, **kwargs) -> dict:
    """v from the logits, K v (and J P Jᵀ v, the head's part, W) from the stage's kernel, then
    ``own_update_probe``: what a stage calls with its ``LogitKernel``."""
    v = own_direction(logits, support.sampled)
    kv = {"K": kernel.kernel_v(rows, v)}
    if precondition:
        kv["JPJ"] = kernel.kernel_v(rows, v, precondition=True)
    head = kernel.head_kernel_v(rows, v)
    if head is not None:
        kv["head"] = head
    kwargs.setdefault("unembedding", kernel.unembedding())
    return own_update_probe(support, logits, kv, advantages, ratio, **kwargs)


def _rate(entry_bits: list[bool], n: int) -> dict:
    agree = sum(entry_bits)
    lo, hi = wilson_ci(agree, n)
    return {"rate": agree / n if n else math.nan, "lo": lo, "hi": hi, "n": n, "agree": agree}


def _quantile_entry(values) -> dict | None:
    if values is None:
        return None
    med, lo, hi = median_ci(values)
    return {"median": med, "lo": lo, "hi": hi, "n": len(values)}


def summarize_probe(data: dict) -> dict:
    """The probe's summary keys from its per-token ``data`` (``own_update_probe``, ``pool_probe``)."""
    dis = torch.tensor(data["disagreement"], dtype=torch.bool)
    subsets = {"outside": torch.ones_like(dis), "disagreement": dis}
    out: dict[str, Any] = {"probe/tokens": int(dis.numel()), "probe/disagreement_tokens": int(dis.sum())}

    def agreement(prefix: str, predicted: dict, truth: dict) -> None:
        for name, pred in predicted.items():
            pred_t = torch.tensor(pred, dtype=torch.bool)
            for div, grows in truth.items():
                right = pred_t == torch.tensor(grows, dtype=torch.bool)
                for subset, sel in subsets.items():
                    out[f"{prefix}/{name}/{subset}/{div}"] = _rate(right[sel].tolist(), int(sel.sum()))

    agreement("probe/agree", data["outward"], data["grows"])
    agreement("probe/agree_precond", data["outward"], data["grows_precond"])
    kernel = {div: {"kernel_test": bits} for div, bits in data["kernel_outward"].items()}
    for div, pred in kernel.items():
        for prefix, truth in (("probe/kernel_test", data["grows"]), ("probe/kernel_test_precond", data["grows_precond"])):
            if div not in truth:
                continue
            right_k = torch.tensor(pred["kernel_test"], dtype=torch.bool) == torch.tensor(truth[div], dtype=torch.bool)
            for subset, sel in subsets.items():
                out[f"{prefix}/{subset}/{div}"] = _rate(right_k[sel].tolist(), int(sel.sum()))
                if prefix != "probe/kernel_test":
                    continue
                for rule, rule_pred in data["outward"].items():
                    right_r = torch.tensor(rule_pred, dtype=torch.bool) == torch.tensor(truth[div], dtype=torch.bool)
                    out[f"probe/kernel_vs/{rule}/{subset}/{div}"] = paired_rate_diff_ci(right_k[sel], right_r[sel])
    out["probe/cos_kv_v"] = _quantile_entry(data["cos_kv_v"])
    out["probe/head_share"] = _quantile_entry(data["head_share"])
    out["probe/kernel_fit"] = data.get("kernel_fit")
    out["probe/data"] = data
    return out


def _pool_data(datas: list[dict]) -> dict:
    first = datas[0]
    pooled: dict[str, Any] = {"disagreement": sum((d["disagreement"] for d in datas), [])}
    for key in ("grows", "grows_precond", "outward", "kernel_outward"):
        names = [n for n in first[key] if all(n in d[key] for d in datas)]
        pooled[key] = {n: sum((d[key][n] for d in datas), []) for n in names}
    pooled["cos_kv_v"] = sum((d["cos_kv_v"] for d in datas), [])
    heads = [d["head_share"] for d in datas]
    pooled["head_share"] = None if any(h is None for h in heads) else sum(heads, [])
    fits = [d.get("kernel_fit") for d in datas if d.get("kernel_fit")]
    if fits:
        pooled["kernel_fit"] = {"a": [f["a"] for f in fits], "b": [f["b"] for f in fits],
                                "n": [f["n"] for f in fits], "sample": fits[0]["sample"]}
    return pooled


def pool_probe(summaries: Sequence[dict]) -> dict:
    """Several probes (steps, ranks, seeds) pooled token by token into one summary. The
    preconditioned keys (``…_precond``) pool over the probes that have them: a run's first audited
    step comes before the optimiser has a preconditioner, and would otherwise drop them all."""
    datas = [s["probe/data"] for s in summaries if s and s.get("probe/data")]
    if not datas:
        raise PDMInputError("pool_probe: no probe data to pool")
    out = summarize_probe(_pool_data(datas))
    with_p = [d for d in datas if d["grows_precond"]]
    if with_p and len(with_p) < len(datas):
        sub = summarize_probe(_pool_data(with_p))
        out.update({k: v for k, v in sub.items() if "_precond/" in k})
    return out


def step_decomposition(d: Tensor, realised: Tensor, own: Tensor, rest: Tensor, memory: Tensor) -> dict:
    """SPEC §6d's split of each kept outside token's realised ΔD (all [M], float64).

    Args:
        d: D before the step; realised: ΔD of the real step; own, rest: first-order terms of the
            token's own update and of the rest of the batch; memory: ΔD of the same step with
            every Â = 0 (the optimiser's memory alone; 0 for plain SGD).

    remainder = realised − own − rest − memory (higher order). Each part's *share* of a token is
    |part|/(|own| + |rest| + |memory| + |remainder|), so a token's shares add up to 1; reported as
    the mean over tokens with a bootstrap 95% CI, beside the median |ΔD|/D (a first-order verdict
    needs it well below 1). Tokens whose four parts are all 0 carry no share.
    """
    for name, x in (("realised", realised), ("own", own), ("rest", rest), ("memory", memory)):
        check_same((name, "d"), x, d)
    data = {"d": d.double().tolist(), "realised": realised.double().tolist(), "own": own.double().tolist(),
            "rest": rest.double().tolist(), "memory": memory.double().tolist()}
    return summarize_decomposition(data)


def summarize_decomposition(data: dict) -> dict:
    """The decomposition's summary keys from its per-token ``data``."""
    t = {k: torch.tensor(data[k], dtype=torch.float64) for k in ("d", "realised", "own", "rest", "memory")}
    parts = {"own": t["own"], "rest": t["rest"], "memory": t["memory"],
             "remainder": t["realised"] - t["own"] - t["rest"] - t["memory"]}
    total = sum(p.abs() for p in parts.values())
    live = total > 0
    out: dict[str, Any] = {"decomp/tokens": int(t["d"].numel())}
    for name, p in parts.items():
        mean, lo, hi = mean_ci((p.abs()[live] / total[live]).tolist())
        out[f"decomp/share/{name}"] = {"mean": mean, "lo": lo, "hi": hi}
    ratio = t["realised"].abs() / t["d"].clamp(min=1e-300)
    med, lo, hi = median_ci(ratio.tolist())
    out["decomp/median_abs_dd_over_d"] = {"value": med, "lo": lo, "hi": hi}
    out["decomp/data"] = data
    return out


def pool_decomposition(summaries: Sequence[dict]) -> dict:
    """Several decompositions pooled token by token."""
    datas = [s["decomp/data"] for s in summaries if s and s.get("decomp/data")]
    if not datas:
        raise PDMInputError("pool_decomposition: no decomposition data to pool")
    return summarize_decomposition({k: sum((d[k] for d in datas), []) for k in datas[0]})


def probe_rows(outside: Tensor, disagreement: Tensor, cap: int | None, *, seed: int = 0) -> Tensor:
    """[M] long rows to probe: every disagreement token first (in order), then a seeded random
    sample of the other outside tokens, at most ``cap`` in all (None: every outside token)."""
    check_same(("outside", "disagreement"), outside, disagreement)
    dis = (outside.bool() & disagreement.bool()).nonzero(as_tuple=True)[0]
    rest = (outside.bool() & ~disagreement.bool()).nonzero(as_tuple=True)[0]
    rest = rest[torch.randperm(rest.numel(), generator=torch.Generator().manual_seed(seed))]
    rows = torch.cat([dis, rest])
    return rows if cap is None else rows[:cap]
