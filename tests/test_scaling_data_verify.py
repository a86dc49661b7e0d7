"""Prompt data (bad rows, nested keys, resumable order) and verifiers (math equivalence without
evaluating model output, raising verifiers → skipped samples or a clear stop)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdm_lab.scaling.config import DataConfig
from pdm_lab.scaling.data import DataError, PromptSampler, get_field, load_prompts
from pdm_lab.scaling.math_value import parse_value
from pdm_lab.scaling.verifiers import (RewardError, extract_final_answer, get_verifier, math_equal,
                                       score_responses, verify_math)


class CharTokenizer:
    """Stand-in tokenizer for the data reader: one id per character, a trivial chat template."""

    chat_template = "x"
    eos_token_id = 0

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        return [ord(c) % 256 for m in messages for c in m["role"] + ":" + m["content"]] + [1]

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 256 for c in text]


def write(tmp_path: Path, lines: list) -> Path:
    p = tmp_path / "p.jsonl"
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return p


def test_rows_load_with_nested_keys_and_chat_messages(tmp_path):
    p = write(tmp_path, [{"prompt": [{"role": "user", "content": "1+1?"}], "rm": {"gt": 2}},
                         {"prompt": "2+2?", "rm": {"gt": "4"}}])
    cfg = DataConfig(train_files=(str(p),), answer_key="rm.gt", prompt_template="Q: {prompt} \\boxed{}")
    rows, rep = load_prompts(p, CharTokenizer(), cfg)
    assert [r.answer for r in rows] == ["2", "4"] and rep.rows == 2
    assert rows[1].source.endswith("p.jsonl:2")
    text = "".join(chr(i) for i in rows[1].prompt_ids[:-1])
    assert "Q: 2+2? \\boxed{}" in text  # template braces other than {prompt} survive


@pytest.mark.parametrize("bad,why", [
    ('{"prompt": "x", "answer": ', "invalid JSON"),
    ({"question": "x", "answer": "1"}, "missing field 'prompt'"),
    ({"prompt": "", "answer": "1"}, "empty prompt"),
    ({"prompt": "x", "answer": None}, "answer must be"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, "chat message must be"),
    ([1, 2, 3], "row must be an object"),
])
def test_broken_row_is_an_error_naming_file_and_line(tmp_path, bad, why):
    p = write(tmp_path, [{"prompt": "ok", "answer": "1"}, bad, {"prompt": "ok2", "answer": "2"}])
    cfg = DataConfig(train_files=(str(p),))
    with pytest.raises(DataError, match=rf"p\.jsonl:2: bad prompt row: .*{why}"):
        load_prompts(p, CharTokenizer(), cfg)
    logged = []
    rows, rep = load_prompts(p, CharTokenizer(), DataConfig(train_files=(str(p),), on_bad_row="skip"),
                             log=logged.append)
    assert [r.answer for r in rows] == ["1", "2"] and rep.skipped_bad == 1
    assert "p.jsonl:2" in logged[0]


def test_empty_or_missing_file(tmp_path):
    cfg = DataConfig(train_files=("x",))
    with pytest.raises(DataError, match="not found"):
        load_prompts(tmp_path / "none.jsonl", CharTokenizer(), cfg)
    with pytest.raises(DataError, match="no usable prompt rows"):
        load_prompts(write(tmp_path, ['{"prompt": "x", "answer": "1"}']), CharTokenizer(),
                     DataConfig(train_files=("x",), max_prompt_tokens=2))


def test_get_field():
    assert get_field({"a": {"b": 3}}, "a.b") == 3
    with pytest.raises(KeyError, match="no 'c'"):
        get_field({"a": {"b": 3}}, "a.c")


def test_sampler_order_is_seeded_and_resumable():
    a = PromptSampler(size=10, seed=3)
    first = [a.next_batch(4) for _ in range(2)]
    state = a.state_dict()
    rest = [a.next_batch(4) for _ in range(3)]  # crosses two epoch boundaries
    b = PromptSampler(size=10, seed=3)
    b.load_state_dict(state)
    assert [b.next_batch(4) for _ in range(3)] == rest
    again = PromptSampler(size=10, seed=3)
    assert [again.next_batch(4) for _ in range(2)] == first
    assert sorted(first[0] + first[1] + rest[0][:2]) == list(range(10))  # an epoch is a permutation
    with pytest.raises(DataError, match="resume would not continue"):
        PromptSampler(size=11, seed=3).load_state_dict(state)


# ---------------------------------------------------------------------------- verifiers

@pytest.mark.parametrize("response,answer,expected", [
    ("so the result is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\dfrac12}", "1/2", 1.0),
    ("first \\boxed{3} then \\boxed{4}", "4", 1.0),  # the last box counts
    ("\\boxed{ {2}^{3} }", "8", 1.0),
    ("Answer: 204", "204", 1.0),  # DAPO's format
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{10\\%}", "10", 1.0),
    ("\\boxed{\\text{(B)}}", "(b)", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("no final answer here 4", "4", 0.0),
    ("\\boxed{9^{9^{9^{9}}}}", "1", 0.0),  # bounded exponents: no hang, just unequal
    ("\\boxed{1/0}", "1", 0.0),
    ("\\boxed{٣}", "3", 0.0),  # ASCII digits only: an Arabic-Indic 3 is not the number 3
    ("Answer: １２３", "123", 0.0),
])
def test_math_verifier(response, answer, expected):
    assert verify_math(response, answer) == expected


def test_math_verifier_never_evaluates_model_output(tmp_path):
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    for text in (f"\\boxed{{{payload}}}", f"Answer: {payload}", payload):
        assert verify_math(text, "0") == 0.0
        assert parse_value(payload) is None
    assert not marker.exists()


def test_extraction_handles_nested_braces():
    assert extract_final_answer("\\boxed{\\frac{a}{b}} end") == "\\frac{a}{b}"
    assert extract_final_answer("\\boxed 7.") == "7."
    assert math_equal("\\frac{6}{4}", "1.5") and not math_equal("\\pi", "3.14")


def test_raising_verifier_skips_or_stops():
    def flaky(response, answer):
        if response == "boom":
            raise RuntimeError("parser exploded")
        return float(response == answer)

    s = score_responses(flaky, ["1", "boom", "2"], ["1", "1", "1"], on_error="skip")
    assert s.rewards == [1.0, 0.0, 0.0] and s.ok == [True, False, True]
    assert "parser exploded" in s.errors[0]
    with pytest.raises(RewardError, match="sample 1: verifier raised RuntimeError: parser exploded"):
        score_responses(flaky, ["1", "boom"], ["1", "1"], on_error="error")
    nan = score_responses(lambda r, a: float("nan"), ["x"], ["y"])
    assert nan.ok == [False] and "non-finite" in nan.errors[0]


def test_verifier_lookup():
    assert get_verifier("math") is verify_math
    assert get_verifier("operator:eq")("a", "a") is True
    with pytest.raises(ValueError, match="unknown 'nope'"):
        get_verifier("nope")


def test_parquet_rows_in_dapo_layout(tmp_path):
    """DAPO-Math-17k ships as parquet with a chat-message prompt and reward_model.ground_truth."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pdm_lab.scaling.data import get_field, read_records

    rows = [{"prompt": [{"role": "user", "content": "What is 2+3?"}],
             "reward_model": {"ground_truth": "5", "style": "rule"}},
            {"prompt": [{"role": "user", "content": "What is 7·6?"}],
             "reward_model": {"ground_truth": "42", "style": "rule"}}]
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    got = list(read_records(path))
    assert [n for n, _ in got] == [1, 2]
    assert [get_field(rec, "reward_model.ground_truth") for _, rec in got] == ["5", "42"]
    assert get_field(got[0][1], "prompt")[0]["content"] == "What is 2+3?"
