"""The prefix analyzer finds a date and request id early in a system prompt, says how little is
cacheable as captured, and how much a static-first reordering would make cacheable."""

from __future__ import annotations

import json

from helpers import cli

from kvstore.analyze import analyze, load_capture, static_first

STATIC = "".join(
    f"Rule {i}: classify the request into billing, outage, account or other and explain why.\n"
    for i in range(12)
)
DATES = ("2024-05-01", "2024-05-02", "2024-05-03")
IDS = ("7f3a91", "c0ffee", "b4d2e8")
USERS = ("My invoice 2291 was charged twice.", "The site is down again.", "Reset my password.")


def _capture(tmp_path):
    lines = []
    for date, rid, user in zip(DATES, IDS, USERS):
        system = f"You are the router.\nToday is {date}. Request id: {rid}.\n{STATIC}"
        lines.append(
            {
                "stage": "classify",
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": user},
                ],
            }
        )
        lines.append({"stage": "summary", "text": f"Summarize in one line.\n{STATIC}{user}"})
    path = tmp_path / "captured.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def _by_stage(out: str) -> dict:
    return {r["stage"]: r for r in json.loads(out)}


def test_byte_mode_finds_the_early_dynamic_block(tmp_path):
    res = cli("analyze", str(_capture(tmp_path)), "--json")
    assert res.exit_code == 0, res.output
    r = _by_stage(res.output)["classify"]
    assert r["calls"] == 3 and r["unit"] == "bytes" and r["token_share"] is None
    rendered = "<|system|>\nYou are the router.\nToday is 2024-05-0"
    assert r["first_dynamic_byte"] == len(rendered.encode())
    assert r["context_before"].endswith("Today is 2024-05-0")
    assert r["dynamic"] == "1. Request id: 7f3a91."
    assert r["byte_share"] < 0.1  # the date sits in the second line
    assert r["reorder_share"] > 0.85  # the twelve rules become the prefix
    assert r["static_lines"] == 13 and r["lines"] == 15
    summary = _by_stage(res.output)["summary"]
    assert summary["byte_share"] > 0.9 and summary["first_dynamic_byte"] == len(
        f"Summarize in one line.\n{STATIC}".encode()
    )


def test_token_mode_uses_the_chat_template(llama_path, tmp_path):
    from mlx_lm.utils import load_tokenizer

    capture = _capture(tmp_path)
    res = cli("analyze", capture, "--model", llama_path, "--json")
    assert res.exit_code == 0, res.output
    r = _by_stage(res.output)["classify"]
    assert r["unit"] == "tokens" and r["mean_tokens"] > r["stable_tokens"] > 0
    assert r["token_share"] < 0.15 and r["reorder_share"] > 0.85
    # the first dynamic token is where the rendered prompts' token ids first differ
    tok = load_tokenizer(llama_path)
    ids = [
        tok.encode(
            tok.apply_chat_template(c.messages, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for c in load_capture(capture)
        if c.stage == "classify"
    ]
    first = next(i for i, col in enumerate(zip(*ids)) if len(set(col)) > 1)
    assert r["first_dynamic_token"] == first == r["stable_tokens"]
    assert r["context_before"].endswith("Today is 2024-05-0")

    table = cli("analyze", capture, "--model", llama_path)
    assert table.exit_code == 0
    assert "classify" in table.output and "[[1. Request id: 7f3a91.]]" in table.output


def test_static_first_hoists_stable_lines_and_moves_the_rest_last(tmp_path):
    calls = [c for c in load_capture(_capture(tmp_path)) if c.stage == "classify"]
    reordered, n_static, n_lines = static_first(calls)
    first = reordered[0].messages
    assert first[0] == {"role": "system", "content": "You are the router.\n" + STATIC}
    assert first[-1]["role"] == "user"
    assert first[-1]["content"] == f"Today is {DATES[0]}. Request id: {IDS[0]}.\n{USERS[0]}"
    reports = analyze(calls)
    assert reports[0].reorder_share > 0.85 > 0.1 > reports[0].byte_share


def test_identical_calls_and_bad_lines(tmp_path):
    path = tmp_path / "same.jsonl"
    path.write_text('{"stage": "a", "text": "x"}\n{"stage": "a", "text": "x"}\n')
    (r,) = analyze(load_capture(path))
    assert r.first_dynamic_byte is None and r.byte_share == 1.0 and "no dynamic" in r.snippet
    path.write_text('{"stage": "a"}\n')
    res = cli("analyze", path)
    assert res.exit_code == 1 and f"{path}:1: give either" in res.output
