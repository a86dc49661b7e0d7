"""``pdm-lab calibrate``, ``pdm-lab transfer`` and ``python -m pdm_lab.envs.study_commands coupled``:
thin command lines over ``transfer.calibrate`` (SPEC §6b), ``transfer.compare`` (SPEC §6c) and
``audit.coupled`` (SPEC §3b). They live at the top level because they read the named presets."""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from pdm_lab.config import ConfigError, in_range
from pdm_lab.cli.main import int_at_least, integer, number
from pdm_lab.lab.outputs import write_output
from pdm_lab.lab.wandb_log import add_wandb_arguments, wandb_config_from_args

from pdm_lab.envs.audit.config import AuditConfig
# Modules, not their functions: a name bound at import would keep whatever the module held then
# (a test's stand-in included) for the rest of the process.
from pdm_lab.envs.transfer import calibrate, compare
from pdm_lab.envs.transfer.faithful import format_probe_report, run_probe_report


def add_calibrate_parser(subparsers) -> None:
    """The ``calibrate`` subcommand (registered by ``envs.commands.register_calibrate``)."""
    from pdm_lab.envs.problems.mismatch import MISMATCH_KINDS
    from pdm_lab.envs.presets import AUDIT_PRESETS, STRESS_MISMATCHES

    p = subparsers.add_parser(
        "calibrate", help="the mismatch regime of a toy setting or a scaling run (SPEC §6b): D quantiles, outside fraction, tail ratio",
        description="Rolls out a toy setting (an audit preset, optionally with another mismatch) and prints and writes "
                    "calibration.json; --from-run reads a scaling run's per-token mismatch sample instead; --target "
                    "searches the mismatch strength for a given outside fraction.")
    p.add_argument("--preset", default="quick", choices=sorted(AUDIT_PRESETS), help="toy setting (default: quick)")
    p.add_argument("--mismatch", help=f"μ's mismatch (kinds: {', '.join(MISMATCH_KINDS)}; named stress settings: "
                                      f"{', '.join(STRESS_MISMATCHES)})")
    p.add_argument("--seeds", type=int_at_least(1), default=4, help="fresh batches (default 4)")
    p.add_argument("--sequences", type=integer(field=(AuditConfig, "sequences")), help="sequences per batch")
    p.add_argument("--delta", type=number(field=(AuditConfig, "delta")), help="δ (default: the preset's)")
    p.add_argument("--target", type=number(in_range(0.0, 1.0, low_open=True, high_open=True)),
                   help="search the strength for this outside fraction (e.g. 0.002)")
    p.add_argument("--from-run", type=Path, help="a scaling run folder (its mismatch_sample.jsonl, and its "
                                                 "audit.jsonl's probe statistics)")
    p.add_argument("--toy-audit", type=Path, help="with --from-run: a toy audit.json whose probe statistics "
                                                  "are compared with the run's (which match)")
    p.add_argument("--out", type=Path, default=Path("runs/calibrate"), help="output folder")
    p.set_defaults(func=calibrate_main)


def calibrate_main(args) -> int:
    from pdm_lab.envs.presets import AUDIT_PRESETS, STRESS_MISMATCHES, preset

    torch.set_num_threads(1)
    if args.out.exists() and not args.out.is_dir():  # checked before any work; created only to write
        raise ConfigError(f"--out {args.out} is a file; give a folder")
    cfg = preset(AUDIT_PRESETS, args.preset)
    if args.from_run is not None:
        table = calibrate.run_table(args.from_run, args.delta if args.delta is not None else cfg.delta)
        toy_doc = None
        if args.toy_audit is not None:
            try:
                toy_doc = json.loads(args.toy_audit.read_text(encoding="utf-8"))
            except (OSError, ValueError) as err:
                raise ConfigError(f"--toy-audit {args.toy_audit}: not a readable audit.json ({err})") from None
        audited = (args.from_run / "audit.jsonl").exists()
        table["probe"] = run_probe_report(compare.read_audit_lines(args.from_run) if audited else None, toy_doc)
    else:
        changes = {"mismatch": STRESS_MISMATCHES.get(args.mismatch, args.mismatch), "sequences": args.sequences,
                   "delta": args.delta}
        try:
            cfg = replace(cfg, **{k: v for k, v in changes.items() if v is not None})
        except ValueError as err:  # the audit config's own checks: bad input, exit status 2
            raise ConfigError(str(err)) from None
        if args.target is not None:
            spec, table = calibrate.search_strength(cfg, args.target, seeds=max(1, min(args.seeds, 2)),
                                          progress=lambda s, f: print(f"  {s}: outside {100 * f:.3f}%"))
            cfg = replace(cfg, mismatch=spec)
            print(f"strength for an outside fraction of {100 * args.target:.3f}%: {spec}")
        table = calibrate.toy_table(cfg, args.seeds)
    print(calibrate.format_table(table))
    if "mini_batches" in table:  # a run's table: its regime per mini-batch j, and the pooled row compared
        print(calibrate.format_mini_batches(table))
    if "probe" in table:
        print(format_probe_report(table["probe"]))
    path = write_output(args.out / "calibration.json", json.dumps(table, indent=2) + "\n")
    print(f"written to {path}")
    return 0


def add_transfer_parser(subparsers) -> None:
    """The ``transfer`` subcommand (registered by ``envs.commands.register_transfer``)."""
    from pdm_lab.envs.presets import AUDIT_PRESETS

    p = subparsers.add_parser(
        "transfer", help="toy audit calibrated to a scaling run vs the run's own audit (SPEC §6c): does the verdict transfer?",
        description="Reads RUN_DIR/audit.jsonl and RUN_DIR/mismatch_sample.jsonl, calibrates the toy to the run's "
                    "outside fraction, runs the toy audit with the run's rules, δ and K, and writes transfer.json and "
                    "transfer.md: outside and disagreement fractions, unsafe-keep and shrink per rule, A − B, with CIs, "
                    "toy vs loop, and whether the toy's verdict holds.")
    p.add_argument("run_dir", type=Path, nargs="+",
                   help="scaling run directories trained with audit.every=N (several: seeds of one setting, pooled)")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--preset", default="paper", choices=sorted(AUDIT_PRESETS), help="toy setting (default: paper)")
    p.add_argument("--seeds", type=int_at_least(1), help="toy seeds (default: the preset's)")
    p.add_argument("--mismatch", help="use this toy mismatch instead of calibrating")
    p.add_argument("--toy-audit", type=Path, help="compare this toy audit.json (made with the run's rules, δ and K) "
                                                  "instead of running and calibrating one")
    p.add_argument("--n-boot", type=int_at_least(1), default=2000, help="bootstrap resamples")
    p.add_argument("--search-iters", type=int_at_least(1), default=12, help="bisection steps of the calibration (default 12)")
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="toy AuditConfig overrides, e.g. sequences=256")
    add_wandb_arguments(p)
    p.set_defaults(func=transfer_main)


def add_mechanism_parser(subparsers) -> None:
    """The ``mechanism`` subcommand (registered by ``envs.commands.register_mechanism``)."""
    p = subparsers.add_parser(
        "mechanism", help="what moved the divergence in an audited run: own-update probe, step decomposition, "
                          "unsafe-keep across step sizes (SPEC §6d)",
        description="Pools the audit lines of one or more scaling (or TRL) runs trained with audit.every=N and "
                    "audit.probe_tokens > 0, and writes mechanism.json, mechanism.md and mechanism_step_sizes.png: "
                    "each rule's sign agreement with the own update, the kernel-aware test, cos(K v, v), the "
                    "own/rest/memory/remainder shares and unsafe-keep against the step's median |ΔD|/D.")
    p.add_argument("run_dir", type=Path, nargs="+", help="audited run directories (several: seeds of one setting)")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.set_defaults(func=mechanism_main)


def mechanism_main(args: argparse.Namespace) -> int:
    from pdm_lab.envs.transfer.mechanism import mechanism_markdown, write_mechanism

    if args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} is a file; give a folder")
    from pdm_lab.envs.report.step_sizes import step_size_figure
    from pdm_lab.envs.transfer.mechanism import step_records

    doc = write_mechanism(args.run_dir, args.out)
    if doc["step_scales"]:
        step_size_figure(step_records(doc), args.out / "mechanism_step_sizes.png", title=", ".join(doc["runs"]))
    print(mechanism_markdown(doc))
    print(f"written to {args.out / 'mechanism.json'}, {args.out / 'mechanism.md'}")
    return 0


def transfer_main(args: argparse.Namespace) -> int:
    from pdm_lab.config import ConfigError
    from pdm_lab.errors import one_line

    from pdm_lab.envs.presets import AUDIT_PRESETS, preset

    torch.set_num_threads(1)
    try:
        doc = compare.run_transfer(args.run_dir, args.out, preset(AUDIT_PRESETS, args.preset), preset_name=args.preset, seeds=args.seeds, mismatch=args.mismatch,
                           overrides=args.overrides, n_boot=args.n_boot, search_iters=args.search_iters,
                                   toy_audit=args.toy_audit)
    except (FileNotFoundError, ValueError, ConfigError, KeyError) as err:
        print(f"pdm-lab transfer: error: {one_line(err)}", file=sys.stderr)
        return 2
    wandb = wandb_config_from_args(args)
    if wandb.enabled:  # one W&B run: envs.report.to_wandb
        from pdm_lab.envs.report.to_wandb import log_transfer

        log_transfer(wandb, doc, args.out)
    print(compare.markdown(doc))
    print(f"written to {args.out / 'transfer.json'} and {args.out / 'transfer.md'}")
    return 0


def coupled_main(argv: list[str] | None = None) -> int:
    """``python -m pdm_lab.envs.study_commands coupled``: the SPEC §3b study on an audit preset (default ``paper``)."""
    from pdm_lab.envs.audit.coupled import CoupledAuditConfig, report_markdown, run_coupled_audit
    from pdm_lab.envs.presets import AUDIT_PRESETS, preset

    ap = argparse.ArgumentParser(prog="python -m pdm_lab.envs.study_commands coupled",
                                 description="SPEC §3b: realised ΔD_O per rule and step size, per-token unsafe-keep")
    ap.add_argument("--preset", default="paper", choices=sorted(AUDIT_PRESETS))
    ap.add_argument("--policy", choices=("tabular", "neural"))
    ap.add_argument("--seeds", type=int_at_least(1))
    ap.add_argument("--sequences", type=int_at_least(1))
    ap.add_argument("--mismatch")
    ap.add_argument("--contexts", nargs="+", choices=("shared", "distinct"))
    ap.add_argument("--scales", type=float, nargs="+", help="step sizes as multiples of the audit's lr (must include 1)")
    ap.add_argument("--out", type=Path, required=True, help="folder for per_seed.jsonl, coupled_audit.json and report.md (resumes)")
    args = ap.parse_args(argv)
    audit = replace(preset(AUDIT_PRESETS, args.preset), k_sweep=(), stress_mismatch="")
    for name in ("policy", "seeds", "sequences", "mismatch"):
        if getattr(args, name) is not None:
            audit = replace(audit, **{name: getattr(args, name)})
    if args.contexts:
        audit = replace(audit, contexts=tuple(args.contexts))
    cfg = CoupledAuditConfig(audit=audit, **({"step_scales": tuple(args.scales)} if args.scales else {}))
    t0 = time.perf_counter()
    doc = run_coupled_audit(cfg, args.out, progress=lambda seed, rec: print(
        f"seed {seed}: {rec['outside']} outside tokens, {time.perf_counter() - t0:.0f}s", flush=True))
    print(report_markdown(doc))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["coupled"]:
        raise SystemExit("usage: python -m pdm_lab.envs.study_commands coupled [--help]")
    raise SystemExit(coupled_main(sys.argv[2:]))
