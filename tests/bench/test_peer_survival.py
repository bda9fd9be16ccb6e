"""bench/peer_systems.py and bench/peer_survival.py (issue 44) without the peers' venvs: how
Rapid-MLX and vllm-mlx are started, the SIGKILL that takes a whole process group, the weight
change that keeps size, inode and mtime, and the crash and change rows as reported."""

import json
import os
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest

from bench import peer_survival as ps
from bench import peer_systems as sys_
from bench import run

RAPID, VLLM = Path("/v/rapid/bin/rapid-mlx"), Path("/v/vllm/bin/vllm-mlx")


@pytest.fixture
def systems(tmp_path):
    exes = {"Rapid-MLX 0.16.10": RAPID, "vllm-mlx 0.6.0": VLLM}
    return sys_.Systems(tmp_path, "hybrid", exes, model=tmp_path / "m")


def test_rapid_mlx_starts_with_telemetry_off_and_its_persistent_setting_keeps_hybrid_entries(
    systems, tmp_path
):
    m = tmp_path / "m"
    d = systems.argv("Rapid-MLX defaults", tmp_path / "s", 8001, m)
    assert d == [str(RAPID), "--no-telemetry", "--disable-version-check", "serve", str(m),
                 "--port", "8001"]  # fmt: skip
    p = systems.argv("Rapid-MLX persistent", tmp_path / "s", 8001, m)
    assert p[-2:] == ["--hybrid-cache-entries", str(sys_.RAPID_ENTRIES)]
    assert sys_.warm_up("Rapid-MLX persistent") and not sys_.warm_up("Rapid-MLX defaults")
    v = systems.argv("vllm-mlx ssd + warm prompts", tmp_path / "s", 8001, m)
    assert v[:2] == [str(VLLM), "serve"] and "--ssd-cache-dir" in v and "--warm-prompts" in v
    names = systems.names()
    assert names[:2] == [sys_.KVSTORE, sys_.PLAIN] and set(names[2:]) == set(sys_.PEERS)
    assert sys_.Systems(tmp_path, "plain", {}, model=m).names() == [sys_.KVSTORE, sys_.PLAIN]


def test_a_peer_runs_with_a_home_inside_its_state_and_telemetry_off(systems, tmp_path, monkeypatch):
    seen = {}

    class Fake:
        def __init__(self, argv, port, log, env=None, new_session=False):
            seen.update(argv=argv, env=env, new_session=new_session)

    monkeypatch.setattr(sys_, "Server", Fake)
    _, model = systems.start("Rapid-MLX persistent", tmp_path / "state")
    env = seen["env"]
    assert env["HOME"] == str(tmp_path / "state" / "home") and (tmp_path / "state/home").is_dir()
    assert env["RAPID_MLX_TELEMETRY"] == "0" and seen["new_session"] is True
    assert model == str(tmp_path / "m")  # a peer is sent the model's name
    systems.start(sys_.PLAIN, None)
    assert "HOME" not in seen["env"] or seen["env"]["HOME"] == os.environ.get("HOME")


def test_a_missing_rapid_venv_is_one_line_and_the_rest_still_runs(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("KVSTORE_RAPID_VENV", raising=False)
    monkeypatch.setenv("KVSTORE_PEER_VENV", str(tmp_path))
    exes, missing = sys_.available()
    assert exes == {} and set(missing) == {"vllm-mlx 0.6.0", "Rapid-MLX 0.16.10"}
    assert missing["Rapid-MLX 0.16.10"].startswith(
        "Rapid-MLX 0.16.10 cannot run, it is left out: KVSTORE_RAPID_VENV is not set"
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2  # one line each


def _pid_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # killed, not yet reaped by its new parent


def test_crash_sigkills_the_whole_process_group(tmp_path):
    pidfile = tmp_path / "child"
    proc = subprocess.Popen(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"],
                            start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 10
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    child = int(pidfile.read_text())
    assert not _pid_gone(child)
    assert sys_.crash(proc) == -signal.SIGKILL
    deadline = time.monotonic() + 5
    while not _pid_gone(child):  # the grandchild died with its group, not only the leader
        assert time.monotonic() < deadline, "the server's child outlived the SIGKILL"
        time.sleep(0.02)
    assert sys_.crash(proc) == -signal.SIGKILL  # a second crash of a dead group: no error


def _safetensors(path: Path, tensors: dict[str, tuple[str, list[float]]]) -> None:
    header, blobs, off = {}, b"", 0
    for name, (dtype, values) in tensors.items():
        fmt = {"F32": "<f", "F16": "<e"}[dtype] if dtype != "BF16" else "<f"
        raw = b"".join(ps._pack(fmt, 2 if dtype in ("F16", "BF16") else 4, v) for v in values)
        header[name] = {
            "dtype": dtype,
            "shape": [len(values)],
            "data_offsets": [off, off + len(raw)],
        }
        blobs, off = blobs + raw, off + len(raw)
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + blobs)


@pytest.mark.parametrize("dtype", ["F32", "BF16", "F16"])
def test_the_weight_change_rewrites_one_value_in_place_and_puts_the_mtime_back(tmp_path, dtype):
    f = tmp_path / "model.safetensors"
    _safetensors(f, {"a.weight": (dtype, [0.5, 0.25]),
                     "layers.0.input_layernorm.weight": (dtype, [1.0, 1.0, 1.0, 1.0])})  # fmt: skip
    os.utime(f, ns=(1_000_000_000, 2_000_000_000))
    before, st = f.read_bytes(), f.stat()
    got = ps.change_weight(tmp_path, "layers.0.input_layernorm.weight", 2, 20.0)
    after, st2 = f.read_bytes(), f.stat()
    assert got["old"] == 1.0 and got["new"] == 20.0 and got["mtime_kept"] and got["size_kept"]
    assert st2.st_mtime_ns == 2_000_000_000 and st2.st_ino == st.st_ino
    diff = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    assert diff and max(diff) - min(diff) < (4 if dtype == "F32" else 2)  # one value's bytes
    import mlx.core as mx

    w = mx.load(str(f))["layers.0.input_layernorm.weight"].astype(mx.float32).tolist()
    assert w == [1.0, 1.0, 20.0, 1.0]
    with pytest.raises(ValueError, match="no tensor named"):
        ps.change_weight(tmp_path, "nope.weight")


def test_the_copied_folder_has_the_same_bytes_and_mtimes_at_a_new_path(tmp_path):
    src = tmp_path / "a"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"x" * 100)
    os.utime(src / "model.safetensors", ns=(10**9, 2 * 10**9))
    dst = ps.copy_model(src, tmp_path / "b")
    a, b = (src / "model.safetensors").stat(), (dst / "model.safetensors").stat()
    assert (dst / "model.safetensors").read_bytes() == b"x" * 100
    assert a.st_mtime_ns == b.st_mtime_ns and a.st_ino != b.st_ino


def _got(cached, texts, total=1.0):
    return {"cached_tokens": cached, "prompt_tokens": [1000, 1100, 1200], "first_texts": texts,
            "texts": ["recomputed"] * 3, "total_ttft_s": total, "ttft_s": [total / 3] * 3,
            "spawn_to_first_answer_s": 2.0}  # fmt: skip


def test_a_prefix_served_after_the_weight_change_is_reported_as_old_weights_kv():
    cold = ["a", "b", "c"]
    runs = {sys_.PLAIN: _got([0, 6, 6], cold), sys_.KVSTORE: _got([0, 6, 6], cold),
            "vllm-mlx ssd": _got([917, 1060, 1164], ["a", "x", "c"]),
            "vllm-mlx ssd + warm prompts": _got([917, 1060, 1164], cold)}  # fmt: skip
    own = {"Rapid-MLX persistent": _got([0, 6, 6], ["a!", "b", "c"])}  # its own detokenizer
    runs["Rapid-MLX persistent"] = _got([0, 6, 6], ["a!", "b", "c"])
    changed = ps.verdicts(runs, {"Rapid-MLX defaults": "boom"}, own)
    assert changed["Rapid-MLX persistent"]["same_as_cold"] == [True] * 3  # against its own
    assert changed["Rapid-MLX persistent"]["cold"] == "own"
    assert changed[sys_.KVSTORE]["served"] is False and changed["vllm-mlx ssd"]["served"] is True
    assert changed["vllm-mlx ssd"]["same_as_cold"] == [True, False, True]
    copied = ps.verdicts({sys_.PLAIN: _got([0, 6, 6], cold),
                          sys_.KVSTORE: _got([917, 1060, 1164], cold)}, {})  # fmt: skip
    probe = {"change_moves_answer": True, "stale_differs": True,
             "stages": [{"cold_old": "o", "cold_new": "n", "stale": "s"}]}  # fmt: skip
    change = {"tensor": "layers.0.input_layernorm.weight", "index": 3, "old": 1.0, "new": 20.0,
              "mtime_kept": True}  # fmt: skip
    res = {"classes": {"plain": {"model": "tiny llama", "probe": probe, "change": change,
                                 "cases": {"copied": copied, "changed": changed}}}}  # fmt: skip
    rows = {r["target"].split(":")[0]: r for r in ps.change_targets(res)}
    v = rows["changed model folder, vllm-mlx ssd"]
    assert (
        v["ok"] is False and v["measured"] == "yes / 2/3" and "OLD WEIGHTS' KV SERVED" in v["note"]
    )
    w = rows["changed model folder, vllm-mlx ssd + warm prompts"]  # prefilled at its start
    assert w["ok"] is True and w["measured"] == "yes / 3/3" and "OLD" not in w["note"]
    k = rows["changed model folder, kvstore serve"]
    assert k["ok"] is True and k["measured"] == "no / 3/3"
    assert rows["copied model folder, kvstore serve"]["ok"] is None  # no wrong outcome on a copy
    assert rows["copied model folder, kvstore serve"]["measured"] == "yes / 3/3"
    assert rows["changed model folder, Rapid-MLX defaults"]["note"] == "boom"
    first = next(r for r in rows.values() if r["target"].startswith("the weight change"))
    assert first["measured"] == "True / True" and "1.0 -> 20.0" in first["note"]
    assert run.own_targets("peer_change", {"peer_change": res}) == ps.change_targets(res)


def _crashed(cached, total, same=3):
    return {"cached_tokens": [cached], "prompt_tokens": [1000, 1100, 1200], "total_ttft_s": total,
            "ttft_s": [total / 3] * 3, "spawn_to_first_answer_s": 2.0,
            "parity": {"same": same, "compared": 3}}  # fmt: skip


def test_the_crash_row_holds_kvstore_to_every_stage_and_gives_the_peers_ratios():
    res = {"missing": {"vllm-mlx 0.6.0": "vllm-mlx 0.6.0 cannot run, it is left out: why"},
           "classes": {"hybrid": {"model": "tiny qwen3_5", "systems": {
               sys_.KVSTORE: _crashed([917, 1060, 1174], 0.25),
               sys_.PLAIN: _crashed([0, 0, 0], 1.8),
               "Rapid-MLX persistent": _crashed([0, 0, 0], 2.5)}}}}  # fmt: skip
    rows = ps.crash_targets(res)
    assert rows[0]["measured"] == "cannot run" and rows[0]["note"].endswith("why")
    k, _, r = rows[1:]
    assert k["ok"] is True and k["measured"] == "917/1060/1174" and "target" in k["target"]
    assert r["ok"] is None and r["measured"] == "0/0/0" and "10.00x kvstore serve's" in r["note"]
    res["classes"]["hybrid"]["systems"][sys_.KVSTORE] = _crashed([917, 6, 6], 1.0)
    assert ps.crash_targets(res)[1]["ok"] is False  # a stage lost: missed
    assert run.own_targets("peer_crash", {"peer_crash": res}) == ps.crash_targets(res)
