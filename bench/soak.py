"""Memory under load (issue 34 item 6): a fixed number of requests through a real `kvstore serve`
and `kvstore daemon` with learning on, the tiny llama, several client threads sending chats of
1-6 turns over 3 system prompts. Reported: serve's anonymous memory (RssAnon of
/proc/PID/status on Linux) after a warm-up and at the end, and its growth per request; the
target is flat within noise. On macOS there is no /proc: the figure would be the process's
private dirty memory (`footprint` or `vmmap --summary PID`, "Physical footprint"), which this
module does not read: it reports None there.

    python -m bench.soak                      # quick: 2,000 requests after 1,000 of warm-up, then
                                              # the same through a plain mlx_lm.server (control)
    python -m bench.soak --full               # 16,000 after 1,000 (~20 min here on a quiet box)
    python -m bench.soak --no-control         # without the plain mlx_lm.server's row
    python -m bench.soak --in-process 600     # where it grows: tracemalloc over serve's hooks
    python -m bench.run --quick --only soak   # (about 4 minutes on a shared 2-core box)

`--in-process N` drives serve's hooks and prompt cache in this process (as
tests/client/test_request_budget.py does: fetch, generate, insert, record) against a real daemon
after 300 requests of warm-up, and prints the Python allocations that grew in two windows of N
requests (`steady`: in both, by line; `last_window`: the second's), the trie's nodes, mlx's
active and cache memory, this process's RssAnon and the Python allocator's arenas (flat arenas
with a growing RssAnon: memory outside Python's heap; tracemalloc's own traces count in it).

Found and bounded so far (docs/soak.md): StatsRecorder.calls (one CallStats with its reason
spans per request, forever); the cold tier's index of learned chains (tuples of ints: ~36 bytes
a learned token); both periodic re-reads of every learned record (read incrementally now:
kvstore.learned.index.LearnedChains); glibc's dynamic mmap threshold, which let KV buffers
fragment serve's heap (`kvstore serve` fixes it at 128 KiB). What is left with learning on is
Python's heap growing with the cold tier's index of learned records (the learned budget bounds
it); with `--no-learn` serve grows within the plain `mlx_lm.server`'s swing (docs/soak.md).

Each sample also reads the server's memory gauges from its /metrics (serve's own; the control is
mlx_lm.server with only that route added, `python -m bench.soak --plain-server ARGS`): mlx's
active and cached buffers, Python's allocated blocks, glibc malloc's bytes in use and free, and
the process's threads, so a row says which part of RssAnon moved. `soak(..., serve_env={...},
serve_args=(...))` sets a glibc tunable or a serve option on serve's process only.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

SYSTEMS = (
    "You are a careful support assistant for an online shop. Classify each request as billing, "
    "shipping, returns or account, say why in one sentence, and answer politely and briefly.",
    "You are a concise assistant for a small team's wiki. Answer with the page's path and who "
    "last edited it; when you do not know, say so and suggest where to look next.",
    "You are a code reviewer. Read the user's snippet, name the one most serious problem, and "
    "propose a fix in at most three lines. Prefer clarity over cleverness; never invent APIs.",
)
WORDS = (
    "invoice parcel refund password page guide editor branch build test cache token prefix "
    "shipping account billing return order review snippet function error timeout retry queue "
    "daemon store learned budget memory request reply answer question team wiki onboarding"
).split()
MAX_TURNS = 6
REPLY = "Noted: {n} items."  # the assistant turns a chat carries (fixed: every turn extends)
TARGET_BYTES_PER_REQUEST = 512  # flat within noise: less than this per request after warm-up
# The regime measured: the store full, as a long-running serve's is. What serve keeps of the store
# (the cold tier's index of learned records, 4-8 bytes a learned token) is bounded by the learned
# budget in tokens: budget / KV bytes a token. 2 GiB (the default) holds ~16,000 tokens of
# Llama-3.1-8B (128 KiB of KV a token); 64 MiB holds ~47,000 of the tiny llama's (~1.4 KiB), so
# the soak's index is at least as large as a user's 8B model's, and full within the warm-up.
# With the default budget the tiny llama would need ~1.5 M learned tokens to fill it: a soak
# never gets there and its index grows all through (docs/soak.md measures that too).
SOAK_LEARNED_BYTES = 64 * 2**20


def chats(seed: int) -> Iterator[list[list[dict]]]:
    """Endless chats: each the messages of its 1-6 turns (turn k: the system prompt, k user turns
    and the k-1 replies between them), over the 3 system prompts."""
    rng = random.Random(seed)
    while True:
        msgs = [{"role": "system", "content": rng.choice(SYSTEMS)}]
        turns = []
        for k in range(rng.randint(1, MAX_TURNS)):
            user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 18)))
            msgs = [*msgs, {"role": "user", "content": f"{rng.randrange(10**6)}: {user}?"}]
            turns.append(msgs)
            msgs = [*msgs, {"role": "assistant", "content": REPLY.format(n=k + 1)}]
        yield turns


def requests(seed: int) -> Iterator[list[dict]]:
    """The requests of `chats(seed)`, turn after turn."""
    for turns in chats(seed):
        yield from turns


def rss_anon(pid: int) -> int | None:
    """Anonymous resident bytes of `pid` (RssAnon of /proc/PID/status); None where there is no
    /proc (macOS: `footprint PID` / `vmmap --summary PID` would say it, not read here)."""
    kb = _status(pid, "RssAnon")
    return kb * 1024 if kb is not None else None


def threads_of(pid: int) -> int | None:
    """Threads of `pid` now (Threads of /proc/PID/status); None where there is no /proc."""
    return _status(pid, "Threads")


def _status(pid: int, field: str) -> int | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return None


# -- in process: where serve's Python memory grows --------------------------------------------


def _drive(hooks, cache, key, model, tokenizer, messages: list[dict]) -> None:
    """One request as mlx_lm.server runs it: tokenize, fetch, generate, insert, record."""
    import types

    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    from kvstore import mlxlm

    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    hooks.calls.decode = tokenizer.decode
    ctx = types.SimpleNamespace(prompt=prompt, prompt_cache_count=0)
    kv, rest = cache.fetch_nearest_cache(key, prompt)
    ctx.prompt_cache_count = len(prompt) - len(rest)
    kv = kv if kv is not None else make_prompt_cache(model)
    out = [r.token for r in stream_generate(model, tokenizer, rest, max_tokens=2, prompt_cache=kv)]
    held = mlxlm.generated_transcript(kv, prompt + out)
    if held is not None:
        cache.insert_cache(key, held, kv)
    list(hooks.calls.recorded(ctx, iter(out)))


def in_process(n: int, warmup: int = 300, seed: int = 0, top: int = 15) -> dict:
    """`n` requests through serve's hooks and prompt cache in this process, against a real
    daemon with learning on; the Python allocations that grew from the warm-up to the end."""
    import argparse
    import gc
    import tracemalloc
    import types

    import mlx.core as mx
    from mlx_lm import load

    from bench.learned import running_daemon
    from kvstore.client.cli import fixed_mmap_threshold
    from kvstore.client.serve.hooks import patched_server
    from kvstore.tiny import make_tiny_model

    fixed_mmap_threshold()  # as `kvstore serve` starts (its RssAnon then compares)
    root = Path(tempfile.mkdtemp(prefix="kvstore-soak-"))
    try:
        path = make_tiny_model(root / "model", "llama").resolve()
        home = root / "home"
        env = dict(os.environ, KVSTORE_HOME=str(home), HF_HUB_OFFLINE="1")
        model, tokenizer = load(str(path))
        key = (str(path), None, None)
        args = argparse.Namespace(host="127.0.0.1", port=0, prefill_step_size=2048)
        provider = types.SimpleNamespace(model_key=key, model=model, tokenizer=tokenizer,
                                         cli_args=args)  # fmt: skip
        got: list = []
        with (
            running_daemon(home, root / "daemon.log", env),
            patched_server(home, hooks_out=got) as server,
        ):
            (hooks,) = got
            hooks.warm_up.started = hooks.ready = True  # no warm-up requests over HTTP
            cache = server.LRUPromptCache(10)
            hooks.on_load(provider)
            reqs = requests(seed)
            snaps, marks = [], []
            try:
                for _ in range(warmup):
                    _drive(hooks, cache, key, model, tokenizer, next(reqs))
                tracemalloc.start(1)
                for i in range(3):  # the warm-up's end, then twice `n` requests later
                    if i:
                        for _ in range(n):
                            _drive(hooks, cache, key, model, tokenizer, next(reqs))
                    hooks.flush()
                    gc.collect()
                    snap = tracemalloc.take_snapshot().filter_traces(
                        [tracemalloc.Filter(False, tracemalloc.__file__)]  # the snapshots
                    )
                    snaps.append(snap)
                    marks.append((sum(t.size for t in snap.traces), mx.get_active_memory(),
                                  mx.get_cache_memory(), _trie_nodes(cache),
                                  rss_anon(os.getpid()), pymalloc_arenas()))  # fmt: skip
                tracemalloc.stop()
            finally:
                hooks.close(5.0)
                if hooks.learner is not None:
                    hooks.learner.close(5.0)
        return _grew(snaps, marks, n, warmup, top, hooks)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def pymalloc_arenas() -> int | None:
    """Python's small-object allocator's arenas in use now (`sys._debugmallocstats`, which
    writes to the C stderr): freed to the system only when every block in one is free, so a
    heap whose live objects stay flat can still hold more of them (fragmentation). None while
    tracemalloc traces (Python prints only its free lists then)."""
    import re

    err = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(err, 2)
            os.close(err)
        f.seek(0)
        m = re.search(rb"# arenas allocated current\s*=\s*([\d,]+)", f.read())
    return int(m.group(1).replace(b",", b"")) if m else None


def _trie_nodes(cache) -> int:
    """Nodes of the prompt cache's trie (mlx-lm's PromptTrie: a dict per token)."""
    stack, n = list(cache._trie._trie.values()), 0
    while stack:
        node = stack.pop()
        n += 1
        stack.extend(v for k, v in node.items() if k != "__value__")
    return n


def _line_growth(stat, n: int) -> dict:
    """One tracemalloc line's growth over a window of `n` requests."""
    where = str(stat.traceback[0])
    return {"where": where, "bytes_per_request": round(stat.size_diff / n, 1),
            "count": stat.count_diff}  # fmt: skip


def _grew(snaps, marks, n: int, warmup: int, top: int, hooks) -> dict:
    """What grew in both windows of `n` requests (steady growth, not the LRU's churn), by line."""
    first = {s.traceback[0]: s.size_diff for s in snaps[1].compare_to(snaps[0], "lineno")}
    second = snaps[2].compare_to(snaps[1], "lineno")
    steady = sorted((s for s in second if s.size_diff > 0 and first.get(s.traceback[0], 0) > 0),
                    key=lambda s: -s.size_diff)  # fmt: skip

    def per(i: int) -> float:
        return round((marks[2][i] - marks[1][i]) / n, 1)

    return {
        "requests": 2 * n,
        "warmup": warmup,
        "python_bytes_per_request": [
            round((marks[k][0] - marks[k - 1][0]) / n, 1) for k in (1, 2)
        ],  # fmt: skip
        "mlx_active_bytes_per_request": per(1),
        "mlx_cache_bytes_per_request": per(2),
        "trie_nodes": [m[3] for m in marks],
        "rss_anon": [m[4] for m in marks],  # this process's, as the soak reads serve's
        "rss_anon_bytes_per_request": [
            round((marks[k][4] - marks[k - 1][4]) / n, 1)
            if None not in (marks[k][4], marks[k - 1][4])
            else None
            for k in (1, 2)
        ],
        "pymalloc_arenas": [m[5] for m in marks],
        "calls_kept": len(hooks.calls.stats.calls) if hooks.calls.stats is not None else None,
        "steady": [_line_growth(s, n) for s in steady[:top]],
        "last_window": [_line_growth(s, n) for s in second[:top]],
    }


# -- through real processes: serve's anonymous memory -----------------------------------------


class _Load:
    """`clients` threads sending requests (each its own chats) until `total` were sent."""

    def __init__(self, server, clients: int, max_tokens: int):
        self.server, self.max_tokens = server, max_tokens
        self.streams = [requests(seed) for seed in range(clients)]
        self.lock = threading.Lock()
        self.sent = self.errors = self.prompt_tokens = self.cached_tokens = 0

    def send(self, total: int) -> None:
        """`total` requests more, over all clients; returns when all are answered."""
        todo = [total]

        def client(stream) -> None:
            while True:
                with self.lock:
                    if todo[0] <= 0:
                        return
                    todo[0] -= 1
                try:
                    reply = self.server.chat(next(stream), max_tokens=self.max_tokens)
                except OSError:
                    with self.lock:
                        self.errors += 1
                    continue
                usage = reply.get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}
                with self.lock:
                    self.sent += 1
                    self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
                    self.cached_tokens += int(details.get("cached_tokens") or 0)

        threads = [threading.Thread(target=client, args=(s,), daemon=True) for s in self.streams]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def soak(requests_: int, warmup: int, clients: int = 4, samples: int = 6,
         max_tokens: int = 4, control: bool = False,
         learned_max_bytes: int | None = None, serve_env: dict | None = None,
         serve_args: tuple[str, ...] = ()) -> dict:  # fmt: skip
    """`warmup` then `requests_` requests through a real daemon and `kvstore serve` (learning on,
    the tiny llama, `clients` threads); serve's RssAnon after the warm-up, every
    `requests_ / samples` requests, and at the end. With `control`, the same load through a
    plain `mlx_lm.server` of the same model afterwards (`control`: its figures, as noise).
    `serve_env` (e.g. a glibc tunable such as MALLOC_ARENA_MAX) and `serve_args` (e.g.
    `--no-learn`) go to serve's process only, never the daemon's or the control's."""
    from bench.learned import _kv, free_port, running_daemon
    from kvstore.tiny import make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="kvstore-soak-"))
    try:
        model = make_tiny_model(root / "model", "llama").resolve()
        home = root / "home"
        if learned_max_bytes is not None:
            home.mkdir(parents=True)
            (home / "settings.toml").write_text(f"learned_max_bytes = {learned_max_bytes}\n")
        env = dict(os.environ, KVSTORE_HOME=str(home), HF_HUB_OFFLINE="1",
                   TRANSFORMERS_VERBOSITY="error")  # fmt: skip
        with running_daemon(home, root / "daemon.log", env) as daemon:
            port = free_port()
            argv = _kv("serve", "--home", str(home), "--model", str(model), "--port", str(port),
                       *serve_args)  # fmt: skip
            senv = dict(env, **(serve_env or {}))
            run = _loaded(argv, port, root / "serve.log", senv, requests_, warmup, clients,
                          samples, max_tokens, daemon.pid)  # fmt: skip
        res = _figures(*run, requests_, warmup, clients)
        res["serve_env"], res["serve_args"] = dict(serve_env or {}), list(serve_args)
        res["learned_max_bytes"] = learned_max_bytes
        if control:
            port = free_port()
            argv = [sys.executable, "-m", "bench.soak", "--plain-server", "--model", str(model),
                    "--port", str(port)]  # fmt: skip
            run = _loaded(argv, port, root / "plain.log", env, requests_, warmup, clients,
                          samples, max_tokens)  # fmt: skip
            res["control"] = _figures(*run, requests_, warmup, clients)
            res["control"]["model"] = "tiny llama, plain mlx_lm.server"
        return res
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _loaded(argv, port, log, env, requests_, warmup, clients, samples, max_tokens,
            daemon_pid=None) -> tuple:  # fmt: skip
    """Start the server of `argv`, send the warm-up and then `requests_` requests in `samples`
    parts; (load, serve's RssAnon, threads and memory gauges after each, the daemon's RssAnon at
    the same points, seconds, warm-up seconds)."""
    from bench.learned import Server

    server = Server(argv, port, log, env)
    try:
        server.wait_ready()
        load = _Load(server, clients, max_tokens)
        t0 = time.perf_counter()
        load.send(warmup)
        rss = [rss_anon(server.proc.pid)]
        threads = [threads_of(server.proc.pid)]
        gauges = [memory_gauges(server)]
        daemon_rss = [rss_anon(daemon_pid)] if daemon_pid else []
        t1 = time.perf_counter()
        for k in range(samples):
            load.send(requests_ * (k + 1) // samples - requests_ * k // samples)
            rss.append(rss_anon(server.proc.pid))
            threads.append(threads_of(server.proc.pid))
            gauges.append(memory_gauges(server))
            if daemon_pid:
                daemon_rss.append(rss_anon(daemon_pid))
        return load, rss, threads, gauges, daemon_rss, time.perf_counter() - t1, t1 - t0
    finally:
        server.stop()


MEMORY_GAUGES = ("kvstore_mlx_active_bytes", "kvstore_mlx_cache_bytes",
                 "kvstore_python_allocated_blocks", "kvstore_malloc_in_use_bytes",
                 "kvstore_malloc_free_bytes")  # fmt: skip


def memory_gauges(server) -> dict | None:
    """Serve's memory by where it is, from its /metrics (kvstore.client.serve.gauges); None for
    a server without them (the plain mlx_lm.server)."""
    try:
        status, body = server._get("/metrics")
    except OSError:
        return None
    if status != 200:
        return None
    got = {}
    for line in body.decode(errors="replace").splitlines():
        name, _, value = line.partition(" ")
        if name in MEMORY_GAUGES:
            got[name] = int(float(value))
    return got or None


def _by_gauge(samples: list) -> dict | None:
    """{gauge: its value at each sample} (None where serve gave none)."""
    if not any(samples):
        return None
    return {g: [s.get(g) if s else None for s in samples] for g in MEMORY_GAUGES}


def _figures(load, rss, threads, gauges, daemon_rss, seconds, warm_s, n, warmup, clients) -> dict:
    known = None not in rss
    growth = rss[-1] - rss[0] if known else None
    return {
        "model": "tiny llama",
        "clients": clients,
        "warmup": warmup,
        "requests": n,
        "errors": load.errors,
        "requests_per_s": round(n / seconds, 1) if seconds else None,
        "warmup_s": round(warm_s, 1),
        "cached_share": round(load.cached_tokens / load.prompt_tokens, 3)
        if load.prompt_tokens
        else None,
        "memory": "RssAnon of /proc/PID/status" if known else None,
        "serve_rss_anon": rss,  # after the warm-up, then after each of `samples` parts
        "serve_threads": threads,  # at the same points
        "serve_memory": _by_gauge(gauges),  # serve's /metrics at the same points (kvstore's)
        "daemon_rss_anon": daemon_rss,
        "growth_bytes": growth,
        "bytes_per_request": round(growth / n, 1) if growth is not None else None,
        # least squares over the samples: an end that swings (mlx's buffer cache) weighs less
        "slope_bytes_per_request": _slope(rss, n) if known else None,
        # the same over the second half of the run: a heap still filling slopes in the first
        "late_slope_bytes_per_request": _late_slope(rss, n) if known else None,
        "swing_bytes": max(rss) - min(rss) if known else None,
        # the same less mlx's buffer cache (freed buffers mlx keeps: it swings by up to 20 MiB)
        "slope_less_mlx_cache_bytes_per_request": _slope_less_cache(rss, gauges, n),
        "target_bytes_per_request": TARGET_BYTES_PER_REQUEST,
    }


def _slope_less_cache(rss: list, gauges: list, n: int) -> float | None:
    cache = [g.get("kvstore_mlx_cache_bytes") if g else None for g in gauges]
    if None in rss or None in cache:
        return None
    return _slope([r - c for r, c in zip(rss, cache, strict=True)], n)


def _late_slope(rss: list[int], n: int) -> float | None:
    """`_slope` over the second half of the samples (None under 5 samples)."""
    if len(rss) < 5:
        return None
    half = len(rss) // 2
    return _slope(rss[half:], n * (len(rss) - 1 - half) // (len(rss) - 1))


def _slope(rss: list[int], n: int) -> float:
    """Bytes a request of the line fitted through the samples (taken every n/(len-1) requests)."""
    xs = [n * i / (len(rss) - 1) for i in range(len(rss))]
    mx_, my = sum(xs) / len(xs), sum(rss) / len(rss)
    den = sum((x - mx_) ** 2 for x in xs)
    return round(sum((x - mx_) * (y - my) for x, y in zip(xs, rss, strict=True)) / den, 1)


def run(quick: bool = True, *, requests_: int | None = None, warmup: int | None = None,
        clients: int = 4, control: bool = True) -> dict:  # fmt: skip
    """bench.run's entry: 2,000 requests after 1,000 (quick), 16,000 after 1,000 (full), the
    store full (`SOAK_LEARNED_BYTES`); with `control`, the plain mlx_lm.server's row too (what
    "flat within noise" is measured by)."""
    res = soak(requests_ or (2000 if quick else 16000), warmup or 1000, clients,
               samples=6 if quick else 16, control=control,
               learned_max_bytes=SOAK_LEARNED_BYTES)  # fmt: skip
    _print(res)
    return res


def targets(res: dict) -> list[dict]:
    """bench.run's row: serve's anonymous memory per request after the warm-up (the fitted
    slope); flat: under the target, or (with the control row) growing no more than the plain
    mlx_lm.server swung under the same load."""
    per = res["slope_bytes_per_request"]
    rss = res["serve_rss_anon"]
    control = res.get("control")
    note = (f"serve RssAnon {_mib(rss)} over {res['requests']} requests after "
            f"{res['warmup']} ({res['clients']} clients, {res['errors']} errors, "
            f"{res['bytes_per_request']} B a request end to end, "
            f"{res.get('late_slope_bytes_per_request')} fitted over the second half); daemon "
            f"{_ends(res['daemon_rss_anon'])}"
            if per is not None else "no /proc here (macOS): not measured")  # fmt: skip
    blocks = (res.get("serve_memory") or {}).get("kvstore_python_allocated_blocks") or []
    if None not in blocks and len(blocks) > 1:  # what grew with learning on: the learned index
        note += f"; Python's allocated blocks {blocks[0]} -> {blocks[-1]}"
    threads = res.get("serve_threads") or []
    if None not in threads and len(set(threads)) > 1:  # one left behind per request would show
        note += f"; threads {threads[0]} -> {threads[-1]} (max {max(threads)})"
    ok = None if per is None else per < res["target_bytes_per_request"]
    if ok is False and control and control.get("swing_bytes") is not None:
        ok = res["growth_bytes"] <= control["swing_bytes"]  # within the control's noise
        note += (f"; plain mlx_lm.server grew {control['growth_bytes'] / 2**20:.1f} MiB, "
                 f"swung {control['swing_bytes'] / 2**20:.1f}")  # fmt: skip
    rows = [{
        "target": f"kvstore serve's anonymous memory flat under load (< "
                  f"{res['target_bytes_per_request']} B a request after warm-up, or within the "
                  f"plain server's swing), {res['model']}, learning on, {_budget(res)}",
        "measured": per,
        "unit": "B/request",
        "ok": ok,
        "note": note,
    }]  # fmt: skip
    if control:
        rows.append({
            "target": "control: plain mlx_lm.server under the same load (no target)",
            "measured": control["slope_bytes_per_request"],
            "unit": "B/request",
            "ok": None,
            "note": f"RssAnon {_mib(control['serve_rss_anon'])}, "
                    f"{control.get('late_slope_bytes_per_request')} B a request fitted over the "
                    f"second half",
        })  # fmt: skip
    return rows


def _budget(res: dict) -> str:
    got = res.get("learned_max_bytes")
    return "the default learned budget" if got is None else f"learned budget {got / 2**20:g} MiB"


def _ends(values: list) -> str:
    """First -> last (max) in MiB, for a long series."""
    got = [v for v in values if v is not None]
    if len(got) < 3:
        return _mib(got)
    return f"{got[0] / 2**20:.1f} -> {got[-1] / 2**20:.1f} MiB (max {max(got) / 2**20:.1f})"


def _mib(values: list) -> str:
    return " -> ".join(f"{v / 2**20:.1f}" for v in values if v is not None) + " MiB"


def _print(res: dict) -> None:
    for row in targets(res):
        said = {True: "met", False: "MISSED", None: "told"}[row["ok"]]
        print(f"  {said}: {row['target']}: {row['measured']} "
              f"{row['unit']} ({row['note']})")  # fmt: skip


def plain_server(argv: list[str]) -> None:
    """The control: a plain `mlx_lm.server` (`argv`: its options), with only GET /metrics added,
    answering the memory gauges serve answers (kvstore.client.serve.gauges: mlx's active and
    cached buffers, Python's blocks, malloc's in use and free), so that both rows say which part
    of RssAnon moved."""
    import functools

    from mlx_lm import server

    from kvstore.client.serve.gauges import process_memory
    from kvstore.metrics import reply_metrics

    class Handler(server.APIHandler):
        def do_GET(self):
            if self.path != "/metrics":
                return super().do_GET()
            process_memory()
            reply_metrics(self)

    http = server._run_http_server  # as kvstore serve gives its handler (kvstore.mlxlm)
    server._run_http_server = functools.partial(http, handler_class=Handler)
    sys.argv = ["mlx_lm.server", *argv]
    server.main()


def main(argv: list[str]) -> None:
    if argv[:1] == ["--plain-server"]:
        plain_server(argv[1:])
        return
    if "--in-process" in argv:
        n = int(argv[argv.index("--in-process") + 1])
        print(json.dumps(in_process(n), indent=1))
        return
    res = run("--full" not in argv, control="--no-control" not in argv)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
