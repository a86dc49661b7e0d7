"""The one JSON Lines reader and writer (pdm_lab.lab.records): what is written reads back, in
order, with line numbers; a damaged line is named by file and line in the caller's error type."""
import pytest

from pdm_lab.config import ConfigError
from pdm_lab.lab.records import JsonlWriter, read_jsonl


def test_written_lines_read_back_in_order_with_their_numbers(tmp_path):
    path = tmp_path / "a.jsonl"
    writer = JsonlWriter(path)
    for step in range(3):
        writer.write({"step": step, "x": 0.5 * step})
    writer.close()
    with open(path, "a", encoding="utf-8") as fh:
        fh.write("\n")  # a blank line is skipped, not an error
    assert list(read_jsonl(path)) == [(1, {"step": 0, "x": 0.0}), (2, {"step": 1, "x": 0.5}),
                                      (3, {"step": 2, "x": 1.0})]


@pytest.mark.parametrize("error", [ValueError, ConfigError])
def test_a_damaged_line_is_named_by_file_and_line(tmp_path, error):
    path = tmp_path / "cut.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "x"\n', encoding="utf-8")
    rows = read_jsonl(path, error=error)
    assert next(rows) == (1, {"step": 1})
    with pytest.raises(error, match=rf"cut\.jsonl:2: not a JSON row"):
        next(rows)
