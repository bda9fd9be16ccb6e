"""`make demo`: the daemon warms a four-stage manifest on a tiny generated model at boot, then a
fresh app process hydrates the store and runs each stage's call without the store and with the
hydrated cache, side by side.

Everything lives under .demo/ (model, home, manifest); nothing else on the machine is touched.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(".demo")
MAX_TOKENS = 8


def kvstore_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvstore", *args]


def setup() -> tuple[Path, Path, Path]:
    from bench.stages import write_manifest
    from kvstore.tiny import make_tiny_model

    model = ROOT / "model"
    if not (model / "config.json").is_file():
        print(f"generating a tiny hybrid-attention model (qwen3_5 layout) in {model}")
        make_tiny_model(model, "qwen3_5")
    home = ROOT / "home"
    shutil.rmtree(home, ignore_errors=True)  # a fresh home each run: the warm is part of the demo
    manifest = write_manifest(ROOT, model.resolve())
    return model.resolve(), home.resolve(), manifest


def run_calls(model_path: Path, home: Path) -> int:
    """The fresh process: every stage twice, cold and hydrated; prints the table."""
    import mlx.core as mx
    from mlx_lm import load, stream_generate
    from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

    from bench.stages import STAGES, user_turn
    from kvstore.client import hydrate

    model, tokenizer = load(str(model_path))
    lru = LRUPromptCache(max_size=16)
    report = hydrate(lru, str(model_path), model_path, home=home, model=model)
    print(
        f"hydrated {report.entries} entries ({report.tokens} tokens, "
        f"{report.nbytes / 2**20:.1f} MiB) in {report.seconds * 1000:.1f} ms"
    )

    def call(prompt, cache):
        t = time.perf_counter()
        out, prefill_s = [], None
        for r in stream_generate(
            model, tokenizer, prompt, max_tokens=MAX_TOKENS, prompt_cache=cache
        ):
            if prefill_s is None:
                prefill_s = time.perf_counter() - t  # time to the first token: the prefill
            out.append(r.token)
        return out, prefill_s

    call(tokenizer.encode("warm up the kernels"), make_prompt_cache(model))  # not measured
    rows, ok = [], True
    for name, stage in STAGES.items():
        messages = [
            {"role": "system", "content": stage["system"]},
            {"role": "user", "content": user_turn(name)},
        ]
        prompt = tokenizer.apply_chat_template(
            messages, tools=stage["tools"], add_generation_prompt=True
        )
        if hasattr(prompt, "keys"):
            prompt = prompt["input_ids"]
        cold_out, cold_s = call(prompt, make_prompt_cache(model))
        cache, rest = lru.fetch_nearest_cache(str(model_path), prompt)
        if cache is None:
            cache, rest = make_prompt_cache(model), prompt
        warm_out, warm_s = call(rest, cache)
        same = cold_out == warm_out
        ok &= same and len(rest) < len(prompt)
        rows.append((name, len(prompt), len(prompt) - len(rest), len(rest), cold_s, warm_s, same))
        mx.clear_cache()

    head = (
        "stage",
        "prompt tok",
        "from store",
        "prefilled",
        "prefill s (no store)",
        "prefill s (hydrated)",
        "same output",
    )
    print("\n" + " | ".join(head))
    print(" | ".join("-" * len(h) for h in head))
    for name, n, stored, pre, cold, warm, same in rows:
        print(
            f"{name:10} | {n:10d} | {stored:10d} | {pre:9d} | {cold:20.4f} | {warm:20.4f} | "
            f"{'yes' if same else 'NO'}"
        )
    tot_cold, tot_warm = sum(r[4] for r in rows), sum(r[5] for r in rows)
    print(
        f"\nprefill total: {tot_cold:.3f}s without the store, {tot_warm:.3f}s hydrated "
        f"({tot_cold / max(tot_warm, 1e-9):.1f}x); {sum(r[2] for r in rows)} of "
        f"{sum(r[1] for r in rows)} prompt tokens came from the store"
    )
    return 0 if ok else 1


def wait_for_boot_warm(home: Path, daemon: subprocess.Popen, timeout: float = 300.0) -> dict:
    """Poll the daemon until its boot warm has run; returns its last_warm record."""
    from kvstore.wire.daemon_client import connect
    from kvstore.wire.messages import StatsRequest

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise SystemExit(f"the daemon exited with {daemon.returncode}; see its log above")
        client = connect(home, timeout=5)
        if client is not None:
            with client:
                last = (client.send(StatsRequest()).daemon or {})["last_warm"]
            if last:
                return last
        time.sleep(0.2)
    raise SystemExit(f"the daemon did not finish its boot warm within {timeout:.0f}s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--home", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if args.calls:
        return run_calls(args.model, args.home)

    model, home, manifest = setup()
    env = {**os.environ, "KVSTORE_HOME": str(home)}
    print(f"starting the daemon on {home}; it warms {manifest} at boot")
    t = time.perf_counter()
    daemon = subprocess.Popen(kvstore_cmd("daemon", "--manifest", str(manifest)), env=env)
    try:
        last = wait_for_boot_warm(home, daemon)
        print(
            f"boot warm: {last['warmed']} pins warmed in {last['seconds']:.1f}s "
            f"({time.perf_counter() - t:.1f}s with the daemon's start); daemon memory "
            f"{last['rss_before'] / 2**20:.0f} MiB before, {last['rss_peak'] / 2**20:.0f} MiB "
            f"peak, {last['rss_after'] / 2**20:.0f} MiB after (the model is released)\n"
        )
        subprocess.run(kvstore_cmd("ls"), env=env, check=True)
        print(
            "\nrestarting the app: a fresh process hydrates the store, then runs every stage twice"
        )
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.demo",
                "--calls",
                "--model",
                str(model),
                "--home",
                str(home),
            ],
            env=env,
        ).returncode
    finally:
        daemon.terminate()  # SIGTERM: the daemon finishes its write, closes LMDB, exits 0
        try:
            daemon.wait(timeout=10)
        except subprocess.TimeoutExpired:
            daemon.kill()


if __name__ == "__main__":
    sys.exit(main())
