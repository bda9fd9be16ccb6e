"""What survives a crash, and a change of the model folder, side by side (issue 44, items 2-3).

The systems and their settings are bench/peer_systems.py's (kvstore serve with its daemon, plain
`mlx_lm.server` as the cold reference, vllm-mlx 0.6.0 and Rapid-MLX 0.16.10 where their venvs
run), on both model classes.

- crash (`--only peer_crash`): each system, from an empty state, serves the stages as bench/peer.py
  prepares them, and is then killed with SIGKILL to its process group (a crash, an OOM kill, a
  forced reboot: nothing runs after it; for kvstore serve its daemon too, once the daemon
  acknowledged what it learned), and restarted once on what is left on disk: cached tokens per
  stage, total time to first token of the three stages, greedy parity with plain mlx_lm.server.
- change (`--only peer_change`): each system prepared and stopped cleanly on a model folder, then
  restarted from a copy of that state (a) on a copy of the folder at a new path (the same bytes,
  mtimes kept by copy2) and (b) on the folder itself after one weight value was overwritten in
  place (CHANGE: same size, shape and dtype; its mtime put back with os.utime, its ctime moves as
  any write's does). Per case: who serves its stored prefix (cached tokens over SERVED_MIN on a
  stage), and whether the answer of its first request per stage (CHANGE_TOKENS greedy tokens,
  computed on what the start restored; a second ask of the same prompt may be computed afresh:
  vllm-mlx 0.6.0 re-prefills an exact repeat) matches a cold prefill: after the change, the same
  system started from an empty state on the changed folder (its own kernels and detokenizer:
  Rapid-MLX's and vllm-mlx's differ from mlx-lm's on these random weights), on the copy plain
  mlx_lm.server. A stored prefix served after (b) is KV of the old weights by construction: a
  correctness failure, whoever serves it. The answers are the comparison (vllm-mlx 0.6.0 returns
  no logprobs); `stale_probe` shows, in process with mlx-lm, what the old weights' KV under the
  new weights answers, so a difference there is one the servers' answers would show.

    python -m bench.run --quick --only peer_crash,peer_change --out peer
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

from bench.learned import USERS, _stage_messages
from bench.peer import (
    PLAIN,
    _answer,
    _attempt,
    _ms,
    one_start,
    prepare,
    restart,
    summarize,
)
from bench.peer_systems import (
    ARCHS,
    KVSTORE,
    STAGE_NAMES,
    Systems,
    available,
    crash_after_history,
    slug,
)

SERVED_MIN = 64  # cached tokens above what the chat template's opening shares across stages
CHANGE_TOKENS = 16  # greedy tokens per stage compared against the cold prefill
# one weight value overwritten in layer 0's input norm (every token's layer-0 input moves, so the
# prefix's KV and state do): the first of these whose effect the answers show (choose_change)
CHANGES = tuple(("layers.0.input_layernorm.weight", i, v)
                for v in (20.0, -20.0, 50.0, 5.0) for i in (3, 0, 7, 11))  # fmt: skip
CHANGE = CHANGES[0]
_DTYPES = {"F32": ("<f", 4), "F16": ("<e", 2), "BF16": ("<f", 2), "F64": ("<d", 8)}


def change_weight(model: Path, suffix: str = CHANGE[0], index: int = CHANGE[1],
                  value: float = CHANGE[2]) -> dict:  # fmt: skip
    """Overwrite element `index` of the tensor named `*suffix` in `model`'s safetensors, in place
    (same size, shape, dtype and inode), then put the file's access and modification times back:
    what it was and is, and whether the mtime is the one it had."""
    for path in sorted(Path(model).glob("*.safetensors")):
        with path.open("r+b") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            key = next((k for k in header if k.endswith(suffix) and k != "__metadata__"), None)
            if key is None:
                continue
            fmt, size = _DTYPES[header[key]["dtype"]]
            st = path.stat()
            f.seek(8 + n + header[key]["data_offsets"][0] + index * size)
            old = _unpack(fmt, size, f.read(size))
            f.seek(-size, os.SEEK_CUR)
            f.write(_pack(fmt, size, value))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        after = path.stat()
        return {"file": path.name, "tensor": key, "index": index, "old": old,
                "new": _unpack(fmt, size, _pack(fmt, size, value)),
                "mtime_kept": after.st_mtime_ns == st.st_mtime_ns,
                "size_kept": after.st_size == st.st_size}  # fmt: skip
    raise ValueError(f"no tensor named *{suffix} in {model}")


def _pack(fmt: str, size: int, value: float) -> bytes:
    raw = struct.pack(fmt, value)
    return raw[2:] if size == 2 and fmt == "<f" else raw  # bf16: a float32's upper half


def _unpack(fmt: str, size: int, raw: bytes) -> float:
    return struct.unpack(fmt, b"\0\0" + raw if size == 2 and fmt == "<f" else raw)[0]


def copy_model(src: Path, dst: Path) -> Path:
    """The model folder copied to a new path: the same bytes and mtimes, new inodes and ctimes."""
    shutil.copytree(src, dst)
    return dst.resolve()


def stale_probe(old: Path, new: Path, user: str, tokens: int = CHANGE_TOKENS) -> dict:
    """In process (mlx-lm), per stage: the greedy answer of a cold prefill on the old weights,
    on the new, and of the old weights' KV of the system prompt continued under the new weights
    (what a server that kept the old KV answers); the change has power where the last two
    differ on every stage."""
    import mlx.core as mx
    from mlx_lm.generate import generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    (m_old, tok), (m_new, _) = load(str(old)), load(str(new))
    stages = []
    for stage in STAGE_NAMES:
        msgs = _stage_messages(stage, user)
        full = list(tok.apply_chat_template(msgs, add_generation_prompt=True))
        head = list(tok.apply_chat_template(msgs[:1], add_generation_prompt=False))
        n = 0
        while n < min(len(head), len(full) - 1) and head[n] == full[n]:
            n += 1
        cache = make_prompt_cache(m_old)
        m_old(mx.array([full[:n]]), cache=cache)
        mx.eval([c.state for c in cache])
        stages.append({"prefix_tokens": n, "prompt_tokens": len(full),
                       "cold_old": generate(m_old, tok, full, max_tokens=tokens),
                       "cold_new": generate(m_new, tok, full, max_tokens=tokens),
                       "stale": generate(m_new, tok, full[n:], max_tokens=tokens,
                                         prompt_cache=cache)})  # fmt: skip
    return {"stages": stages,
            "change_moves_answer": all(_answer(s["cold_old"]) != _answer(s["cold_new"])
                                       for s in stages),
            "stale_differs": all(_answer(s["stale"]) != _answer(s["cold_new"])
                                 for s in stages)}  # fmt: skip


def choose_change(model: Path, scratch: Path, user: str) -> tuple[dict, dict]:
    """The first of CHANGES that, tried on a scratch copy of `model`, moves every stage's cold
    answer and makes the old KV answer otherwise than a cold prefill: the change, its probe (the
    last one tried where none has that power)."""
    copy_model(model, scratch / "old")
    for suffix, index, value in CHANGES:
        shutil.rmtree(scratch / "new", ignore_errors=True)
        new = copy_model(model, scratch / "new")
        change = change_weight(new, suffix, index, value)
        probe = stale_probe(scratch / "old", new, user)
        if probe["change_moves_answer"] and probe["stale_differs"]:
            break
    return change, probe


def measure_crash(root: Path, arch: str, exes: dict[str, Path], *,
                  systems: tuple[str, ...] | None = None) -> dict:  # fmt: skip
    """Every system on one model class: stages served from an empty state, SIGKILL, one restart
    on what is left."""
    sy = Systems(root, arch, exes)
    names = list(systems or sy.names())
    states: dict[str, Path | None] = {}
    errors: dict[str, str] = {}
    for name in names:
        states[name] = None if name == PLAIN else root / f"crashed-{arch}-{slug(name)}"
        if states[name] is not None:
            _attempt(errors, name, crash_after_history, sy, name, states[name])
    user = f"Ticket after the crash, {arch} model. {USERS[3]}"  # new to every system
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for name in names:
        if name not in errors and (got := _attempt(errors, name, one_start, sy, name,
                                                   states[name], user)):  # fmt: skip
            runs[name].append(got)
            _say(arch, "after the crash", name, got)
    return summarize(arch, names, runs, errors)


def measure_change(root: Path, arch: str, exes: dict[str, Path], *,
                   systems: tuple[str, ...] | None = None) -> dict:  # fmt: skip
    """Every system on one model class: prepared on a folder, restarted on its copy, then on the
    folder with one weight changed; who serves its stored prefix, and answers as a cold prefill."""
    sy = Systems(root, arch, exes)
    names = list(systems or sy.names())
    errors: dict[str, str] = {}
    prepared: dict[str, Path | None] = {}
    for name in names:
        prepared[name] = None if name == PLAIN else root / f"prepared-{arch}-{slug(name)}"
        if prepared[name] is not None:
            _attempt(errors, name, prepare, sy, name, prepared[name])
    copy = copy_model(sy.model, root / f"copy-{arch}")
    out: dict = {"model": f"tiny {ARCHS[arch]}", "arch": arch, "folder": str(sy.model),
                 "copy": str(copy), "cases": {}, "errors": dict(errors)}  # fmt: skip
    user = f"Ticket after the change, {arch} model. {USERS[3]}"
    for case, model in (("copied", copy), ("changed", sy.model)):
        if case == "changed":
            chosen, out["probe"] = choose_change(sy.model, root / f"probe-{arch}", user)
            out["change"] = change_weight(sy.model, chosen["tensor"], chosen["index"],
                                          chosen["new"])  # fmt: skip
        runs: dict[str, dict] = {}
        colds: dict[str, dict] = {}
        failed = dict(errors)
        for name in names:
            if name not in failed and (got := _attempt(
                    failed, name, restart, sy, name, prepared[name], case, user, model=model,
                    tokens=CHANGE_TOKENS, first_tokens=CHANGE_TOKENS)):  # fmt: skip
                runs[name] = got
                _say(arch, f"on the {case} folder", name, got)
        if case == "changed":  # each system's own cold answers: its kernels, its detokenizer
            for name in names:
                if name != PLAIN and name in runs and (got := _attempt(
                        failed, name, one_start, sy, name, root / f"cold-{arch}-{slug(name)}",
                        user, model=model, tokens=CHANGE_TOKENS,
                        first_tokens=CHANGE_TOKENS)):  # fmt: skip
                    colds[name] = got
                    _say(arch, "from an empty state on the changed folder", name, got)
        out["cases"][case] = verdicts(runs, failed, colds)
    return out


def verdicts(runs: dict[str, dict], errors: dict[str, str],
             colds: dict[str, dict] | None = None) -> dict:  # fmt: skip
    """Per system: served its stored prefix (a stage's cached tokens over SERVED_MIN), and the
    answers of its first requests (computed on what its start restored) against a cold
    prefill's: the same system's from an empty state where `colds` has it (the same kernels and
    detokenizer), else plain mlx_lm.server's; and the figures."""
    colds = colds or {}
    out: dict = {}
    for name, got in runs.items():
        cold = colds.get(name) or runs.get(PLAIN)
        same = ([_answer(a) == _answer(b) for a, b in zip(got["first_texts"], cold["first_texts"],
                                                          strict=True)]
                if cold else [])  # fmt: skip
        out[name] = {"served": any((c or 0) > SERVED_MIN for c in got["cached_tokens"]),
                     "same_as_cold": same, "cold": "own" if name in colds else PLAIN,
                     "cached_tokens": got["cached_tokens"], "prompt_tokens": got["prompt_tokens"],
                     "total_s": got["total_ttft_s"], "first_texts": got["first_texts"],
                     "cold_texts": cold["first_texts"] if cold else None,
                     "spawn_to_first_answer_s": got["spawn_to_first_answer_s"]}  # fmt: skip
    for name, why in errors.items():
        out.setdefault(name, {"error": why})
    return out


def _say(arch: str, when: str, name: str, got: dict) -> None:
    """One line per start: the first requests' times are TTFT in the crash row, the time of
    CHANGE_TOKENS tokens in the change row."""
    print(f"    {arch} {when}, {name}: first answer {got['spawn_to_first_answer_s']:.2f} s, "
          f"first requests {_ms(got['ttft_s'])} ms, cached {got['cached_tokens']}",
          flush=True)  # fmt: skip


def _run(measure, prefix: str) -> dict:
    exes, missing = available()
    root = Path(tempfile.mkdtemp(prefix=prefix))
    res: dict = {"venvs": {f: str(e.parent.parent) for f, e in exes.items()}, "missing": missing,
                 "classes": {}}  # fmt: skip
    try:
        for cls in ARCHS:
            print(f"  {cls} model (tiny {ARCHS[cls]})", flush=True)
            res["classes"][cls] = measure(root, cls, exes)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return res


def crash_run(quick: bool = True) -> dict:
    """The crash row on both model classes, with every peer that can run (kvstore serve and
    plain mlx_lm.server are measured even when none can)."""
    res = _run(measure_crash, "kvbench-crash-")
    _print(crash_targets(res))
    return res


def change_run(quick: bool = True) -> dict:
    res = _run(measure_change, "kvbench-change-")
    _print(change_targets(res))
    return res


def _missing(res: dict, add) -> None:
    for family, why in res.get("missing", {}).items():
        add(f"{family} side by side", "cannot run", "", None, why)


def crash_targets(res: dict) -> list[dict]:
    """Per model class and system: cached tokens per stage and total TTFT after a SIGKILL and a
    restart; kvstore serve's target: every stage served from the store."""
    out: list[dict] = []

    def add(name, value, unit, ok, note=""):
        out.append({"target": name, "measured": value, "unit": unit, "ok": ok, "note": note})

    _missing(res, add)
    for row in res.get("classes", {}).values():
        k = row["systems"].get(KVSTORE, {})
        for name, v in row["systems"].items():
            if "error" in v:
                add(f"after a SIGKILL, {name}: {row['model']}", None, "", None, v["error"])
                continue
            (cached,) = v["cached_tokens"]
            p = v["parity"]
            served = all((c or 0) > SERVED_MIN for c in cached)
            ratio = (f"; {v['total_ttft_s'] / k['total_ttft_s']:.2f}x kvstore serve's"
                     if name != KVSTORE and "total_ttft_s" in k else "")  # fmt: skip
            add(f"after a SIGKILL and a restart, {name}: cached tokens per stage, {row['model']}"
                + (" (target: every stage served from the store)" if name == KVSTORE else ""),
                "/".join("?" if c is None else str(c) for c in cached), "tokens",
                served if name == KVSTORE else None,
                f"of {'/'.join(map(str, v['prompt_tokens']))}; total TTFT "
                f"{v['total_ttft_s'] * 1e3:.0f} ms ({_ms(v['ttft_s'])}){ratio}; spawn to first "
                f"answer {v['spawn_to_first_answer_s']:.2f} s; greedy same as plain "
                f"{p['same']}/{p['compared']}")  # fmt: skip
    return out


def change_targets(res: dict) -> list[dict]:
    """Per model class, case and system: whether it served cached tokens and answered as a cold
    prefill. After a weight change, cached tokens with answers that differ from the cold
    prefill's (where the probe shows the old KV would answer otherwise) are old weights' KV: ok
    False. Cached tokens with the cold answers were computed after the start (vllm-mlx's
    `--warm-prompts` prefills them at each start). On a copy no outcome is wrong (ok None):
    starting empty only costs a prefill."""
    out: list[dict] = []

    def add(name, value, unit, ok, note=""):
        out.append({"target": name, "measured": value, "unit": unit, "ok": ok, "note": note})

    _missing(res, add)
    for row in res.get("classes", {}).values():
        if probe := row.get("probe"):
            first = probe["stages"][0]
            add(f"the weight change moves every cold answer / old KV under the new weights "
                f"answers otherwise on every stage: {row['model']}",
                f"{probe['change_moves_answer']} / {probe['stale_differs']}", "", None,
                f"{row['change']['tensor']}[{row['change']['index']}] {row['change']['old']} -> "
                f"{row['change']['new']}, mtime kept {row['change']['mtime_kept']}; stage 1 "
                f"cold old {first['cold_old']!r}, cold new {first['cold_new']!r}, old KV "
                f"{first['stale']!r}")  # fmt: skip
        for case, systems in row["cases"].items():
            for name, v in systems.items():
                if name == PLAIN:
                    continue
                if "error" in v:
                    add(f"{case} model folder, {name}: {row['model']}", None, "", None,
                        v["error"])  # fmt: skip
                    continue
                same, n = sum(v["same_as_cold"]), len(v["same_as_cold"])
                stale = case == "changed" and v["served"] and same < n
                add(f"{case} model folder, {name}: serves its stored prefix / answers as a cold "
                    f"prefill, {row['model']}",
                    f"{'yes' if v['served'] else 'no'} / {same}/{n}", "",
                    None if case == "copied" else same == n,
                    f"cached {'/'.join('?' if c is None else str(c) for c in v['cached_tokens'])}"
                    f" of {'/'.join(map(str, v['prompt_tokens']))}; 3 stages of "
                    f"{CHANGE_TOKENS} tokens {v['total_s']:.2f} s; against "
                    + ("its own cold start" if v.get("cold") == "own" else "plain mlx_lm.server")
                    + ("; OLD WEIGHTS' KV SERVED" if stale else ""))  # fmt: skip
    return out


def _print(rows: list[dict]) -> None:
    for row in rows:
        mark = {True: "met", False: "MISSED", None: "-"}[row["ok"]]
        print(f"  {mark}: {row['target']}: {row['measured']} {row['unit']} ({row['note']})")
