"""``pdm-lab audit`` and ``pdm-lab sweep``: thin command lines over ``pipeline``.

Both start from a preset (``quick`` or ``paper``), optionally a YAML file (``--config``, the
preset's fields as keys), then individual flags override single fields.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from pdm_lab.config import from_dict, to_dict

from .audit import AuditConfig
from .executors import EXECUTORS, make_executor
from .mismatch import MISMATCH_KINDS
from .presets import AUDIT_PRESETS, SWEEP_PRESETS, preset
from .problems import PROBLEM_KINDS
from .sweep import SweepConfig


def register(subparsers) -> None:
    """Add the ``audit`` and ``sweep`` subcommands to the ``pdm-lab`` parser."""
    audit = subparsers.add_parser(
        "audit", help="direction audit (SPEC §6): unsafe-keep of two rules over seeds, with CI and sign test",
        description="One optimiser step per rule from the same parameters on the same batch; over tokens "
                    "outside the region where two rules disagree, how often each rule's kept tokens grew D. "
                    "Writes audit.json, audit.md and figures.")
    audit.add_argument("--preset", default="paper", choices=sorted(AUDIT_PRESETS),
                       help="starting configuration (default: paper = 61 seeds × 1024 sequences, token MDP, neural policy; quick = 16 seeds on the bandit)")
    audit.add_argument("--config", type=Path, help="YAML file with AuditConfig fields")
    audit.add_argument("--out", type=Path, default=None, help="output folder (default: runs/audit-<preset>)")
    audit.add_argument("--problem", choices=PROBLEM_KINDS, help="bandit or token_mdp")
    audit.add_argument("--policy", choices=("tabular", "neural"))
    audit.add_argument("--rules", nargs=2, metavar=("A", "B"), help="the compared pair (A is the reference)")
    audit.add_argument("--extra-rules", nargs="*", help="further rules audited against A")
    audit.add_argument("--seeds", type=int)
    audit.add_argument("--sequences", type=int, help="sequences per batch")
    audit.add_argument("--delta", type=float)
    audit.add_argument("--k", type=int)
    audit.add_argument("--convention", choices=("union", "kslot"))
    audit.add_argument("--mismatch", help=f"μ's mismatch, kind:strength joined by '+'; kinds: {', '.join(MISMATCH_KINDS)}")
    audit.add_argument("--optimizer", choices=("sgd", "adam"))
    audit.add_argument("--lr", type=float)
    audit.add_argument("--warmup-steps", type=int)
    audit.add_argument("--k-sweep", type=int, nargs="*", help="K values of study (b); none to skip")
    audit.add_argument("--contexts", nargs="+", choices=("shared", "distinct"),
                       help="shared (the batch's own states) and/or distinct (one token per state); first is the main study")
    audit.add_argument("--quiet", action="store_true", help="no progress bar")
    audit.set_defaults(func=audit_main)

    sweep = subparsers.add_parser(
        "sweep", help="resumable grid of GRPO runs: rules × mismatch × δ × K × seeds, with report.md",
        description="Runs every unfinished cell × seed in parallel, writes results.csv/json, figures and "
                    "report.md; re-running the same command resumes where it stopped.")
    sweep.add_argument("--preset", default="quick", choices=sorted(SWEEP_PRESETS),
                       help="starting grid (default: quick, about two minutes on 2 cores)")
    sweep.add_argument("--config", type=Path, help="YAML file with SweepConfig fields")
    sweep.add_argument("--out", type=Path, default=None, help="results folder (default: runs/sweep-<preset>)")
    sweep.add_argument("--rules", nargs="+")
    sweep.add_argument("--mismatch", nargs="+", help="mismatch settings, e.g. none noise:1 stale:4")
    sweep.add_argument("--kinds", nargs="+", help="with --strengths: every kind at every strength")
    sweep.add_argument("--strengths", nargs="+", type=float)
    sweep.add_argument("--base-mismatch", help="composed into every cell (e.g. stale:2)")
    sweep.add_argument("--deltas", nargs="+", type=float)
    sweep.add_argument("--ks", nargs="+", type=int)
    sweep.add_argument("--conventions", nargs="+", choices=("union", "kslot"))
    sweep.add_argument("--seeds", type=int)
    sweep.add_argument("--steps", type=int, help="GRPO steps per run")
    sweep.add_argument("--problem", choices=PROBLEM_KINDS)
    sweep.add_argument("--policy", choices=("tabular", "neural"))
    sweep.add_argument("--optimizer", choices=("adam", "sgd"))
    sweep.add_argument("--lr", type=float)
    sweep.add_argument("--epochs", type=int)
    sweep.add_argument("--minibatches", type=int)
    sweep.add_argument("--workers", type=int, default=None, help="parallel processes (default: all cores)")
    sweep.add_argument("--executor", choices=EXECUTORS, default="local")
    sweep.add_argument("--ray-address", default=None, help="Ray cluster address (default: a local instance)")
    sweep.add_argument("--audit", dest="audit", action="store_true", default=None,
                       help="also run the preset's audit and put it in report.md (default for quick)")
    sweep.add_argument("--no-audit", dest="audit", action="store_false")
    sweep.add_argument("--quiet", action="store_true", help="no progress bar")
    sweep.set_defaults(func=sweep_main)

    from .calibrate import add_parser as add_calibrate
    add_calibrate(subparsers)


def _merge(base, path: Path | None):
    """``base`` with the keys of a YAML file laid over it (unknown keys: ConfigError)."""
    if path is None:
        return base
    import yaml

    overrides = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    merged = to_dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_update(merged[key], value)
        else:
            merged[key] = value
    return from_dict(type(base), merged)


def _deep_update(target: dict, update: dict) -> dict:
    out = dict(target)
    for key, value in update.items():
        out[key] = _deep_update(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _with_problem(problem, kind: str | None):
    return problem if kind is None else replace(problem, kind=kind)


def audit_config(args: argparse.Namespace) -> AuditConfig:
    cfg = _merge(preset(AUDIT_PRESETS, args.preset), args.config)
    fields = {"policy": args.policy, "seeds": args.seeds, "sequences": args.sequences,
              "delta": args.delta, "k": args.k, "convention": args.convention,
              "mismatch": args.mismatch, "optimizer": args.optimizer, "lr": args.lr,
              "warmup_steps": args.warmup_steps}
    cfg = replace(cfg, **{k: v for k, v in fields.items() if v is not None})
    if args.problem:
        cfg = replace(cfg, problem=_with_problem(cfg.problem, args.problem))
    if args.rules:
        cfg = replace(cfg, rules=tuple(args.rules))
    if args.extra_rules is not None:
        cfg = replace(cfg, extra_rules=tuple(args.extra_rules))
    if args.k_sweep is not None:
        cfg = replace(cfg, k_sweep=tuple(args.k_sweep))
    if args.contexts:
        cfg = replace(cfg, contexts=tuple(args.contexts))
    return cfg


def sweep_config(args: argparse.Namespace) -> SweepConfig:
    cfg = _merge(preset(SWEEP_PRESETS, args.preset), args.config)
    base_fields = {"steps": args.steps, "policy": args.policy, "optimizer": args.optimizer,
                   "lr": args.lr, "epochs": args.epochs, "minibatches": args.minibatches}
    base = replace(cfg.base, **{k: v for k, v in base_fields.items() if v is not None})
    base = replace(base, problem=_with_problem(base.problem, args.problem))
    cfg = replace(cfg, base=base)
    mismatches = list(args.mismatch or [])
    if args.kinds:
        strengths = args.strengths or [1.0]
        mismatches += [f"{kind}:{s:g}" for kind in args.kinds for s in strengths]
    if mismatches:
        cfg = replace(cfg, mismatches=tuple(mismatches))
    grid = {"rules": args.rules, "deltas": args.deltas, "ks": args.ks, "conventions": args.conventions}
    cfg = replace(cfg, **{k: tuple(v) for k, v in grid.items() if v})
    if args.seeds is not None:
        cfg = replace(cfg, seeds=args.seeds)
    if args.base_mismatch is not None:
        cfg = replace(cfg, base_mismatch=args.base_mismatch)
    return cfg


def _config_or_exit(build, args: argparse.Namespace, command: str):
    """Build a config; a bad key or value prints one line and exits with status 2."""
    from pdm_lab.config import ConfigError

    try:
        return build(args)
    except (ConfigError, ValueError, OSError) as err:
        raise SystemExit(f"pdm-lab {command}: error: {err}") from None


def audit_main(args: argparse.Namespace) -> int:
    from .pipeline import audit_to_dir

    cfg = _config_or_exit(audit_config, args, "audit")
    import torch

    torch.set_num_threads(1)  # small [N, n] ops: one thread is fastest on few cores
    out = args.out or Path("runs") / f"audit-{args.preset}"
    doc = audit_to_dir(cfg, out, progress=not args.quiet)
    pair = doc["pairs"][0]
    a, b, d = pair["a"], pair["b"], pair["unsafe_keep_diff"]
    print(f"unsafe-keep {a} {pair[a]['unsafe_keep_mean']:.3f} vs {b} {pair[b]['unsafe_keep_mean']:.3f}; "
          f"A − B {d['mean_diff']:.3f} [{d['ci_low']:.3f}, {d['ci_high']:.3f}], sign test p = {d['sign_test_p']:.3g} "
          f"({d['b_lower_seeds']} of {d['seeds_used']} seeds lower for {b}); {doc['wall_s']:.1f} s")
    print(f"audit written to {out / 'audit.json'} (summary: {out / 'audit.md'})")
    return 0


def sweep_main(args: argparse.Namespace) -> int:
    from .pipeline import sweep_to_dir

    cfg = _config_or_exit(sweep_config, args, "sweep")
    out = args.out or Path("runs") / f"sweep-{args.preset}"
    run_audit_too = args.audit if args.audit is not None else args.preset == "quick"
    audit = preset(AUDIT_PRESETS, args.preset) if run_audit_too else None
    executor = make_executor(args.executor, args.workers, args.ray_address)
    status = sweep_to_dir(cfg, out, executor=executor, audit=audit, progress=not args.quiet)
    print(f"{status['ran']} runs now, {status['skipped']} reused, {status['runs']}/{status['total']} done "
          f"in {status['wall_s']:.1f} s")
    print(f"report: {status['report']}")
    return 0
