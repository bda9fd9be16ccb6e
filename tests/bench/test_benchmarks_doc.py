"""docs/benchmarks.md stays a page a user reads: at most MAX_LINES lines, and it leads with where
users stand (issues 33, 44): kvstore serve against the best peer (vllm-mlx, Rapid-MLX) after a
restart, one row per model class with its command and this machine's prefill rate, why parity is
the floor on plain attention, then what survives a crash and a changed model folder."""

from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
MAX_LINES = 249  # a user page: under 250 lines


def test_the_page_stays_short():
    n = len(DOC.read_text().splitlines())
    assert n <= MAX_LINES, f"docs/benchmarks.md has {n} lines (at most {MAX_LINES})"


def test_it_leads_with_the_two_model_classes_against_the_best_peer():
    text = DOC.read_text()
    lines = text.splitlines()
    first_table = next(i for i, line in enumerate(lines) if line.startswith("|"))
    lead = "\n".join(lines[:first_table])
    assert "make bench-peer" in lead  # the command, before the rows
    assert "best peer" in lead and "vllm-mlx" in lead and "Rapid-MLX" in lead
    rows = [line for line in lines[first_table + 2 :] if line.startswith("|")]
    rows = rows[: next((i for i, r in enumerate(rows) if not r.startswith("| **")), len(rows))]
    assert [r.split("**")[1] for r in rows] == ["plain attention", "Qwen3.5-style hybrid"]
    for row in rows:
        first = row.split("|")[1]
        assert "tok/s here" in first and "`make bench-peer`" in first  # regime and command
        assert "@@" not in row
    assert "Why parity is the floor on plain attention" in text
    assert "@@" not in text
    sections = [line for line in lines if line.startswith("## ")]
    assert sections[:3] == ["## Where users stand: a restart, against the best peer",
                            "## After a crash: SIGKILL, then a restart",
                            "## After a change of the model folder"]  # fmt: skip
    for title in sections[1:3]:  # each row names its command and the load it ran at
        body = text.split(title)[1].split("\n## ")[0]
        assert "make bench-peer" in body and "load average" in body
