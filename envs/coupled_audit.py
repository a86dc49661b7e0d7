"""The aggregate measure of SPEC §3b next to the per-token audit of SPEC §6.

Per seed (the audit's batch, ``audit._audit_batch``), with O = {t : D_t > δ, Â_t ≠ 0} and
everything in float64 (the policy and μ cast; the step is the audited optimiser step):

* per rule, the realised ΔD_O = Σ_{t∈O} (D_t after − D_t before) of the full-batch step, at each
  effective step size η·s (``step_scales``), next to its first-order prediction
  (η s/N) Σ_t M_t c_t (SGD; for Adam the first step is a sign step and only the realised value is
  reported), split into the terms of O's own tokens and of the in-region tokens. ``pdm_coupled``
  makes every term of O's part ≤ 0; the in-region tokens (kept by every rule, c of either sign)
  also move D_O, so the rule bounds ΔD_O to first order only when they do not push it up. The
  scales show where first order stops holding;
* per rule, the per-token unsafe-keep and shrink rates over the out-of-region tokens where it
  disagrees with the reference rule (``rules[0]``), at the base step (scale 1);
* the regime's coupling: tokens per distinct state, and optionally the batch restricted to one
  token per state (the other tokens' Â set to 0: they carry no gradient and leave O).

Across seeds: per-seed values, the paired bootstrap CI of each rule's difference from
``pdm_coupled`` and an exact sign test (``pdm_lab.audit``). Results are appended per seed to a
JSONL file, so an interrupted study resumes.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor

from pdm_lab import audit as stats_lib
from pdm_lab.config import to_dict
from pdm_lab.coupled import outside_set
from pdm_lab.loss import aggregate, token_surrogate
from pdm_lab.masks import compute_mask

from .audit import AuditConfig, _audit_batch
from .coupled import toy_coupled_scores
from .train import make_optimizer
from .update import TokenBatch, current_stats, token_batch

COUPLED = "pdm_coupled"


@dataclass(frozen=True)
class CoupledAuditConfig:
    """The aggregate ΔD_O study: the audit's batch and step, several step sizes, four rules."""

    audit: AuditConfig = field(default_factory=lambda: AuditConfig(single_token=False, k_sweep=()))
    """problem, policy, seeds, batch size, δ, K, mismatch, optimiser and base lr (η)."""
    rules: tuple[str, ...] = ("dppo_topk_kl", "pdm_topk", "pdm_uniform", COUPLED)
    """rules[0] is the reference of the per-token disagreement sets."""
    step_scales: tuple[float, ...] = (0.01, 0.1, 1.0, 10.0)
    """effective step = audit.lr × scale (scale 1: the audit's step)."""
    one_token_per_state: bool = False
    """keep only the first token of each distinct state (the others' Â := 0)."""

    def __post_init__(self) -> None:
        if COUPLED not in self.rules:
            raise ValueError(f"rules must include {COUPLED!r}, got {list(self.rules)}")
        if 1.0 not in self.step_scales:
            raise ValueError("step_scales must include 1.0 (the audit's step, where unsafe-keep is scored)")
        for rule in self.rules:
            self.audit.mask(rule)


def _state_keys(policy, obs: Tensor) -> Tensor:
    enc = policy.encoder
    keys = enc.state_index(obs).long()
    if hasattr(enc, "prior_index"):  # contexts with their own prior row are distinct states too
        keys = keys * (int(enc.prior_index(obs).max()) + 1) + enc.prior_index(obs).long()
    return keys


def one_token_per_state(tokens: TokenBatch, keys: Tensor) -> TokenBatch:
    """The batch with Â = 0 on every response token but the first of its state (row-major)."""
    resp = tokens.response_mask.reshape(-1)
    first = torch.zeros_like(resp)
    seen: set[int] = set()
    for i, key in enumerate(keys.tolist()):
        if resp[i] and key not in seen:
            seen.add(key)
            first[i] = True
    adv = tokens.advantages.reshape(-1) * first
    return replace(tokens, advantages=adv.reshape(tokens.advantages.shape))


def _float64(policy):
    return copy.deepcopy(policy).double()


def _step(policy, tokens: TokenBatch, keep: Tensor, mask_cfg, optimizer: str, lr: float) -> Tensor:
    """One optimiser step with a fixed mask `keep` [B, T] from a copy of `policy`: D after [N].

    The mask does not depend on the step size, so each rule's mask is computed once (by the
    registry, through ``masked_loss``) and reused at every scale; the loss is the core's."""
    trial = copy.deepcopy(policy)
    opt = make_optimizer(optimizer, trial.parameters(), lr)
    logits = trial(tokens.obs)
    logp_k = torch.log_softmax(logits, -1).gather(1, tokens.support.ids.gather(1, tokens.support.k_index[:, None]))[:, 0]
    adv = tokens.advantages.reshape(-1).to(logp_k.dtype)
    per_token = token_surrogate(logp_k, tokens.support.mu_logp_k.to(logp_k.dtype), adv,
                                keep.reshape(-1).to(logp_k.dtype), mask_cfg.clip_ratio_c)
    loss = aggregate(per_token.reshape(tokens.advantages.shape), tokens.response_mask, mask_cfg.aggregation,
                     mask_cfg.horizon)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return current_stats(trial, tokens, full=False).topk_kl


def coupled_audit_seed(cfg: CoupledAuditConfig, seed: int) -> dict:
    """One seed: ΔD_O per rule and step size, its first-order prediction, per-token rates."""
    a = cfg.audit
    policy, batch, adv = _audit_batch(a, seed)
    policy = _float64(policy)
    tokens = token_batch(batch, adv, a.mask(cfg.rules[0]))
    keys = _state_keys(policy, tokens.obs)
    resp = tokens.response_mask.reshape(-1)
    distinct = int(torch.unique(keys[resp]).numel())
    if cfg.one_token_per_state:
        tokens = one_token_per_state(tokens, keys)
    before = current_stats(policy, tokens, full=True)
    adv_n = tokens.advantages.reshape(-1).to(before.ratio.dtype)
    outside = outside_set(before.topk_kl, adv_n, a.mask(COUPLED)) & resp
    n_resp = float(resp.sum())
    c = toy_coupled_scores(policy, tokens, a.mask(COUPLED)).c  # P = I: SGD, or Adam's first step
    with_c = dataclasses.replace(before, coupled=c)
    adv_masked = torch.where(resp, adv_n, torch.zeros_like(adv_n))
    record = {"seed": seed, "tokens": int(resp.sum()), "distinct_states": distinct,
              "tokens_per_state": float(resp.sum()) / max(distinct, 1),
              "active_tokens": int((adv_n != 0).sum()), "outside": int(outside.sum()),
              "d_outside_before": float(before.topk_kl[outside].sum()), "rules": {}}
    keep_base, delta_base = {}, {}
    for rule in cfg.rules:
        mask_cfg = a.mask(rule)
        entry = {"delta_d_outside": {}, "predicted": {}, "kept_outside": None}
        keep = compute_mask(mask_cfg, with_c, adv_masked)  # the registry's rule, as the loss applies it
        for scale in cfg.step_scales:
            lr = a.lr * scale
            after = _step(policy, tokens, keep, mask_cfg, a.optimizer, lr)
            key = f"{scale:g}"
            entry["delta_d_outside"][key] = float((after - before.topk_kl)[outside].sum())
            entry["predicted"][key] = (float(lr / n_resp * (keep * c).sum()) if a.optimizer == "sgd"
                                       else math.nan)
            if scale == 1.0:
                keep_base[rule], delta_base[rule] = keep, after - before.topk_kl
                # first order, split: O's own tokens (≤ 0 for pdm_coupled by construction) and
                # the in-region tokens, which every rule keeps and which move D_O too
                entry["predicted_from_outside"] = float(lr / n_resp * (keep * c)[outside].sum())
                entry["predicted_from_inside"] = float(lr / n_resp * (keep * c)[~outside].sum())
        entry["kept_outside"] = int((keep_base[rule].bool() & outside).sum())
        entry["kept_outside_positive_c"] = int(((keep_base[rule] > 0) & outside & (c > 0)).sum())
        record["rules"][rule] = entry
    ref = cfg.rules[0]
    for rule in cfg.rules[1:]:
        disagree = outside & (keep_base[ref] != keep_base[rule])
        record["rules"][rule]["vs_ref"] = {
            "disagreement": int(disagree.sum()),
            ref: stats_lib.unsafe_keep_rates(delta_base[ref], disagree & (keep_base[ref] > 0)),
            rule: stats_lib.unsafe_keep_rates(delta_base[rule], disagree & (keep_base[rule] > 0))}
    # every kept outside token (no pairing): how often its D grew in the full-batch step
    for rule in cfg.rules:
        kept = outside & (keep_base[rule] > 0)
        record["rules"][rule]["all_kept_outside"] = stats_lib.unsafe_keep_rates(delta_base[rule], kept)
    return record


def summarize(cfg: CoupledAuditConfig, per_seed: list[dict]) -> dict:
    """Means over seeds and paired comparisons against ``pdm_coupled`` (bootstrap CI, sign test)."""
    n_boot = cfg.audit.n_boot
    out: dict = {"seeds": len(per_seed), "rules": {}, "vs_coupled": {}, "vs_ref": {}}
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    out["tokens_per_state_mean"] = mean([s["tokens_per_state"] for s in per_seed])
    out["outside_mean"] = mean([s["outside"] for s in per_seed])
    out["d_outside_before_mean"] = mean([s["d_outside_before"] for s in per_seed])
    for rule in cfg.rules:
        rows = [s["rules"][rule] for s in per_seed]
        r = {"delta_d_outside_mean": {}, "predicted_mean": {}, "delta_d_outside_positive_seeds": {}}
        for scale in cfg.step_scales:
            key = f"{scale:g}"
            vals = [row["delta_d_outside"][key] for row in rows]
            r["delta_d_outside_mean"][key] = mean(vals)
            r["predicted_mean"][key] = mean([row["predicted"][key] for row in rows])
            r["delta_d_outside_positive_seeds"][key] = sum(v > 0 for v in vals)
        kept = [row["all_kept_outside"] for row in rows]
        total = sum(k["count"] for k in kept)
        r["all_kept_outside_unsafe_pooled"] = (sum(k["unsafe_keep"] * k["count"] for k in kept if k["count"]) / total
                                               if total else math.nan)
        r["kept_outside_mean"] = mean([row["kept_outside"] for row in rows])
        out["rules"][rule] = r
        if rule != COUPLED:
            comp = {}
            for scale in cfg.step_scales:
                key = f"{scale:g}"
                x = [s["rules"][COUPLED]["delta_d_outside"][key] for s in per_seed]
                y = [s["rules"][rule]["delta_d_outside"][key] for s in per_seed]
                m, lo, hi = stats_lib.paired_bootstrap_ci(x, y, n_boot=n_boot)
                comp[key] = {"mean_diff": m, "ci_low": lo, "ci_high": hi, "sign_test_p": stats_lib.sign_test(x, y),
                             "coupled_lower_seeds": sum(p < q for p, q in zip(x, y)),
                             "coupled_higher_seeds": sum(p > q for p, q in zip(x, y))}
            out["vs_coupled"][rule] = comp
    ref = cfg.rules[0]
    for rule in cfg.rules[1:]:
        xs = [s["rules"][rule]["vs_ref"][ref]["unsafe_keep"] for s in per_seed]
        ys = [s["rules"][rule]["vs_ref"][rule]["unsafe_keep"] for s in per_seed]
        counts = [s["rules"][rule]["vs_ref"][rule]["count"] for s in per_seed]
        ref_counts = [s["rules"][rule]["vs_ref"][ref]["count"] for s in per_seed]
        pooled = lambda us, cs: (sum(u * c for u, c in zip(us, cs) if c) / sum(cs)) if sum(cs) else math.nan  # noqa: E731
        m, lo, hi = stats_lib.paired_bootstrap_ci(xs, ys, n_boot=n_boot)
        pairs = [(p, q) for p, q in zip(xs, ys) if not (math.isnan(p) or math.isnan(q))]
        out["vs_ref"][rule] = {
            "disagreement_mean": mean([s["rules"][rule]["vs_ref"]["disagreement"] for s in per_seed]),
            f"{ref}_unsafe_pooled": pooled(xs, ref_counts), f"{rule}_unsafe_pooled": pooled(ys, counts),
            f"{ref}_minus_{rule}": {"mean_diff": m, "ci_low": lo, "ci_high": hi,
                                    "sign_test_p": stats_lib.sign_test(xs, ys), "seeds_used": len(pairs),
                                    "rule_lower_seeds": sum(q < p for p, q in pairs),
                                    "ref_lower_seeds": sum(p < q for p, q in pairs)}}
    return out


def run_coupled_audit(cfg: CoupledAuditConfig, out: str | Path | None = None, *, progress=None) -> dict:
    """Every seed (resuming from ``out``/per_seed.jsonl), then the summary (``out``/coupled_audit.json)."""
    start = time.perf_counter()
    done: dict[int, dict] = {}
    path = None
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "per_seed.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    done[rec["seed"]] = rec
    a = cfg.audit
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        if seed in done:
            continue
        done[seed] = coupled_audit_seed(cfg, seed)
        if path is not None:
            with open(path, "a") as fh:
                fh.write(json.dumps(done[seed]) + "\n")
        if progress:
            progress(seed, done[seed])
    per_seed = [done[s] for s in range(a.first_seed, a.first_seed + a.seeds)]
    doc = {"config": to_dict(cfg), "summary": summarize(cfg, per_seed), "per_seed": per_seed,
           "wall_s": time.perf_counter() - start}
    if out is not None:
        (out / "coupled_audit.json").write_text(json.dumps(doc, indent=1))
    return doc


def main(argv: list[str] | None = None) -> int:
    """``python -m pdm_lab.envs.coupled_audit``: the study on the audit's ``quick``/``paper`` preset."""
    import argparse

    from .presets import AUDIT_PRESETS, preset

    ap = argparse.ArgumentParser(prog="python -m pdm_lab.envs.coupled_audit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="paper", choices=sorted(AUDIT_PRESETS))
    ap.add_argument("--policy", choices=("tabular", "neural"))
    ap.add_argument("--seeds", type=int)
    ap.add_argument("--sequences", type=int)
    ap.add_argument("--mismatch")
    ap.add_argument("--scales", type=float, nargs="+", help="step sizes as multiples of the audit's lr (must include 1)")
    ap.add_argument("--one-token-per-state", action="store_true")
    ap.add_argument("--out", type=Path, required=True, help="folder for per_seed.jsonl and coupled_audit.json (resumes)")
    args = ap.parse_args(argv)
    audit = replace(preset(AUDIT_PRESETS, args.preset), single_token=False, k_sweep=())
    for name in ("policy", "seeds", "sequences", "mismatch"):
        if getattr(args, name) is not None:
            audit = replace(audit, **{name: getattr(args, name)})
    cfg = CoupledAuditConfig(audit=audit, one_token_per_state=args.one_token_per_state,
                             **({"step_scales": tuple(args.scales)} if args.scales else {}))
    t0 = time.perf_counter()
    doc = run_coupled_audit(cfg, args.out, progress=lambda seed, rec: print(
        f"seed {seed}: {rec['outside']} outside tokens, {time.perf_counter() - t0:.0f}s", flush=True))
    print(json.dumps(doc["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
