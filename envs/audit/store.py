"""The audit's resume store: each seed's record in ``seed_dir/seed_<s>[_at_<step>].pt``, keyed by
the configuration minus the run-only fields, read back with ``weights_only=True`` (a crafted
pickle runs no code)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from pdm_lab.config import to_dict

from pdm_lab.envs.audit.config import AuditConfig
from pdm_lab.envs.audit.points import TrainedPolicies
from pdm_lab.envs.audit.seed import audit_seed


def _seed_path(seed_dir, seed: int):
    return None if seed_dir is None else Path(seed_dir) / f"seed_{seed}.pt"


#: Fields that do not change a seed's record (so runs over different seed ranges share a store).
_RUN_ONLY_FIELDS = ("seeds", "first_seed", "n_boot", "stress_mismatch", "stress_seeds", "k_sweep", "k_sweep_seeds")


def seed_key(cfg: AuditConfig) -> str:
    """What a stored seed record must match: the configuration minus the run-only fields."""
    doc = {k: v for k, v in to_dict(cfg).items() if k not in _RUN_ONLY_FIELDS}
    return json.dumps(doc, sort_keys=True, default=str)


class SeedRecordError(ValueError):
    """A stored seed record that is not one pdm_lab wrote (refused, never executed)."""


def _load_seed_record(path: Path) -> dict:
    """A seed record written by ``audit_seed_resumable``: tensors, numbers, strings and
    containers only (``weights_only=True``), so a crafted pickle runs no code; it is refused."""
    import pickle

    try:
        saved = torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, TypeError) as err:
        raise SeedRecordError(f"{path}: not a pdm_lab seed record, refused ({type(err).__name__}); "
                              "delete it to recompute that seed") from None
    if not isinstance(saved, dict) or not {"config", "record", "inputs"} <= set(saved):
        raise SeedRecordError(f"{path}: not a pdm_lab seed record (keys config, record, inputs), refused")
    return saved


def audit_seed_resumable(cfg: AuditConfig, seed: int, seed_dir, pooled: list | None, *,
                          step: int | None = None, policies: TrainedPolicies | None = None,
                          contexts: tuple[str, ...] | None = None) -> dict:
    """``audit_seed``, stored in ``seed_dir/seed_<s>[_at_<step>].pt`` as soon as it is done and
    read back on a rerun with the same configuration (so a killed 61-seed audit loses only the
    seed in flight). ``pooled``: appended the regime inputs, if given."""
    step = cfg.main_step if step is None else step
    path = _seed_path(seed_dir, seed)
    if path is not None and step != cfg.main_step:
        path = path.with_name(f"seed_{seed}_at_{step}.pt")
    key = seed_key(cfg) + json.dumps({"step": step, "contexts": list(contexts or cfg.contexts)})
    if path is not None and path.exists():
        saved = _load_seed_record(path)
        if saved["config"] == key:
            if pooled is not None:
                pooled.append(tuple(saved["inputs"]))
            return saved["record"]
    inputs: list = []
    record = audit_seed(cfg, seed, keep_d=inputs, step=step, policies=policies, contexts=contexts)
    if pooled is not None:
        pooled.extend(inputs)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"config": key, "record": record, "inputs": inputs[0]}, tmp)
        tmp.replace(path)
    return record

