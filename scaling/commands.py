"""``pdm-lab train`` and ``pdm-lab promote``: thin command lines over the scaling library.

    pdm-lab train --config scaling/configs/tiny-cpu.yaml [key.path=value ...] [--dry-run]
    pdm-lab train --config tiny-cpu --dry-run      # a packaged config by name (from any folder)
    pdm-lab promote SWEEP_DIR --base scaling/configs/qwen3-4b-base-dapo.yaml --out FILE.yaml

Also runnable without the top-level CLI: ``python -m pdm_lab.scaling.commands train ...``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdm_lab.config import ConfigError, at_least, non_negative
from pdm_lab.cli.main import integer, number


def _fail(msg: str) -> int:
    """One line on stderr, exit status 2 (bad input)."""
    from pdm_lab.errors import one_line

    print(f"error: {one_line(ValueError(msg))}", file=sys.stderr)
    return 2


def _naming(path, err: BaseException) -> str:
    """`err`'s message, prefixed by `path` unless it already names it."""
    return str(err) if str(path) in str(err) else f"{path}: {err}"


def packaged_configs() -> list[str]:
    """The configs shipped in the package (``pdm_lab/scaling/configs/*.yaml``), by file name."""
    from importlib.resources import files

    return sorted(p.name for p in files("pdm_lab.scaling.configs").iterdir() if p.name.endswith(".yaml"))


def resolve_config(text: str) -> str:
    """``--config``: a file that exists (relative to the current folder) is used as it is; else a
    bare name (``tiny-cpu`` or ``tiny-cpu.yaml``) is the packaged config of that name; else the
    text unchanged (loading it fails naming it and the packaged configs)."""
    path = Path(text)
    if path.exists() or path.parent != Path("."):
        return text
    from importlib.resources import files

    name = text if text.endswith((".yaml", ".yml")) else f"{text}.yaml"
    packaged = files("pdm_lab.scaling.configs") / name
    return str(packaged) if packaged.is_file() else text


def cmd_train(args: argparse.Namespace) -> int:
    from .assets import ModelPathError
    from .config import load_config
    from .data import DataError

    args.config = resolve_config(args.config)
    if not Path(args.config).exists():
        return _fail(f"--config {args.config}: no such file, and no packaged config of that name "
                     f"(packaged: {', '.join(n.removesuffix('.yaml') for n in packaged_configs())})")
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, OSError) as err:
        return _fail(_naming(args.config, err))
    args.traceback_dir = cfg.resolved_run_dir  # an internal error's traceback goes into the run's folder
    if args.dry_run:
        from .dryrun import dry_run, format_report

        try:
            report = dry_run(cfg, nproc=args.nproc, source=args.config, overrides=args.overrides)
        except (ConfigError, DataError, ModelPathError) as err:
            return _fail(f"dry run of {args.config} failed: {err}")
        print(format_report(report), end="")
        print(f"[dry-run] {args.config}: ok")
        return 0
    from .checkpoint import CheckpointError
    from .launch import launch

    try:
        return launch(cfg, nproc=args.nproc)
    except (DataError, ModelPathError, CheckpointError) as err:  # the user's files, not a bug
        return _fail(str(err))


def cmd_promote(args: argparse.Namespace) -> int:
    from pdm_lab.lab.results import ResultsError

    from .promote import check_out_paths, promote

    out = Path(args.out)  # --target trl|verl: the pdm run config goes beside the launch file
    run_config = out if args.target == "pdm" else out.with_name(out.name + ".pdm.yaml")
    try:
        check_out_paths(Path(args.sweep_dir), Path(args.base), [out, run_config], force=args.force)
        promote(Path(args.sweep_dir), Path(args.base), run_config, criterion=args.criterion,
                tie_tol=args.tie_tol, keep_base_aggregation=args.keep_base_aggregation,
                allow_tie=args.allow_tie, force=args.force)
        if args.target != "pdm":
            from pdm_lab.integrations.launch_files import write_launch_file

            from .config import load_config
            path = write_launch_file(args.target, load_config(run_config), out)
            print(f"[promote] {args.target} launch file → {path}")
    except (ResultsError, ConfigError, OSError) as err:  # anything else is a bug: the CLI reports it
        return _fail(str(err))
    return 0


def register_train(subparsers) -> None:
    """``pdm-lab train`` (entry point of group ``pdm_lab.commands``)."""
    p = subparsers.add_parser(
        "train", help="RL training: vLLM rollouts + FSDP2 trainer + the PDM mask (scaling stage)",
        description="Run (or --dry-run) a full RL training loop from a YAML config. Overrides are "
                    "key.path=value (YAML values), e.g. total_steps=3 mask.rule=dppo_topk_kl.")
    p.add_argument("--config", required=True,
                   help="YAML config file, or the name of a packaged one (tiny-cpu, tiny-llm, "
                        "tiny-llm-0.6b-gpu, qwen3-4b-base-dapo, …: pdm_lab/scaling/configs/)")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides")
    p.add_argument("--dry-run", action="store_true",
                   help="validate config, model config, tokenizer and data; load no weights")
    p.add_argument("--nproc", type=integer(at_least(0)), default=None,
                   help="local ranks (default: launch.nproc_per_node; 0: the machine's default); ignored "
                        "under torchrun")
    p.set_defaults(func=cmd_train)


def register_promote(subparsers) -> None:
    """``pdm-lab promote`` (entry point of group ``pdm_lab.commands``)."""
    q = subparsers.add_parser(
        "promote", help="write a full-run config whose mask: section is a toy sweep's best cell",
        description="Pick the best configuration of a toy sweep (results.json / results.csv) and "
                    "write it into a full-run config, with provenance.")
    q.add_argument("sweep_dir", help="toy sweep output directory")
    q.add_argument("--base", required=True, help="full-run config to start from")
    q.add_argument("--out", required=True, help="where to write the promoted config")
    q.add_argument("--criterion", default="reward", choices=["reward"],
                   help="reward: highest mean final reward among never-collapsed cells, ties → lower unsafe-keep")
    q.add_argument("--tie-tol", type=number(non_negative), default=0.0,
                   help="rewards within this are ties (default 0)")
    q.add_argument("--keep-base-aggregation", action="store_true",
                   help="keep the base config's mask.aggregation and mask.horizon")
    q.add_argument("--target", default="pdm", choices=["pdm", "trl", "verl"],
                   help="pdm: a pdm-lab run config; trl: a PDMGRPOTrainer script; verl: a verl launch script")
    q.add_argument("--allow-tie", action="store_true",
                   help="promote even when the chosen cell is not separated from the runner-up at 95%% or rests "
                        "on too few seeds or too short runs (the header says so)")
    q.add_argument("--force", action="store_true",
                   help="write --out even over an input (results.json, --base) or a file promote did not write")
    q.set_defaults(func=cmd_promote)


# the extra each command needs (``pdm-lab --help`` lists it beside the command)
register_train.extras = ("scaling",)
register_promote.extras = ("scaling",)


def register(subparsers) -> None:
    """Add ``train`` and ``promote`` (this module's own ``main``)."""
    register_train(subparsers)
    register_promote(subparsers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdm_lab.scaling.commands")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
