"""bench/peer.py (`make bench-peer`): it says in one line when vllm-mlx cannot run, its ratios are
read against issue 33's goals on both model classes, and its harness (prepared state copied at
each restart, cached tokens, greedy parity) works on the systems this machine always has."""

import shutil
import tempfile
from pathlib import Path

import pytest

from bench import peer, peer_systems, run


def test_no_peer_venv_is_one_clear_line_each(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("KVSTORE_PEER_VENV", raising=False)
    monkeypatch.delenv("KVSTORE_RAPID_VENV", raising=False)
    res = peer.run(True)
    assert res["skipped"] == "no peer can run, the peer comparison is skipped"
    vllm, rapid = res["missing"]["vllm-mlx 0.6.0"], res["missing"]["Rapid-MLX 0.16.10"]
    assert "KVSTORE_PEER_VENV is not set" in vllm and "make bench-peer" in vllm
    assert "KVSTORE_RAPID_VENV is not set" in rapid and "pip install rapid-mlx==0.16.10" in rapid
    monkeypatch.setenv("KVSTORE_PEER_VENV", str(tmp_path))
    res = peer.run(True)
    assert f"{tmp_path}/bin/vllm-mlx does not exist" in res["missing"]["vllm-mlx 0.6.0"]
    out = capsys.readouterr().out.splitlines()
    assert sum("vllm-mlx 0.6.0 cannot run, it is left out" in line for line in out) == 2
    assert sum("Rapid-MLX 0.16.10 cannot run, it is left out" in line for line in out) == 2
    rows = peer.targets(res)
    assert [r["measured"] for r in rows] == ["cannot run"] * 3 and {r["ok"] for r in rows} == {None}


def test_a_venv_whose_vllm_mlx_cannot_import_says_why(monkeypatch, tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "vllm-mlx").write_text("")
    py = tmp_path / "bin" / "python"
    line = "ModuleNotFoundError: No module named 'vllm_mlx'"
    py.write_text(f'#!/bin/sh\necho "{line}" >&2; exit 1\n')
    py.chmod(0o755)
    monkeypatch.setenv("KVSTORE_PEER_VENV", str(tmp_path))
    exe, why = peer.peer_exe()
    assert exe is None and why.endswith("No module named 'vllm_mlx'")
    (tmp_path / "bin" / "rapid-mlx").write_text("")
    monkeypatch.setenv("KVSTORE_RAPID_VENV", str(tmp_path))
    exe, why = peer_systems.venv_exe("Rapid-MLX 0.16.10")  # the same check: its python runs
    assert exe is None and why.endswith("No module named 'vllm_mlx'")


def _system(total: float, spawn: float, ttft: list[float]) -> dict:
    return {"spawn_to_ready_s": spawn - 0.1, "spawn_to_first_answer_s": spawn,
            "total_ttft_s": total, "ttft_s": ttft, "cached_tokens": [[900, 1000, None]],
            "prompt_tokens": [999, 1142, 1246], "parity": {"same": 3, "compared": 3}}  # fmt: skip


def test_the_ratios_are_read_against_each_model_class_goal():
    res = {"restarts": 3, "classes": {
        "plain": {"model": "tiny llama", "prefill_tok_s": 4000.0, "systems": {
            peer.KVSTORE: _system(0.100, 1.2, [0.03, 0.035, 0.035]),
            peer.PLAIN: _system(0.300, 1.1, [0.1, 0.1, 0.1]),
            "vllm-mlx ssd": _system(0.097, 5.0, [0.04, 0.03, 0.027]),
            "vllm-mlx ssd + warm prompts": _system(0.800, 5.2, [0.3, 0.3, 0.2]),
        }},
        "hybrid": {"model": "tiny qwen3_5", "systems": {
            peer.KVSTORE: _system(0.5, 1.5, [0.2, 0.15, 0.15]),
            peer.PLAIN: _system(4.0, 1.4, [1.3, 1.3, 1.4]),
            "vllm-mlx ssd": _system(3.9, 5.0, [1.3, 1.3, 1.3]),
            "vllm-mlx ssd + warm prompts": {"error": "ValueError: qwen3_5 not supported"},
            "Rapid-MLX defaults": _system(4.1, 9.0, [1.3, 1.4, 1.4]),
            "Rapid-MLX persistent": _system(1.5, 10.0, [0.5, 0.5, 0.5]),
        }},
    }}  # fmt: skip
    rows = {r["target"]: r for r in peer.targets(res)}
    ttft = [r for t, r in rows.items() if t.startswith("3-stage TTFT after a restart, vllm-mlx")]
    assert [r["measured"] for r in ttft] == [0.97, 7.8]  # vllm-mlx's best over kvstore's
    assert [r["ok"] for r in ttft] == [True, False]  # >= 0.95 plain, >= 8 hybrid
    assert ">= 0.95 (plain" in ttft[0]["target"] and ">= 8.0 (hybrid" in ttft[1]["target"]
    assert "(vllm-mlx ssd)" in ttft[0]["target"]  # the best setting, by total TTFT
    spawn = [r for t, r in rows.items() if t.startswith("spawn to first answer, vllm-mlx")]
    assert [(r["measured"], r["ok"]) for r in spawn] == [(4.17, True), (3.33, False)]
    err = [r for t, r in rows.items() if "warm prompts side by side" in t]
    assert err[0]["note"] == "ValueError: qwen3_5 not supported"
    rapid = [r for t, r in rows.items() if t.startswith("3-stage TTFT after a restart, Rapid")]
    assert [(r["measured"], r["ok"]) for r in rapid] == [(3.0, None)]  # no goal, its best
    assert "(Rapid-MLX persistent)" in rapid[0]["target"]  # the lower of its two settings
    best = [r for t, r in rows.items() if t.startswith("3-stage TTFT after a restart, the best")]
    assert [(r["measured"], r["ok"]) for r in best] == [(0.97, None), (3.0, None)]
    assert "(Rapid-MLX persistent)" in best[1]["target"]  # across peers, per model class
    parity = [r for t, r in rows.items() if t.startswith("greedy output")]
    assert len(parity) == 7 and all(r["ok"] for r in parity)  # every system but plain itself
    ctx = rows[f"{peer.KVSTORE}, tiny llama: spawn to ready / to first answer (s)"]
    assert "900/1000/?" in ctx["note"] and "4000 tok/s" in ctx["note"]
    assert run.own_targets("peer", {"peer": res}) == peer.targets(res)


def test_cached_tokens_are_read_from_a_log_where_the_reply_has_none():
    log = (  # vllm-mlx 0.6.0's lines: a warm-up, an SSD hit, a memory hit, a miss
        "INFO [cache_fetch] request=warm-1 MISS prompt_tokens=40 time=0.000s entries=0\n"
        "INFO [cache_fetch] request=aaa MISS prompt_tokens=999 time=0.001s entries=1\n"
        "INFO [ssd_promote] request=aaa exact promote: 917/999 tokens from SSD, 82 remaining\n"
        "INFO [cache_fetch] request=bbb HIT prompt_tokens=1142 cached=1060 remaining=82 "
        "time=0.002s\n"
        "INFO [cache_fetch] request=ccc MISS prompt_tokens=1246 time=0.001s entries=3\n"
    )
    logged = peer._log_cached(log)
    assert logged == [(40, 0), (999, 917), (1142, 1060), (1246, 0)]
    got = peer._match_logged([None, 1060, None], [999, 1142, 1246], logged)
    assert got == [917, 1060, 0]


@pytest.mark.slow
def test_kvstore_serve_and_plain_mlx_lm_server_after_one_restart_from_the_prepared_state():
    root = Path(tempfile.mkdtemp(prefix="kvtest-peer-"))
    try:
        row = peer.measure(root, "plain", {}, restarts=1, systems=(peer.KVSTORE, peer.PLAIN))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    k, p = row["systems"][peer.KVSTORE], row["systems"][peer.PLAIN]
    (cached,) = k["cached_tokens"]  # served what the prepared home learned
    assert all(c > 0.7 * n for c, n in zip(cached, k["prompt_tokens"], strict=True))
    assert all(c < 32 for c in p["cached_tokens"][0])  # nothing outlives plain's restart
    assert k["parity"]["same"] == k["parity"]["compared"] == 3 == p["parity"]["same"]
    assert k["spawn_to_first_answer_s"] > k["spawn_to_ready_s"] > 0
    assert row["prefill_tok_s"] > 0


def _run(texts: list) -> dict:
    return {"spawn_to_ready_s": 1.0, "spawn_to_first_answer_s": 1.1, "ttft_s": [0.1, 0.1, 0.1],
            "total_ttft_s": 0.3, "cached_tokens": [0, 0, 0], "prompt_tokens": [9, 9, 9],
            "texts": texts}  # fmt: skip


def test_an_answer_is_the_reasoning_parser_s_part_then_the_content():
    def reply(**msg):
        return {"choices": [{"message": {"role": "assistant", **msg}}]}

    assert peer.answer_text(reply(content="b", reasoning_content="a")) == "ab"
    assert peer.answer_text(reply(content="b", reasoning="a")) == "ab"
    assert peer.answer_text(reply(content=None)) is None  # vllm-mlx's whitespace answer


def test_greedy_parity_reads_a_null_answer_as_a_blank_one_and_says_the_check_is_weak():
    runs = {peer.PLAIN: [_run(["\n\n", "\n\n", "\n\n"])], "vllm-mlx ssd": [_run([None] * 3)],
            peer.KVSTORE: [_run(["\n\n", "\n\n", "x"])]}  # fmt: skip
    row = peer.summarize("plain", list(runs), runs, {})
    assert row["systems"]["vllm-mlx ssd"]["parity"] == {
        "same": 3, "compared": 3, "blank_reference": True}  # fmt: skip
    assert row["systems"][peer.KVSTORE]["parity"]["same"] == 2
    rows = [r for r in peer.context_rows({"classes": {"plain": row}}) if "greedy" in r["target"]]
    assert [r["ok"] for r in rows] == [True, False]
    assert all("whitespace only: a weak check" in r["note"] for r in rows)
