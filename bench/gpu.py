"""The restart path at the seed's model's shapes, for an accelerator (issue 33).

The model: Qwen3.5-9B's text config (QWEN35_9B: 32 layers, full attention every 4th with 16 query
and 4 KV heads of 256, the other 24 Gated DeltaNet with 16 key and 32 value heads of 128, a
vocabulary of 248,320), random weights quantized to 8 bits as the seed runs it (mlx-lm's
quantize_model, affine, group 64), made here by kvstore.tiny, never downloaded. Per prefix of 1k,
4k and 16k tokens (a system prompt, pinned by `kvstore warm` in a home of its own):

  cold prefill    the prefix's prefill in a fresh process, after the load and a small untimed one
  kvstore warm    `kvstore warm` of a manifest pinning it, the whole command (load, prefill, store)
  first hydrate   kvstore.client.hydrate in a fresh process against load_prompt_cache of the same
                  bytes (bench.coldstart's regime), and the tokens each restored
  load            kvstore.client.load against mlx_lm.load, fresh processes (the largest prefix)
  first request   after a restart, the first request's time to first token (the prefix and a new
                  user turn, max_tokens=1) through `kvstore serve` (beside a `kvstore daemon`)
                  against plain `mlx_lm.server`; spawn to ready and to first answer
  bytes           stored per pin; learned per chat turn (turns continuing that first request, the
                  daemon's learned bytes over the turns)

Fresh processes go through bench.timing. Every step has a time limit and the results file is
rewritten after each step, so a run cut short leaves what it measured.

    python -m bench.gpu --out gpu.json       # full shapes: an accelerator (bench/gpu_device.sh)
    python -m bench.gpu --tiny               # tiny shapes: the smoke test (tests/bench)
    python -m bench.gpu --report gpu.json    # the table of a results file, a partial one too
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.fingerprint import CONFIG
from bench.timing import Stats, fresh_process, fresh_rounds, worker

# Qwen3.5-9B's text config (its config.json), as bench.fingerprint lays out its files
QWEN35_9B = {k: v for k, v in CONFIG["text_config"].items() if k != "model_type"}
PREFIXES = (1024, 4096, 16384)
TINY_PREFIXES = (96,)
BITS = 8
CHAT_TURNS = 2  # turns after the first request, for the learned bytes
USER = "{code} writes: invoice {n} was charged twice and the sync fails. Can you fix it?"


class StepTimeout(Exception):
    pass


# -- fresh-process workers (bench.timing.worker) -----------------------------------------------


def cold_prefill(argv: list[str]) -> dict:
    """MODEL NTOKENS: load, an untimed prefill of 32 tokens (kernels built), then the timed one."""
    t0 = time.perf_counter()
    import mlx.core as mx
    from mlx_lm import load

    from kvstore.kvcheck.prefill import prefill

    model_path, n = argv[0], int(argv[1])
    model, _ = load(model_path)
    load_s = time.perf_counter() - t0
    mx.eval([c.state for c in prefill(model, list(range(3, 35)))])
    ids = [3 + (i * 7919) % 400 for i in range(n)]
    t = time.perf_counter()
    cache = prefill(model, ids)
    mx.eval([c.state for c in cache])
    mx.synchronize()
    return {"prefill_s": time.perf_counter() - t, "tokens": n, "load_s": load_s}


def first_hydrate(argv: list[str]) -> dict:
    """ALTERNATIVE HOME MODEL FILE: one timed first restore in a new interpreter (imports before
    the timer): `kvstore` (kvstore.client.hydrate) or `load_prompt_cache` of FILE, the same bytes;
    the call's seconds and the tokens it restored."""
    import mlx.core as mx
    from mlx_lm.models.cache import LRUPromptCache, load_prompt_cache

    alternative, home, model, file = argv
    if alternative == "kvstore":
        import kvstore.codec.codec  # noqa: F401  (its decoder, before the timer as mlx-lm's is)
        from kvstore.client import hydrate

        t = time.perf_counter()
        rep = hydrate(LRUPromptCache(), "m", model, home=home)
        call = time.perf_counter() - t
        if rep.warning or rep.entries != 1:
            raise RuntimeError(f"hydrate: {rep.entries} entries, {rep.warning}")
        tokens = rep.tokens
    else:
        t = time.perf_counter()
        cache = load_prompt_cache(file)
        mx.eval([c.state for c in cache])
        tokens = max(getattr(c, "offset", 0) for c in cache)
        LRUPromptCache().insert_cache("m", list(range(tokens)), cache, cache_type="system")
        call = time.perf_counter() - t
    return {"call_s": call, "tokens": tokens}


# -- the steps -----------------------------------------------------------------------------------


def system_text(tokenizer, n: int) -> str:
    """A system prompt whose rendered system turn is about `n` tokens."""
    unit = "Rule {i}: check every date and amount twice, and quote the tool result you used. "

    def count(k: int) -> int:
        text = "".join(unit.format(i=i) for i in range(k))
        msgs = [{"role": "system", "content": text}]
        return len(tokenizer.apply_chat_template(msgs, tokenize=True))

    per = max(1, count(8) // 8)
    k = max(1, n // per)
    while (c := count(k)) < n:
        k += (n - c) // per + 1
    while k > 1 and count(k) > n:
        k -= 1
    return "".join(unit.format(i=i) for i in range(k))


def make_model(root: Path, tiny: bool) -> dict:
    from kvstore.tiny import make_tiny_model

    t = time.perf_counter()
    path = make_tiny_model(root / "model", "qwen3_5", sizes=None if tiny else QWEN35_9B, bits=BITS)
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return {
        "path": str(path.resolve()),
        "weights_bytes": weights,
        "made_s": time.perf_counter() - t,
    }


def _kv(*args: object) -> list[str]:
    return [sys.executable, "-m", "kvstore", *map(str, args)]


def warm(root: Path, model: str, text: str, env: dict) -> dict:
    """`kvstore warm` of a manifest pinning `text`, timed as a command; the pin's size."""
    from kvstore.store.store import Store

    (root / "prompts").mkdir(parents=True, exist_ok=True)
    (root / "prompts" / "system.md").write_text(text)
    manifest = root / "manifest.toml"
    manifest.write_text(
        f'[[model]]\npath = "{model}"\n\n[[model.prefix]]\nname = "system"\n'
        'file = "prompts/system.md"\n'
    )
    home = root / "home"
    t = time.perf_counter()
    subprocess.run(_kv("warm", "--home", home, "--manifest", manifest), env=env, check=True,
                   capture_output=True)  # fmt: skip
    warm_s = time.perf_counter() - t
    with Store(home, readonly=True) as store:
        (meta,) = store.metas()
        blob = store.read_blob(meta.key)
    # the same KV as the installed mlx-lm saves it: its load_prompt_cache reads its own layout
    # (0.31's cannot read a hybrid's 0.32 layout, which the store keeps whichever is installed)
    from mlx_lm.models.cache import save_prompt_cache

    from kvstore.codec import codec

    cache, _ = codec.decode(blob, name="pin")
    save_prompt_cache(str(root / "entry.safetensors"), cache)
    return {"warm_s": warm_s, "pin_tokens": meta.ntokens, "pin_bytes": meta.nbytes}


def hydrate_vs_lpc(root: Path, model: str, reps: int, warmup: int) -> dict:
    home, file = root / "home", root / "entry.safetensors"
    cases = {
        a: worker(first_hydrate, a, home, model, file) for a in ("kvstore", "load_prompt_cache")
    }
    runs = fresh_rounds(cases, reps=reps, warmup=warmup)
    stats = {a: Stats.of([r["call_s"] for r in v]) for a, v in runs.items()}
    return {
        "stats": {a: st.to_json() for a, st in stats.items()},
        "tokens": {a: [r["tokens"] for r in v] for a, v in runs.items()},
        "kvstore_vs_load_prompt_cache": stats["load_prompt_cache"].median / stats["kvstore"].median,
    }


def loads(root: Path, model: str, reps: int, warmup: int) -> dict:
    from bench.overlap import start

    home, nbytes = root / "home", (root / "entry.safetensors").stat().st_size
    alts = ("mlx_lm.load", "kvstore.client.load")
    runs = fresh_rounds({a: worker(start, a, model, home, 1, nbytes) for a in alts}, reps=reps,
                        warmup=warmup)  # fmt: skip
    stats = {a: Stats.of([r["call_s"] for r in v]) for a, v in runs.items()}
    return {
        "stats": {a: st.to_json() for a, st in stats.items()},
        "client_load_vs_mlx_lm_load": stats["kvstore.client.load"].median
        / stats["mlx_lm.load"].median,
    }


def _messages(text: str, k: int) -> list[dict]:
    """The system prompt, then a chat of k+1 user turns (fixed replies between), each new."""
    msgs = [{"role": "system", "content": text}]
    for i in range(k + 1):
        if i:
            msgs.append({"role": "assistant", "content": f"Refunded charge {i}; sync restarted."})
        msgs.append({"role": "user", "content": USER.format(code=f"{i * 7 + 3:04x}", n=4821 + i)})
    return msgs


def _first_request(argv: list[str], port: int, log: Path, env: dict, text: str) -> tuple:
    from bench.learned import Server, _cached

    s = Server(argv, port, log, env)
    try:
        ready = s.wait_ready()
        reply = s.chat(_messages(text, 0))
        answered = time.perf_counter() - s.spawned
        out = {"spawn_to_ready_s": ready, "spawn_to_first_answer_s": answered,
               "ttft_s": reply["ttft_s"], "prompt_tokens": reply["usage"]["prompt_tokens"],
               "cached_tokens": _cached(reply)}  # fmt: skip
        return out, s
    except BaseException:
        s.stop()
        raise


def serve_vs_plain(root: Path, model: str, text: str, env: dict) -> dict:
    """After a restart: `kvstore serve` (the pin in the store, a daemon beside it) and plain
    `mlx_lm.server`, each a fresh process, the same first request; then the learned bytes."""
    from bench.learned import _daemon_stats, _wait_learned, free_port, running_daemon

    home = root / "home"
    out: dict = {}
    port = free_port()
    plain = [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port)]
    res, s = _first_request(plain, port, root / "plain.log", env, text)
    s.stop()
    out["mlx_lm.server"] = res
    with running_daemon(home, root / "daemon.log", env):
        before = (_daemon_stats(home).get("learned") or {}).get("bytes") or 0
        port = free_port()
        argv = _kv("serve", "--home", home, "--model", model, "--port", port)
        res, s = _first_request(argv, port, root / "serve.log", env, text)
        try:
            for k in range(1, CHAT_TURNS + 1):
                s.chat(_messages(text, k))
            learned, _ = _wait_learned(home, want_records=False)
        finally:
            rc = s.stop()
        if rc not in (0, -signal.SIGTERM):
            raise RuntimeError(f"kvstore serve exited {rc}: {s.tail(500)}")
    out["kvstore serve"] = res
    added = (learned.get("bytes") or 0) - before
    out["learned"] = {
        **learned,
        "turns": CHAT_TURNS + 1,
        "bytes_per_turn": added / (CHAT_TURNS + 1),
    }
    out["ttft_plain_over_kvstore"] = out["mlx_lm.server"]["ttft_s"] / res["ttft_s"]
    return out


# -- the run -------------------------------------------------------------------------------------


def _step(results: dict, path: Path | None, key: str, limit: int, fn: Callable[[], dict],
          strict: bool) -> dict | None:  # fmt: skip
    """`fn()` within `limit` seconds, stored under `key` (an error as {"error": ...} unless
    `strict`), the results file rewritten after it."""

    def alarm(signum, frame):
        raise StepTimeout(f"{key}: timed out after {limit} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(limit)
    t = time.perf_counter()
    value: dict | None
    try:
        value = fn()
    except (StepTimeout, RuntimeError, OSError, ValueError, KeyError, AssertionError,
            subprocess.CalledProcessError) as e:  # fmt: skip
        if strict:
            raise
        err = getattr(e, "stderr", None) or str(e)
        err = err.decode(errors="replace") if isinstance(err, bytes) else err
        lines = [ln for ln in err.strip().splitlines() if ln.strip()] or [type(e).__name__]
        results.setdefault("errors", {})[key] = lines[-1][:400]
        value = None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    print(f"  gpu {key}: {time.perf_counter() - t:.1f} s" + ("" if value else " (failed)"),
          flush=True)  # fmt: skip
    if value is not None:
        *parents, last = key.split("/")
        node = results
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    if path is not None:
        path.write_text(json.dumps(results, indent=1))
    return value


def _prefix(results: dict, out: Path | None, root: Path, model: str, text: str, load: bool,
            env: dict, reps: int, warmup: int, scale: int, strict: bool) -> None:  # fmt: skip
    """Every step for one prefix; the steps after `kvstore warm` only when it pinned the prefix."""
    env = dict(env, KVSTORE_HOME=str(root / "home"))
    n = root.name[1:]
    pin = results["prefixes"]

    def prefill() -> dict:
        return fresh_process(worker(cold_prefill, model, pin[n]["warm"]["pin_tokens"]))

    steps: list[tuple[str, int, Callable[[], dict]]] = [
        ("warm", 12, lambda: warm(root, model, text, env)),
        ("cold_prefill", 12, prefill),
        ("hydrate", 12, lambda: hydrate_vs_lpc(root, model, reps, warmup)),
        ("load", 12, lambda: loads(root, model, reps, warmup)),
        ("first_request", 24, lambda: serve_vs_plain(root, model, text, env)),
    ]
    for name, limit, fn in steps:
        if name == "load" and not load:
            continue
        if name != "warm" and "warm" not in pin.get(n, {}):
            break  # nothing pinned: the rest would measure nothing
        _step(results, out, f"prefixes/{n}/{name}", limit * scale, fn, strict)


def run(tiny: bool, root: Path, out: Path | None = None, prefixes: tuple[int, ...] = ()) -> dict:
    """Every step at tiny or full shapes; `root` holds the model and the homes."""
    import mlx.core as mx

    prefixes = prefixes or (TINY_PREFIXES if tiny else PREFIXES)
    reps, warmup = (1, 0) if tiny else (2, 1)
    scale = 5 if tiny else 10  # time limits: x5 on a shared CPU, x10 (and more from 8k) at 9B
    results: dict = {
        "meta": {"shapes": "tiny qwen3_5" if tiny else "Qwen3.5-9B", "bits": BITS,
                 "device": str(mx.default_device()), "platform": platform.platform(),
                 "mlx": mx.__version__, "started": time.strftime("%Y-%m-%dT%H:%M:%S")},
        "prefixes": {},
    }  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    model = _step(results, out, "model", 60 * scale, lambda: make_model(root, tiny), tiny)
    if model is None:
        return results
    path = model["path"]
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(path))
    for n in prefixes:
        _prefix(results, out, root / f"p{n}", path, system_text(tokenizer, n), n == max(prefixes),
                env, reps, warmup, scale * max(1, n // 4096), tiny)  # fmt: skip
    results["meta"]["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    if out is not None:
        out.write_text(json.dumps(results, indent=1))
    return results


def _fmt(x: float | None, unit: str = "s", digits: int = 2) -> str:
    if x is None:
        return "-"
    if unit == "ms":
        return f"{x * 1e3:.{digits}f} ms"
    if unit == "MB":
        return f"{x / 2**20:.1f} MB" if x >= 2**20 else f"{x / 2**10:.1f} KB"
    return f"{x:.{digits}f} s"


def _get(d: dict, *path: str) -> float | None:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d if isinstance(d, (int, float)) else None


def table(res: dict) -> str:
    """The figures as a Markdown table (a dash where a step did not run or failed)."""
    meta = res.get("meta", {})
    lines = [
        f"bench.gpu: {meta.get('shapes')} ({meta.get('bits')}-bit), {meta.get('device')}, "
        f"mlx {meta.get('mlx')}, {meta.get('platform')}",
        "",
        "| prefix (pin tokens) | cold prefill | `kvstore warm` | first hydrate: kvstore / "
        "load_prompt_cache | first request TTFT: kvstore serve / mlx_lm.server | spawn to first "
        "answer: kvstore serve / mlx_lm.server | bytes per pin | learned bytes per turn |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, r in res.get("prefixes", {}).items():
        h, f = r.get("hydrate", {}), r.get("first_request", {})
        k, p = f.get("kvstore serve", {}), f.get("mlx_lm.server", {})
        lines.append(
            f"| {n} ({_get(r, 'warm', 'pin_tokens') or '-'}) "
            f"| {_fmt(_get(r, 'cold_prefill', 'prefill_s'))} "
            f"| {_fmt(_get(r, 'warm', 'warm_s'))} "
            f"| {_fmt(_get(h, 'stats', 'kvstore', 'median'), 'ms', 1)} / "
            f"{_fmt(_get(h, 'stats', 'load_prompt_cache', 'median'), 'ms', 1)} "
            f"| {_fmt(_get(k, 'ttft_s'), 'ms', 0)} / {_fmt(_get(p, 'ttft_s'), 'ms', 0)} "
            f"| {_fmt(_get(k, 'spawn_to_first_answer_s'))} / "
            f"{_fmt(_get(p, 'spawn_to_first_answer_s'))} "
            f"| {_fmt(_get(r, 'warm', 'pin_bytes'), 'MB')} "
            f"| {_fmt(_get(f, 'learned', 'bytes_per_turn'), 'MB')} |"
        )
        if "load" in r:
            st = r["load"]["stats"]
            lines.append(
                f"\nkvstore.client.load {_fmt(st['kvstore.client.load']['median'])} against "
                f"mlx_lm.load {_fmt(st['mlx_lm.load']['median'])} "
                f"(x{r['load']['client_load_vs_mlx_lm_load']:.3f}), the {n}-token pin hydrated\n"
            )
    if model := res.get("model"):
        lines.append(
            f"model: {model['weights_bytes'] / 2**30:.2f} GiB of weights, made in "
            f"{model['made_s']:.0f} s"
        )
    for key, err in res.get("errors", {}).items():
        lines.append(f"failed: {key}: {err}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: the smoke test's")
    ap.add_argument("--out", type=Path, help="results JSON, rewritten after every step")
    ap.add_argument("--prefixes", help="comma-separated prefix tokens (default 1024,4096,16384)")
    ap.add_argument("--root", type=Path, help="where the model and homes go (default: a temp dir)")
    ap.add_argument("--report", type=Path, help="only print the table of this results file")
    a = ap.parse_args(argv)
    if a.report:
        print(table(json.loads(a.report.read_text())))
        return 0
    try:
        prefixes = tuple(int(x) for x in a.prefixes.split(",")) if a.prefixes else ()
    except ValueError:
        ap.error(f"--prefixes takes comma-separated token counts, not {a.prefixes!r}")
    # a time limit's SIGTERM (bench/gpu_device.sh) unwinds: servers stopped, the model removed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with tempfile.TemporaryDirectory(prefix="kvbench-gpu-", dir=a.root) as tmp:
        res = run(a.tiny, Path(tmp), a.out, prefixes)
    print(table(res), flush=True)
    return 1 if res.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
