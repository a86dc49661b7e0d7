"""Prompt data: read JSONL / parquet rows, validate them, tokenise once, and serve them in a
seeded, resumable order.

A row needs a prompt (a string, or a chat message list ``[{"role", "content"}, ...]``) and a
reference answer, at ``data.prompt_key`` / ``data.answer_key`` (dots reach into nested fields, as
in DAPO-Math-17k's parquet: ``prompt_key: prompt``, ``answer_key: reward_model.ground_truth``).
A row that cannot be read is an error naming the file and line, or, with
``data.on_bad_row: skip``, a logged and counted skip, never a silent wrong sample.
"""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any, Iterator


class DataError(ValueError):
    """A prompt file or row that cannot be used; the message names file and line."""


@dataclasses.dataclass(frozen=True)
class PromptRow:
    """One prompt: its token ids (chat template applied) and the reference answer."""

    prompt_ids: tuple[int, ...]
    answer: str
    source: str  # "file:line", for error messages and provenance


@dataclasses.dataclass
class LoadReport:
    """What loading a file kept and dropped."""

    rows: int = 0
    skipped_bad: int = 0
    skipped_long: int = 0
    first_error: str | None = None


def read_records(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, record_or_exception)`` from a .jsonl/.json or .parquet file.

    JSONL lines that fail to parse come back as the ``ValueError`` (the caller decides whether
    that is fatal), so one broken line does not hide the rest of the file.
    """
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: prompt file not found")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as err:
                    yield lineno, ValueError(f"invalid JSON ({err.msg} at column {err.colno})")
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), "
                            "or convert the file to JSONL") from None
        table = pq.read_table(path)
        for i, rec in enumerate(table.to_pylist(), start=1):
            yield i, rec
    else:
        raise DataError(f"{path}: unsupported prompt file type {suffix!r} (use .jsonl or .parquet)")


def get_field(record: Any, key: str) -> Any:
    """``record["a"]["b"]`` for ``key = "a.b"``; raises KeyError naming the missing part."""
    node = record
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(f"missing field {key!r}" + (f" (no {part!r})" if "." in key else ""))
        node = node[part]
    return node


def _messages(prompt: Any, template: str) -> list[dict[str, str]]:
    """A chat message list from a row's prompt field."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("empty prompt")
        return [{"role": "user", "content": template.replace("{prompt}", prompt)}]
    if isinstance(prompt, (list, tuple)) and prompt:
        out = []
        for m in prompt:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                raise ValueError(f"chat message must be {{role: str, content: str}}, got {m!r:.80}")
            out.append({"role": m["role"], "content": m["content"]})
        return out
    raise ValueError(f"prompt must be a string or a non-empty message list, got {type(prompt).__name__}")


def _answer(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        raise ValueError(f"answer must be a string or number, got {value!r}")
    if isinstance(value, (int, float, str)):
        text = str(value)
        if not text.strip():
            raise ValueError("empty answer")
        return text
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (str, int, float)) for v in value):
        return str(value[0])  # some sets store a list of accepted answers; the first is canonical
    raise ValueError(f"answer must be a string or number, got {type(value).__name__}")


def encode_messages(tokenizer, messages: list[dict], apply_chat_template: bool) -> list[int]:
    """Token ids of a prompt (chat template with the generation prompt, or plain text)."""
    if apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("data.apply_chat_template is true but the tokenizer has no chat template")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        return list(ids)
    text = "\n".join(m["content"] for m in messages)
    return list(tokenizer.encode(text, add_special_tokens=True))


def load_prompts(path: str | Path, tokenizer, data_cfg, *, log=print) -> tuple[list[PromptRow], LoadReport]:
    """Read, validate and tokenise one prompt file.

    Args:
        path: .jsonl or .parquet file.
        tokenizer: a Hugging Face tokenizer (chat template used if configured).
        data_cfg: the ``data`` config section (keys, template, limits, on_bad_row).
        log: where skip messages go.

    Raises:
        DataError: a bad row with ``on_bad_row: error``, or no usable row at all.
    """
    report = LoadReport()
    rows: list[PromptRow] = []
    for lineno, rec in read_records(path):
        where = f"{path}:{lineno}"
        try:
            if isinstance(rec, Exception):
                raise rec
            if not isinstance(rec, dict):
                raise ValueError(f"row must be an object, got {type(rec).__name__}")
            messages = _messages(get_field(rec, data_cfg.prompt_key), data_cfg.prompt_template)
            answer = _answer(get_field(rec, data_cfg.answer_key))
            ids = encode_messages(tokenizer, messages, data_cfg.apply_chat_template)
        except (KeyError, ValueError, TypeError) as err:
            msg = f"{where}: bad prompt row: {err}"
            if data_cfg.on_bad_row == "error":
                raise DataError(msg + " (set data.on_bad_row: skip to skip such rows)") from None
            report.skipped_bad += 1
            report.first_error = report.first_error or msg
            log(f"[data] skipping {msg}")
            continue
        if len(ids) > data_cfg.max_prompt_tokens:
            report.skipped_long += 1
            continue
        rows.append(PromptRow(prompt_ids=tuple(ids), answer=answer, source=where))
    report.rows = len(rows)
    if not rows:
        raise DataError(f"{path}: no usable prompt rows (bad: {report.skipped_bad}, "
                        f"longer than {data_cfg.max_prompt_tokens} tokens: {report.skipped_long})")
    return rows, report


@dataclasses.dataclass
class PromptSampler:
    """Seeded epoch-wise order over the prompts; its whole state is ``(epoch, index)``.

    Every rank holds the same sampler and draws the same global batch, then takes its slice:
    no rank ever needs another rank's state, and resume is exact from ``state_dict()``.
    """

    size: int
    seed: int
    shuffle: bool = True
    epoch: int = 0
    index: int = 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[int]:
        """The next ``n`` prompt indices (crossing epochs as needed)."""
        out: list[int] = []
        while len(out) < n:
            order = self._order(self.epoch)
            take = min(n - len(out), self.size - self.index)
            out.extend(order[self.index:self.index + take])
            self.index += take
            if self.index >= self.size:
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "size": self.size, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != self.size or state["seed"] != self.seed:
            raise DataError(f"checkpoint was taken with {state['size']} prompts / seed {state['seed']}, "
                            f"but the data now has {self.size} / seed {self.seed}: resume would "
                            "not continue the same run")
        self.epoch, self.index = state["epoch"], state["index"]
