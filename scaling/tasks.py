"""Synthetic verifiable tasks for the tiny CPU run: short prompts whose answers a checker knows.

Each task is a function ``(rng) -> (prompt, answer)``; ``write_task_files`` turns a task into the
same JSONL schema a real data set uses (``{"prompt": ..., "answer": ...}``), so the tiny run
reads its data through the exact code path of a full run.

Tasks (``data.synthetic.name``):

* ``add``: ``"add 23 58"`` → ``"81"`` (operands below ``max_value``).
* ``copy``: ``"copy 5 1 7"`` → ``"517"`` (``length`` digits).
* ``reverse``: ``"reverse 5 1 7"`` → ``"715"``.
* ``sort``: ``"sort 5 1 7"`` → ``"157"``.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Callable

TaskFn = Callable[[random.Random, int, int], tuple[str, str]]


def _digits(rng: random.Random, length: int) -> list[str]:
    return [str(rng.randrange(10)) for _ in range(length)]


def _task_add(rng: random.Random, max_value: int, _length: int) -> tuple[str, str]:
    a, b = rng.randrange(max_value), rng.randrange(max_value)
    return f"add {a} {b}", str(a + b)


def _task_copy(rng: random.Random, _max_value: int, length: int) -> tuple[str, str]:
    d = _digits(rng, rng.randint(max(1, length - 1), length))
    return "copy " + " ".join(d), "".join(d)


def _task_reverse(rng: random.Random, _max_value: int, length: int) -> tuple[str, str]:
    d = _digits(rng, rng.randint(max(1, length - 1), length))
    return "reverse " + " ".join(d), "".join(reversed(d))


def _task_sort(rng: random.Random, _max_value: int, length: int) -> tuple[str, str]:
    d = _digits(rng, rng.randint(max(1, length - 1), length))
    return "sort " + " ".join(d), "".join(sorted(d))


TASKS: dict[str, TaskFn] = {
    "add": _task_add,
    "copy": _task_copy,
    "reverse": _task_reverse,
    "sort": _task_sort,
}


def get_task(name: str) -> TaskFn:
    """Look a task up by name; an unknown name raises with the valid ones."""
    if name not in TASKS:
        raise ValueError(f"data.synthetic.name: unknown task {name!r}; valid: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def sample_examples(name: str, n: int, *, seed: int, max_value: int = 100,
                    length: int = 3) -> list[dict[str, str]]:
    """``n`` examples ``{"prompt", "answer"}`` drawn with a seeded generator (same seed, same list)."""
    task = get_task(name)
    rng = random.Random(seed)
    return [dict(zip(("prompt", "answer"), task(rng, max_value, length))) for _ in range(n)]


def corpus_for_tokenizer(name: str, *, seed: int, max_value: int, length: int,
                         n: int = 2000) -> list[str]:
    """Text the tiny tokenizer is trained on: prompts and answers of the task."""
    return [f"{e['prompt']} {e['answer']}" for e in sample_examples(name, n, seed=seed,
                                                                    max_value=max_value, length=length)]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write rows atomically (temp file + rename) so a concurrent reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def write_task_files(out_dir: Path, name: str, *, n_train: int, n_eval: int, seed: int,
                     max_value: int, length: int) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` for a task; eval prompts never appear in train."""
    train = sample_examples(name, n_train, seed=seed, max_value=max_value, length=length)
    seen = {e["prompt"] for e in train}
    pool = sample_examples(name, 20 * n_eval + 100, seed=seed + 1, max_value=max_value, length=length)
    held_out = [e for e in pool if e["prompt"] not in seen]
    uniq: dict[str, dict] = {}
    for e in held_out:
        uniq.setdefault(e["prompt"], e)
    evals = list(uniq.values())[:n_eval]
    train_path, eval_path = out_dir / "train.jsonl", out_dir / "eval.jsonl"
    write_jsonl(train_path, train)
    write_jsonl(eval_path, evals)
    return train_path, eval_path
