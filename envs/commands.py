"""``pdm-lab audit`` and ``pdm-lab sweep``: thin command lines over ``pipeline``.

A config is built in layers: a preset (``--preset quick|paper``), then a YAML file with the same
keys (``--config``), then ``key.path=value`` overrides (YAML values), as ``pdm-lab train`` does::

    pdm-lab sweep --preset quick rules=[dppo_topk_kl,pdm_topk] mismatches=[none,noise:1] \\
        deltas=[0.05,0.15] base.steps=20 base.problem.kind=token_mdp --seeds 4
    pdm-lab audit --preset quick sequences=256 k_sweep=[] contexts=[shared]

Each command is one ``register_<name>(subparsers)`` function, declared as an entry point in
``pyproject.toml`` (group ``pdm_lab.commands``) and found by the ``pdm-lab`` CLI.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdm_lab.cli.main import int_at_least, integer
from pdm_lab.config import ConfigError, from_dict, to_dict
from pdm_lab.lab.wandb_log import add_wandb_arguments, wandb_config_from_args
from pdm_lab.lab.yaml_config import apply_overrides, read_yaml

#: Exit status of a command that finished but some of whose runs went non-finite (NaN or inf
#: parameters or loss): its results are written, and say which.
NONFINITE_EXIT = 3

OVERRIDES_HELP = "key.path=value overrides of the config's fields (YAML values: rules=[a,b] base.steps=3)"


def _add_config_arguments(p: argparse.ArgumentParser, presets: dict, default: str, what: str) -> None:
    """The arguments every toy command shares: preset, YAML file, overrides, output folder."""
    p.add_argument("--preset", default=default, choices=sorted(presets),
                   help=f"starting configuration (default: {default})")
    p.add_argument("--config", type=Path, help=f"YAML file with {what} fields, laid over the preset")
    p.add_argument("--out", type=Path, default=None, help=f"output folder (default: runs/{p.prog.split()[-1]}-<preset>)")
    config_class = type(next(iter(presets.values())))
    p.add_argument("--seeds", type=integer(field=(config_class, "seeds")), help="seeds (same as seeds=N)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_wandb_arguments(p)
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help=OVERRIDES_HELP)


def build_config(presets: dict, args: argparse.Namespace):
    """preset → ``--config`` YAML → ``key.path=value`` overrides → ``--seeds``, validated once."""
    from .presets import preset

    base = preset(presets, args.preset)
    doc = to_dict(base)
    if args.config is not None:
        layer = read_yaml(args.config) or {}  # its errors name the file and line
        if not isinstance(layer, dict):
            raise ConfigError(f"{args.config}: expected a mapping at the top level")
        doc = _deep_update(doc, layer)
    doc = apply_overrides(doc, args.overrides)
    if args.seeds is not None:
        doc["seeds"] = args.seeds
    if getattr(args, "contexts", None):
        doc["contexts"] = list(args.contexts)
    return from_dict(type(base), doc)


def _deep_update(target: dict, update: dict) -> dict:
    out = dict(target)
    for key, value in update.items():
        out[key] = _deep_update(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _config_or_exit(presets: dict, args: argparse.Namespace, command: str):
    """Build a config; a bad key or value prints one line and exits with status 2."""
    try:
        return build_config(presets, args)
    except (ConfigError, OSError) as err:
        from pdm_lab.errors import one_line

        print(f"pdm-lab {command}: error: {one_line(err)}", file=sys.stderr)
        raise SystemExit(2) from None


def register_audit(subparsers) -> None:
    """``pdm-lab audit``: the direction audit of SPEC §6."""
    from .presets import AUDIT_PRESETS

    p = subparsers.add_parser(
        "audit", help="direction audit (SPEC §6): unsafe-keep of two rules over seeds, with CI and sign test",
        description="One optimiser step per rule from the same parameters on the same batch; over tokens "
                    "outside the region where two rules disagree, how often each rule's kept tokens grew D. "
                    "Writes audit.json, audit.md and figures. Fields: see AuditConfig (pdm_lab.envs.audit.config); "
                    "e.g. rules=[dppo_topk_kl,pdm_topk] sequences=256 problem.kind=bandit k_sweep=[] "
                    "contexts=[shared].")
    _add_config_arguments(p, AUDIT_PRESETS, "paper", "AuditConfig")
    p.add_argument("--contexts", nargs="+", choices=("shared", "distinct"),
                   help="shared (the batch's own states) and/or distinct (one token per state); the "
                        "first is the main study (same as contexts=[...])")
    p.set_defaults(func=audit_main)


def register_sweep(subparsers) -> None:
    """``pdm-lab sweep``: the resumable grid of toy runs."""
    from pdm_lab.envs.sweep.executors import EXECUTORS
    from .presets import SWEEP_PRESETS

    p = subparsers.add_parser(
        "sweep", help="resumable grid of GRPO runs: rules × mismatch × δ × K × seeds, with report.md",
        description="Runs every unfinished cell × seed in parallel, writes results.csv/json, figures and "
                    "report.md; re-running the same command resumes where it stopped. Fields: see "
                    "SweepConfig (pdm_lab.envs.sweep.grid); e.g. rules=[dppo_topk_kl,pdm_topk] "
                    "mismatches=[none,noise:1,stale:4] deltas=[0.05,0.15] ks=[20] base.steps=20 "
                    "base.problem.kind=token_mdp base.policy=neural base_mismatch=stale:2.")
    _add_config_arguments(p, SWEEP_PRESETS, "quick", "SweepConfig")
    p.add_argument("--workers", type=int_at_least(1), default=None, help="parallel processes (default: all cores)")
    p.add_argument("--executor", choices=EXECUTORS, default="local")
    p.add_argument("--ray-address", default=None, help="Ray cluster address (default: a local instance)")
    p.add_argument("--audit", dest="audit", action="store_true", default=None,
                   help="also run the preset's audit and put it in report.md (default for quick)")
    p.add_argument("--no-audit", dest="audit", action="store_false")
    p.add_argument("--force", action="store_true",
                   help="write into --out even when it holds another grid's results.json/report.md")
    p.add_argument("--move-aside", action="store_true",
                   help="when --out holds another grid's results, rename it <out>.<UTC time> and start afresh "
                        "(the same grid resumes; make run uses this)")
    p.set_defaults(func=sweep_main)


def register_calibrate(subparsers) -> None:
    """``pdm-lab calibrate``: the regime table of a toy setting or of a scaling run (SPEC §6b)."""
    from .study_commands import add_calibrate_parser

    add_calibrate_parser(subparsers)


def register_transfer(subparsers) -> None:
    """``pdm-lab transfer``: the toy audit calibrated to a scaling run vs the run's own audit (SPEC §6c)."""
    from .study_commands import add_transfer_parser

    add_transfer_parser(subparsers)


def register_mechanism(subparsers) -> None:
    """``pdm-lab mechanism``: what moved the divergence in an audited run (SPEC §6d)."""
    from .study_commands import add_mechanism_parser

    add_mechanism_parser(subparsers)


def register(subparsers) -> None:
    """Every toy command (``python -m``-style use; ``pdm-lab`` finds them as entry points)."""
    register_audit(subparsers)
    register_sweep(subparsers)
    register_calibrate(subparsers)
    register_transfer(subparsers)
    register_mechanism(subparsers)


def audit_main(args: argparse.Namespace) -> int:
    from .pipeline import audit_to_dir
    from .presets import AUDIT_PRESETS

    cfg = _config_or_exit(AUDIT_PRESETS, args, "audit")
    # torch's own thread count (the cores): the audit's float64 [10⁵, n] passes use them all
    out = args.out or Path("runs") / f"audit-{args.preset}"
    doc = audit_to_dir(cfg, out, progress=not args.quiet, wandb=wandb_config_from_args(args))
    pair = doc["pairs"][0]
    a, b, d = pair["a"], pair["b"], pair["unsafe_keep_diff"]
    print(f"unsafe-keep {a} {pair[a]['unsafe_keep_mean']:.3f} vs {b} {pair[b]['unsafe_keep_mean']:.3f}; "
          f"A − B {d['mean_diff']:.3f} [{d['ci_low']:.3f}, {d['ci_high']:.3f}], sign test p = {d['sign_test_p']:.3g} "
          f"({d['b_lower_seeds']} of {d['seeds_used']} seeds lower for {b}); {doc['wall_s']:.1f} s")
    print(f"main study at training step {pair['audit_step']}: {doc['outside_mean']:.1f} outside and "
          f"{pair['disagreement_mean']:.1f} disagreement tokens per seed; verdict: {pair['verdict']}")
    print(f"wall time {doc['wall_s']:.1f} s, peak memory {doc['peak_rss_gb']:.2f} GB")
    print(f"audit written to {out / 'audit.json'} (summary: {out / 'audit.md'})")
    return 0


def sweep_main(args: argparse.Namespace) -> int:
    from pdm_lab.lab.results import ResultsError

    from pdm_lab.envs.sweep.executors import make_executor
    from .pipeline import sweep_to_dir
    from .presets import AUDIT_PRESETS, SWEEP_PRESETS, preset

    cfg = _config_or_exit(SWEEP_PRESETS, args, "sweep")
    out = args.out or Path("runs") / f"sweep-{args.preset}"
    run_audit_too = args.audit if args.audit is not None else args.preset == "quick"
    audit = preset(AUDIT_PRESETS, args.preset) if run_audit_too else None
    # the quick job also audits a stress setting where the rules separate (said to be one)
    stress = AUDIT_PRESETS["stress-bandit"] if run_audit_too and args.preset == "quick" else None
    executor = make_executor(args.executor, args.workers, args.ray_address)
    try:
        status = sweep_to_dir(cfg, out, executor=executor, audit=audit, progress=not args.quiet,
                              force=args.force, move_aside=args.move_aside, wandb=wandb_config_from_args(args),
                              stress_audit=stress)
    except ResultsError as err:  # a results folder that cannot be used: bad input, exit status 2
        print(f"pdm-lab sweep: error: {err}", file=sys.stderr)
        return 2
    print(f"{status['ran']} runs now, {status['skipped']} reused, {status['runs']}/{status['total']} done "
          f"in {status['wall_s']:.1f} s")
    print(f"report: {status['report']}")
    if status.get("moved_to"):
        print(f"another grid's results were in {out}: moved to {status['moved_to']}")
    if status.get("nonfinite"):
        print(f"pdm-lab sweep: {status['nonfinite']} of {status['runs']} runs went non-finite (marked in "
              f"results.json and report.md); exit status {NONFINITE_EXIT}", file=sys.stderr)
        return NONFINITE_EXIT
    return 0
