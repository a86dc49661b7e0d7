"""Weights & Biases as a logging backend beside JSONL and TensorBoard: off by default, offline
by default when on (files under the output folder, uploaded later with ``wandb sync``).

One config section for every command (``log.wandb`` in a training config; ``--wandb``,
``--wandb-project``, ``--wandb-tags`` on ``sweep``, ``audit`` and ``transfer``) and one small
wrapper over ``wandb.init``: scalars per step (the JSONL's own values: a null is left out, never
logged as 0), tables from lists of flat rows, PNGs as images. wandb is imported only when a run
starts, so the core never needs it; a missing install is a ``ConfigError`` naming the extra.

W&B's environment is honoured where the config is silent (a config value always wins; the
environment never turns W&B on, it fills in a run that the config turned on): ``WANDB_PROJECT``
(else ``pdm_lab``), ``WANDB_ENTITY``, ``WANDB_MODE`` (else offline), ``WANDB_TAGS``
(comma-separated), ``WANDB_RUN_GROUP`` (else the command's own grouping, e.g. a sweep's folder)
and ``WANDB_DIR`` (else the command's output folder). ``WandbConfig.resolve`` is that rule.

Tables and images are logged at the step they describe (``step``; by default the last step this
run logged, 0 before any), never at a step of their own: a 2-step run has history steps 1 and 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import secrets
from pathlib import Path
from typing import Any, Iterable, Mapping

from pdm_lab.config import ConfigError, config_dataclass, one_of

MODES = ("offline", "online", "disabled")
DEFAULT_PROJECT = "pdm_lab"


@config_dataclass("log.wandb")
class WandbConfig:
    """W&B logging (output only: nothing here changes a result). Off unless ``project`` or
    ``mode`` turns it on."""

    project: str | None = None
    """W&B project; setting it turns W&B on (offline unless ``mode`` says online). Default when
    on: ``pdm_lab``."""
    mode: str | None = None
    """``offline`` (files under the output folder's ``wandb/``; upload later with ``wandb sync``),
    ``online`` or ``disabled``. None: offline when ``project`` is set, else disabled."""
    tags: tuple[str, ...] = ()
    """Tags on every W&B run this command makes. Empty: ``WANDB_TAGS`` (comma-separated), if set."""
    entity: str | None = None
    """W&B entity (user or team). None: ``WANDB_ENTITY``, else W&B's default."""
    group: str | None = None
    """W&B run group. None: ``WANDB_RUN_GROUP``, else the command's own (a sweep's folder name)."""
    dir: str | None = None
    """Folder W&B writes its ``wandb/`` files under. None: ``WANDB_DIR``, else the output folder."""

    def __post_init__(self) -> None:
        if self.mode is not None:
            one_of("log.wandb.mode", self.mode, MODES)
        if self.project is not None and not self.project.strip():
            raise ConfigError("log.wandb.project: empty (leave it out for the default, pdm_lab)")

    @property
    def resolved_mode(self) -> str:
        """The mode a run gets: ``mode``; else, when ``project`` turned W&B on, ``WANDB_MODE``
        (offline when unset); else disabled (the environment never turns W&B on)."""
        if self.mode is not None:
            return self.mode
        if not self.project:
            return "disabled"
        env = os.environ.get("WANDB_MODE", "").strip().lower()
        env = {"dryrun": "offline", "run": "online"}.get(env, env)
        return env if env in MODES else "offline"

    def resolve(self, *, out_dir: str | Path, group: str | None = None,
                env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The ``wandb.init`` arguments this config gives: each field, else its ``WANDB_*``
        variable, else the command's default (``out_dir``, ``group``, project ``pdm_lab``)."""
        env = os.environ if env is None else env

        def pick(value: Any, var: str, default: Any = None) -> Any:
            if value:
                return value
            got = (env.get(var) or "").strip()
            return got or default

        tags = list(self.tags) or [t.strip() for t in (env.get("WANDB_TAGS") or "").split(",") if t.strip()]
        return {"project": pick(self.project, "WANDB_PROJECT", DEFAULT_PROJECT),
                "entity": pick(self.entity, "WANDB_ENTITY"),
                "group": pick(self.group, "WANDB_RUN_GROUP", group),
                "dir": str(pick(self.dir, "WANDB_DIR", str(out_dir))),
                "tags": tags, "mode": self.resolved_mode}

    @property
    def enabled(self) -> bool:
        return self.resolved_mode != "disabled"


def add_wandb_arguments(p: argparse.ArgumentParser) -> None:
    """``--wandb [MODE]``, ``--wandb-project``, ``--wandb-tags``: the ``log.wandb`` fields as flags."""
    p.add_argument("--wandb", nargs="?", const="offline", choices=MODES, default=None, metavar="MODE",
                   help="also log to Weights & Biases: offline (the default when given; files under "
                        "--out/wandb, upload with `wandb sync`), online or disabled")
    p.add_argument("--wandb-project", default=None, help=f"W&B project (turns W&B on; default {DEFAULT_PROJECT})")
    p.add_argument("--wandb-tags", default="", help="comma-separated W&B tags")


def wandb_config_from_args(args: argparse.Namespace) -> WandbConfig:
    tags = tuple(t.strip() for t in (getattr(args, "wandb_tags", "") or "").split(",") if t.strip())
    return WandbConfig(project=getattr(args, "wandb_project", None), mode=getattr(args, "wandb", None), tags=tags)


def flat(doc: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level of ``a.b`` keys; scalars kept, lists left out (a table cell)."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat(value, name + "."))
        elif value is None or isinstance(value, (str, bool, int, float)):
            out[name] = value
    return out


def finite_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record that W&B gets: finite floats; None/NaN/inf left out."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(float(value)):
            out[key] = float(value)
    return out


class WandbRun:
    """One W&B run: ``log`` per step, ``table``, ``images``, ``summary``, ``finish``."""

    def __init__(self, run: Any, wandb: Any):
        self.run, self._wandb = run, wandb
        self.step: int | None = None  # the last step logged (tables and images default to it)

    @classmethod
    def start(cls, cfg: WandbConfig | None, *, name: str, out_dir: str | Path, config: Mapping[str, Any],
              group: str | None = None, job_type: str | None = None,
              resume_id_file: str | Path | None = None) -> "WandbRun | None":
        """A started run, or None when ``cfg`` is off. ``resume_id_file``: the run id is kept there,
        so a resumed training run (or a re-run sweep's report run) continues the same W&B run.
        ``group``: the command's grouping, used when neither the config nor ``WANDB_RUN_GROUP``
        names one; ``out_dir``: where the files go unless the config or ``WANDB_DIR`` says."""
        if cfg is None or not cfg.enabled:
            return None
        try:
            import wandb
        except ImportError:
            raise ConfigError("log.wandb: the wandb package is not installed (pip install 'pdm_lab[wandb]')") from None
        init = cfg.resolve(out_dir=out_dir, group=group)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(init["dir"]).mkdir(parents=True, exist_ok=True)
        run_id = None
        if resume_id_file is not None:
            path = Path(resume_id_file)
            run_id = path.read_text().strip() if path.exists() else secrets.token_hex(6)
            path.write_text(run_id + "\n")
        run = wandb.init(project=init["project"], entity=init["entity"], name=name, group=init["group"],
                         job_type=job_type, tags=init["tags"],
                         config=json.loads(json.dumps(dict(config), default=str)),
                         dir=init["dir"], id=run_id, resume="allow" if run_id else None,
                         settings=wandb.Settings(mode=init["mode"], console="off"))
        return cls(run, wandb)

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """A record's finite numbers (``finite_scalars``) at ``step``."""
        if step is None:
            step = int(getattr(self.run, "step", 0) or 0) if self.step is None else self.step + 1
        self.run.log(finite_scalars(metrics), step=step)
        self.step = step if self.step is None else max(self.step, step)

    def _at(self, step: int | None) -> int:
        """The step a table or image goes to: ``step``, else the last logged one (before any: the
        run's own next step, 0 for a new run, after the last one for a resumed online run)."""
        if step is None:
            step = int(getattr(self.run, "step", 0) or 0) if self.step is None else self.step
        self.step = step if self.step is None else max(self.step, step)
        return step

    def table(self, key: str, rows: Iterable[Mapping[str, Any]], step: int | None = None) -> None:
        """Rows (flat dicts) as a W&B table at ``step`` (default: the last step logged, so no
        step of its own); columns: every key in first-seen order."""
        rows = list(rows)
        if not rows:
            return
        columns = list(dict.fromkeys(k for row in rows for k in row))
        data = [[_cell(row.get(c)) for c in columns] for row in rows]
        self.run.log({key: self._wandb.Table(columns=columns, data=data)}, step=self._at(step))

    def images(self, paths: Mapping[str, str | Path], step: int | None = None) -> None:
        """PNG files as W&B images, keyed by name (missing files skipped), at ``step`` (as ``table``)."""
        logged = {key: self._wandb.Image(str(p)) for key, p in paths.items() if p and Path(p).is_file()}
        if logged:
            self.run.log(logged, step=self._at(step))

    def summary(self, values: Mapping[str, Any]) -> None:
        for key, value in flat(values).items():
            self.run.summary[key] = value

    def finish(self, *, last: bool = True) -> None:
        """Finish the run; ``last``: also stop W&B's service process, so every file of the run is
        written when this returns (False between the runs of one command)."""
        self.run.finish()
        if last:
            self._wandb.teardown()


def _cell(value: Any) -> Any:
    """A table cell: scalars as they are (NaN/inf as None), anything else as JSON text."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return json.dumps(value, default=str)


def audit_tables(doc: Mapping[str, Any], prefix: str = "audit") -> dict[str, list[dict]]:
    """An audit document (``audit.json``) as tables: one row per rule pair (its rates, A − B
    with CI and sign test, verdict), one per seed, and the regime table."""
    tables = {}
    pairs = []
    for pair in doc.get("pairs") or []:
        row = {k: v for k, v in flat(pair).items() if not k.startswith(("data.", "power."))}
        pairs.append(row)
    tables[f"{prefix}/pairs"] = pairs
    tables[f"{prefix}/per_seed"] = [flat(s) for s in doc.get("per_seed") or []]
    if isinstance(doc.get("regime"), Mapping):
        tables[f"{prefix}/regime"] = [flat(doc["regime"])]
    return {k: v for k, v in tables.items() if v}
