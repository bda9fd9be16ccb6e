"""docs/benchmarks.md stays a page a user reads: at most MAX_LINES lines, and it leads with where
users stand (issue 33): kvstore serve against vllm-mlx after a restart, one row per model class
with its command and this machine's prefill rate, and why parity is the floor on plain attention."""

from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
MAX_LINES = 249  # a user page: under 250 lines


def test_the_page_stays_short():
    n = len(DOC.read_text().splitlines())
    assert n <= MAX_LINES, f"docs/benchmarks.md has {n} lines (at most {MAX_LINES})"


def test_it_leads_with_the_two_model_classes_against_vllm_mlx():
    text = DOC.read_text()
    lines = text.splitlines()
    first_table = next(i for i, line in enumerate(lines) if line.startswith("|"))
    assert "make bench-peer" in "\n".join(lines[:first_table])  # the command, before the rows
    rows = [line for line in lines[first_table + 2 :] if line.startswith("|")]
    rows = rows[: next((i for i, r in enumerate(rows) if not r.startswith("| **")), len(rows))]
    assert [r.split("**")[1] for r in rows] == ["plain attention", "Qwen3.5-style hybrid"]
    for row in rows:
        first = row.split("|")[1]
        assert "tok/s here" in first and "`make bench-peer`" in first  # regime and command
        assert "@@" not in row
    assert "Why parity is the floor on plain attention" in text
    assert "@@" not in text
