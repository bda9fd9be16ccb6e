"""Three consecutive `llm` calls with a ~1,000-token system prompt: llm-mlx alone against the
kvstore plugin (kvstore.client.llm_plugin), interleaved in one run.

Each call is `llm -m tiny -s SYSTEM "question i" -o temperature 0 -o max_tokens 32` in a new
process, as a user types it; the plain rounds set KVSTORE_LLM=0 (llm-mlx's model, untouched). Each
side has its own llm user dir (its own logs) and the plugin its own empty kvstore home with no
daemon running, so its first call starts the daemon. Per call: the prompt's tokens and how many
were prefilled (from `llm logs --json`: input_tokens less token_details.cached_tokens), the wall
time from exec to exit, the time to the first byte of the answer, and the exit wait (the last byte
of the answer to the process's exit: what the plugin's write-behind flush adds there). A tiny
model (kvstore.tiny, generated here) is the hard case: its prefill costs little, so what the
plugin adds shows in full.

The functions here are also what tests/client/test_llm_plugin.py drives `llm` with.

    python -m bench.llm_calls [--calls 3] [--system-tokens 1000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ALIAS = "tiny"
MAX_TOKENS = 32  # each answer's length: the tiny model's decode is not what is measured
PHRASE = "Answer in one short sentence and stay on the user's topic."  # repeated: the system


@dataclass
class Call:
    """One `llm` process: what it printed, when, and what llm logged of it."""

    stdout: str
    stderr: str
    wall_s: float  # exec to exit
    first_byte_s: float  # exec to the answer's first byte
    exit_wait_s: float  # the answer's last byte to the process's exit
    returncode: int


def llm_env(user_dir: Path, home: Path, model: Path, *, plugin: bool = True) -> dict[str, str]:
    """The environment of an `llm` with its own user dir (`model` registered in llm-mlx's models
    file under the alias `tiny`) and kvstore home; `plugin=False` switches kvstore off."""
    user_dir.mkdir(parents=True, exist_ok=True)
    models = user_dir / "llm-mlx.json"
    if not models.exists():
        models.write_text(json.dumps({str(model): {"aliases": [ALIAS]}}))
    env = {**os.environ, "LLM_USER_PATH": str(user_dir), "KVSTORE_HOME": str(home)}
    env["HF_HUB_OFFLINE"] = "1"
    env["KVSTORE_LLM"] = "1" if plugin else "0"
    return env


def run_llm(env: dict[str, str], *args: str, timeout: float = 300.0) -> Call:
    """`llm ARGS` in a new process, its output read as it comes (first and last byte timed)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(
        [sys.executable, "-m", "llm", *args], env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert p.stdout is not None and p.stderr is not None
    out, err, first, last = b"", b"", None, t0
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    sel.register(p.stderr, selectors.EVENT_READ)
    open_streams = 2
    while open_streams:
        if time.perf_counter() - t0 > timeout:
            p.kill()
            raise TimeoutError(f"llm {' '.join(args)} ran past {timeout} s")
        for key, _ in sel.select(timeout=1.0):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                open_streams -= 1
            elif key.fileobj is p.stdout:
                now = time.perf_counter()
                first = now if first is None else first
                last, out = now, out + chunk
            else:
                err += chunk
    rc = p.wait()
    end = time.perf_counter()
    return Call(
        stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
        wall_s=end - t0, first_byte_s=(first or end) - t0, exit_wait_s=end - last, returncode=rc,
    )  # fmt: skip


def logged(env: dict[str, str], n: int) -> list[dict]:
    """The last `n` responses `llm logs --json` holds, oldest first (as it prints them)."""
    c = run_llm(env, "logs", "--json", "-n", str(n))
    assert c.returncode == 0, c.stderr
    return list(json.loads(c.stdout))


def cached_tokens(row: dict) -> int:
    """What the store served of a logged response (0 when nothing, or llm-mlx alone)."""
    details = row.get("token_details") or {}
    if isinstance(details, str):
        details = json.loads(details)
    return int(details.get("cached_tokens", 0))


def stop_daemon(home: Path, timeout: float = 10.0) -> bool:
    """SIGTERM the daemon that holds `home` (the one a plugin call started) and wait until it
    let go of the lock; whether one was running."""
    from kvstore.wire.daemon_client import lock_holder

    pid = lock_holder(home)
    if not pid:
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while lock_holder(home) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    return True


def system_prompt(model: Path, tokens: int) -> str:
    """PHRASE repeated until the system message alone renders to about `tokens` tokens."""
    from mlx_lm import load

    _, tokenizer = load(str(model))
    per = len(tokenizer.encode(" " + PHRASE, add_special_tokens=False))
    return " ".join([PHRASE] * max(1, tokens // per))


def measure(model: Path, root: Path, *, calls: int, system: str, max_tokens: int) -> dict:
    """`calls` rounds, each a plain call then a plugin call with the same question."""
    sides = {
        name: llm_env(root / name / "llm", root / name / "home", model, plugin=name == "plugin")
        for name in ("plain", "plugin")
    }
    rows: dict[str, list[dict]] = {"plain": [], "plugin": []}
    try:
        for i in range(calls):
            for name, env in sides.items():
                question = f"Question {i + 1}: what should I check first?"
                c = run_llm(
                    env, "-m", ALIAS, "-s", system, question,
                    "-o", "temperature", "0", "-o", "max_tokens", str(max_tokens),
                )  # fmt: skip
                if c.returncode != 0:
                    raise RuntimeError(f"{name} call {i + 1} failed: {c.stderr}")
                rows[name].append({**asdict(c), "stdout": c.stdout, "stderr": c.stderr})
        for name, env in sides.items():
            for row, log in zip(rows[name], logged(env, calls)):
                row["input_tokens"] = log["input_tokens"]
                row["cached_tokens"] = cached_tokens(log)
                row["prefilled_tokens"] = log["input_tokens"] - row["cached_tokens"]
    finally:
        stop_daemon(root / "plugin" / "home")
    same = all(a["stdout"] == b["stdout"] for a, b in zip(rows["plain"], rows["plugin"]))
    return {"calls": rows, "same_text": same}


def summary(res: dict) -> dict:
    """Ratios of the plugin over plain per call, and the plugin's extra start-up and exit."""
    plain, plugin = res["calls"]["plain"], res["calls"]["plugin"]

    def ratio(key: str, i: int) -> float:
        return plugin[i][key] / plain[i][key] if plain[i][key] else float("nan")

    later = range(1, len(plain))
    return {
        "prefilled_ratio": [ratio("prefilled_tokens", i) for i in range(len(plain))],
        "wall_ratio": [ratio("wall_s", i) for i in range(len(plain))],
        "first_byte_ratio": [ratio("first_byte_s", i) for i in range(len(plain))],
        # what the plugin adds at exit: its flush to the daemon (call 1 also waits for the daemon
        # it started to answer)
        "extra_exit_s": [p["exit_wait_s"] - q["exit_wait_s"] for p, q in zip(plugin, plain)],
        "later_wall_ratio_median": statistics.median(ratio("wall_s", i) for i in later)
        if later
        else None,
        "same_text": res["same_text"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="each answer's length")
    ap.add_argument("--json", type=Path, default=None, help="write the run's figures here")
    args = ap.parse_args(argv)
    from kvstore.tiny import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="kvstore-llm-bench-") as tmp:
        root = Path(tmp)
        model = make_tiny_model(root / "llama", "llama")
        system = system_prompt(model, args.system_tokens)
        res = measure(model, root, calls=args.calls, system=system, max_tokens=args.max_tokens)
    res["summary"] = s = summary(res)
    print("call  side    prompt  prefilled  wall_s  first_byte_s  exit_wait_s")
    for i in range(args.calls):
        for name in ("plain", "plugin"):
            r = res["calls"][name][i]
            print(
                f"{i + 1:>4}  {name:<6}  {r['input_tokens']:>6}  {r['prefilled_tokens']:>9}  "
                f"{r['wall_s']:>6.2f}  {r['first_byte_s']:>12.2f}  {r['exit_wait_s']:>11.3f}"
            )
    print(json.dumps(s, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
