"""Resolve what a run reads: the model directory, its tokenizer, the prompt files.

Shared by the training loop and ``--dry-run`` so that a dry run checks exactly what a run would
load: the model config (architecture, vocabulary, head_dim for vLLM), the tokenizer and its chat
template, and every prompt row of every file.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .cache import cached_dir
from .data import DataError, PromptRow, load_prompts
from .tasks import write_task_files


class ModelPathError(FileNotFoundError):
    """The configured model directory is missing or incomplete."""


def model_dir(cfg) -> Path:
    """The local model directory (the tiny model is built on first use)."""
    if cfg.model.tiny is not None:
        from .tiny_model import ensure_tiny_model

        if cfg.data.synthetic is None:
            raise DataError("model.tiny needs data.synthetic (its tokenizer and warm-up use the task)")
        return ensure_tiny_model(cfg.model.tiny, cfg.data.synthetic)
    path = Path(cfg.model.path).expanduser()
    if not path.is_dir():
        raise ModelPathError(f"model.path: {path} is not a directory (a local Hugging Face model "
                             "directory with config.json, tokenizer files and *.safetensors)")
    if not (path / "config.json").exists():
        raise ModelPathError(f"model.path: {path} has no config.json")
    return path


def check_model_config(path: Path) -> dict:
    """Read config.json and check what the loop relies on. Returns a summary."""
    cfg = json.loads((path / "config.json").read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    if not arch.endswith("ForCausalLM"):
        raise ModelPathError(f"{path}/config.json: architecture {arch} is not a causal LM")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers") if k not in cfg]
    if missing:
        raise ModelPathError(f"{path}/config.json: missing {', '.join(missing)}")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg.get("num_attention_heads", 1)
    has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.safetensors.index.json"))
    return {"architecture": arch, "vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"],
            "layers": cfg["num_hidden_layers"], "head_dim": head_dim,
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
            "max_position_embeddings": cfg.get("max_position_embeddings"),
            "has_safetensors": has_weights}


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def synthetic_files(cfg) -> tuple[Path, Path]:
    """The synthetic task's train/eval JSONL in the cache (written once)."""
    syn = cfg.data.synthetic
    spec = {"task": dataclasses.asdict(syn), "version": 1}

    def build(out: Path) -> None:
        write_task_files(out, syn.name, n_train=syn.n_train, n_eval=syn.n_eval, seed=syn.seed,
                         max_value=syn.max_value, length=syn.length)

    root = cached_dir("tasks", spec, build)
    return root / "train.jsonl", root / "eval.jsonl"


def data_files(cfg) -> tuple[list[Path], dict[str, Path]]:
    """(train files, {eval name: file}); eval names are file stems (made unique)."""
    if cfg.data.synthetic is not None:
        train, evals = synthetic_files(cfg)
        return [train], {cfg.data.synthetic.name: evals}
    train = [Path(p).expanduser() for p in cfg.data.train_files]
    named: dict[str, Path] = {}
    for p in cfg.data.eval_files:
        stem, i = Path(p).stem, 1
        while stem in named:
            i += 1
            stem = f"{Path(p).stem}_{i}"
        named[stem] = Path(p).expanduser()
    for p in [*train, *named.values()]:
        if not p.exists():
            raise DataError(f"{p}: prompt file not found")
    return train, named


def load_data(cfg, tokenizer, *, log=print) -> tuple[list[PromptRow], dict[str, list[PromptRow]], dict]:
    """All prompts, tokenised: (train rows, eval sets, load report per file)."""
    train_files, eval_files = data_files(cfg)
    train: list[PromptRow] = []
    reports = {}
    for path in train_files:
        rows, rep = load_prompts(path, tokenizer, cfg.data, log=log)
        train.extend(rows)
        reports[str(path)] = dataclasses.asdict(rep)
    evals = {}
    eval_cfg = cfg.data.for_eval() if cfg.data.synthetic is None else cfg.data
    for name, path in eval_files.items():
        rows, rep = load_prompts(path, tokenizer, eval_cfg, log=log)
        evals[name] = rows
        reports[str(path)] = dataclasses.asdict(rep)
    return train, evals, reports


def stop_token_ids(tokenizer, path: Path) -> list[int]:
    """End-of-turn ids: the tokenizer's eos, generation_config's eos, and <|im_end|> if present."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end >= 0:
        ids.add(im_end)
    return sorted(ids)
