"""Learned prefixes as a user feels them (issue 18), on the tiny models, side by side in one run.

- restart: a real `kvstore daemon` and `kvstore serve` (tiny llama; `--full` also the hybrid
  qwen3_5). Three stages (the pipeline's system prompts, new user turns) each asked twice and a
  chat of `turns` turns; the server is `kill -9`ed once the daemon acknowledged what it learned,
  then restarted with no manifest: the first request of each stage and the chat's next turn, their
  `cached_tokens` against the prefix they share with the earlier requests, time to first token,
  spawn to first answer; then bytes the chat stored (records on its chain) against its final
  prompt's KV, and bytes written per learned token.
- restore: in one process (tiny llama, a prefix of `prefix` tokens stored as block records): the
  cold tier's restore against LRUPromptCache's in-memory copy of the same cache (the literal
  ratio), time to first token served from the store against from memory, and prefill.
- report: what reporting a request's prompt costs the request path at 8k tokens.
- vllm-mlx side by side, on both model classes: bench/peer.py (`make bench-peer`).

    python -m bench.learned            # quick sizes, prints the figures as JSON
    python -m bench.run --quick --only learned
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.stages import REQUEST, STAGES
from bench.timing import compile_checkout, interleave

START_TIMEOUT = 120.0
ACK_TIMEOUT = 20.0  # seconds for the daemon to acknowledge what the requests made learnable
STAGE_NAMES = ("synthesize", "reason", "examine")  # the three shortest system prompts
USERS = (
    REQUEST,
    "Our export to CSV stopped working after the update. Which plan includes the API?",
    "Please close my account and delete the data you hold about me by Friday.",
    "The invoice PDF shows the wrong VAT number; can you reissue it to finance?",
)  # two that make each stage's prefix recur, a third that crosses it, one after the restart
CHAT_SYSTEM = "You are a concise assistant for a small team's wiki."


def _kv(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvstore", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An OpenAI-compatible server subprocess (`kvstore serve`, or the peer's) and its log."""

    def __init__(self, argv: list[str], port: int, log: Path, env: dict | None = None,
                 new_session: bool = False):  # fmt: skip
        """`new_session`: the server leads a process group of its own (one SIGKILL to the group
        takes whatever it spawned too)."""
        compile_checkout()  # a restarted server imports kvstore as an installed one does
        self.port, self.log = port, log
        self.out = log.open("ab")
        self.spawned = time.perf_counter()
        self.ready_s: float | None = None  # spawn to ready, when the caller recorded it
        self.proc = subprocess.Popen(argv, stdout=self.out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=new_session)  # fmt: skip

    def _get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def wait_ready(self, path: str = "/health") -> float:
        """Seconds from spawn to a 200 on `path`."""
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.tail()}")
            try:
                if self._get(path)[0] == 200:
                    return time.perf_counter() - self.spawned
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server not ready in {START_TIMEOUT}s:\n{self.tail()}")

    def tail(self, n: int = 3000) -> str:
        self.out.flush()
        return self.log.read_text(errors="replace")[-n:]

    def chat(self, messages: list[dict], max_tokens: int = 1, model: str | None = None) -> dict:
        """One completion; its reply with `ttft_s` (max_tokens=1: the request's wall time)."""
        body = dict(messages=messages, max_tokens=max_tokens, temperature=0.0)
        if model:
            body["model"] = model
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        t = time.perf_counter()
        with urllib.request.urlopen(req, timeout=300) as r:
            reply = json.loads(r.read())
        reply["ttft_s"] = time.perf_counter() - t
        return reply

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.out.close()
        return self.proc.returncode


def _cached(reply: dict) -> int:
    details = reply.get("usage", {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _stage_messages(stage: str, user: str) -> list[dict]:
    return [
        {"role": "system", "content": STAGES[stage]["system"]},
        {"role": "user", "content": user},
    ]


def _chat_turns(turns: int) -> list[list[dict]]:
    """The messages of each turn of a conversation whose replies are fixed text (so every
    prompt extends the previous one, whatever the random tiny model answers)."""
    msgs = [{"role": "system", "content": CHAT_SYSTEM}]
    out = []
    for i in range(turns):
        msgs = msgs + [
            {
                "role": "user",
                "content": f"Question {i}: where is page {i} of the "
                f"onboarding guide, and who last edited it?",
            }
        ]
        out.append(msgs)
        msgs = msgs + [
            {
                "role": "assistant",
                "content": f"Page {i} is under Guides/Onboarding; "
                f"editor number {i * 7 % 13} changed it.",
            }
        ]
    return out  # fmt: skip


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _kv_bytes_per_token(model_path: Path) -> tuple[float, int]:
    """(bytes per token of the layers that grow with the prompt, fixed bytes of state layers)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    model, _ = load(str(model_path))

    def size(n: int) -> int:
        cache = make_prompt_cache(model)
        model(mx.array([list(range(1, n + 1))]), cache=cache)
        mx.eval([c.state for c in cache])
        total = 0
        for c in cache:
            if hasattr(c, "keys") and c.keys is not None and hasattr(c, "offset"):
                total += c.keys[..., : c.offset, :].nbytes + c.values[..., : c.offset, :].nbytes
            else:
                total += sum(a.nbytes for _, a in tree_flatten(c.state) if hasattr(a, "nbytes"))
        return total

    a, b = size(8), size(16)
    per = (b - a) / 8
    return per, int(a - 8 * per)


def _daemon_stats(home: Path) -> dict:
    from kvstore.wire.daemon_client import DaemonClient
    from kvstore.wire.messages import StatsRequest

    with DaemonClient(home) as c:
        return c.send(StatsRequest()).to_wire()


def _stop_daemon(daemon: subprocess.Popen) -> None:
    daemon.send_signal(signal.SIGTERM)
    try:
        daemon.wait(timeout=30)
    except subprocess.TimeoutExpired:
        daemon.kill()


@contextmanager
def running_daemon(home: Path, log: Path, env: dict) -> Iterator[subprocess.Popen]:
    """A real `kvstore daemon` on `home`, its output appended to `log`, answering before the
    body runs and stopped (SIGTERM, then kill) after it."""
    with log.open("ab") as out:
        daemon = subprocess.Popen(_kv("daemon", "--home", str(home)), stdout=out,
                                  stderr=subprocess.STDOUT, env=env)  # fmt: skip
    try:
        _wait_daemon(home, daemon, log)
        yield daemon
    finally:
        _stop_daemon(daemon)


def _wait_daemon(home: Path, daemon: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            _daemon_stats(home)
            return
        except OSError:
            pass
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the daemon did not answer:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def _wait_learned(home: Path, want_records: bool) -> tuple[dict, float]:
    """The daemon's learned stats once they stop changing (acknowledged), and seconds waited."""
    t = time.perf_counter()
    last, since = None, time.monotonic()
    while time.perf_counter() - t < ACK_TIMEOUT:
        learned = _daemon_stats(home).get("learned") or {}
        key = (learned.get("records"), learned.get("snapshots"), learned.get("bytes"))
        has = learned.get("records") if want_records else learned.get("snapshots")
        if key != last:
            last, since = key, time.monotonic()
        elif has and time.monotonic() - since >= 1.0:
            return learned, time.perf_counter() - t - 1.0
        time.sleep(0.1)
    return _daemon_stats(home).get("learned") or {}, float("nan")


def restart(arch: str, root: Path, turns: int) -> dict:
    """Stages and a chat through a real daemon and `kvstore serve`, a `kill -9`, a restart."""
    from mlx_lm.utils import load_tokenizer

    from kvstore.tiny import make_tiny_model

    model = make_tiny_model(root / f"model-{arch}", arch).resolve()
    home = root / f"home-{arch}"
    env = dict(os.environ, KVSTORE_HOME=str(home), HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error")  # fmt: skip
    tok = load_tokenizer(model)

    def ids(msgs: list[dict]) -> list[int]:
        return list(tok.apply_chat_template(msgs, add_generation_prompt=True))

    def serve() -> Server:
        port = free_port()
        argv = _kv("serve", "--home", str(home), "--model", str(model), "--port", str(port))
        return Server(argv, port, root / f"serve-{arch}.log", env)

    daemon_log = (root / f"daemon-{arch}.log").open("ab")
    daemon = subprocess.Popen(_kv("daemon", "--home", str(home)), stdout=daemon_log,
                              stderr=subprocess.STDOUT, env=env)  # fmt: skip
    chat = _chat_turns(turns)
    out: dict = {"model": f"tiny {arch}", "turns": turns}
    try:
        _wait_daemon(home, daemon, root / f"daemon-{arch}.log")
        s = serve()
        try:
            out["first_boot_ready_s"] = s.wait_ready()
            # two requests make each stage's prefix learned; a state layout (qwen3_5) stores
            # it when a later request crosses it (the split), so a third one comes first
            for stage in STAGE_NAMES:
                for user in USERS[:2]:
                    s.chat(_stage_messages(stage, user))
            if arch != "llama":
                time.sleep(1.0)  # the daemon's replies name the boundaries
                for stage in STAGE_NAMES:
                    s.chat(_stage_messages(stage, USERS[2]))
            for msgs in chat[:-1]:
                s.chat(msgs)
            t_last = time.perf_counter()
            learned, waited = _wait_learned(home, arch == "llama")
            out["ack_after_last_request_s"] = round(time.perf_counter() - t_last - 1.0, 3)
            out["learned_before_restart"] = learned
        finally:
            s.stop(signal.SIGKILL)
        s = serve()
        try:
            out["spawn_to_ready_s"] = s.wait_ready()
            stages = {}
            first = True
            for stage in STAGE_NAMES:
                msgs = _stage_messages(stage, USERS[3])
                reply = s.chat(msgs)
                if first:
                    out["spawn_to_first_answer_s"] = time.perf_counter() - s.spawned
                    first = False
                new = ids(msgs)
                sent = USERS[:2] if arch == "llama" else USERS[:3]
                shared = max(_lcp(new, ids(_stage_messages(stage, u))) for u in sent)
                stages[stage] = {
                    "prompt_tokens": reply["usage"]["prompt_tokens"],
                    "shared_tokens": shared,
                    "cached_tokens": _cached(reply),
                    "served_fraction": _cached(reply) / shared,
                    "ttft_s": reply["ttft_s"],
                }
            out["stages"] = stages
            out["stages_total_ttft_s"] = sum(v["ttft_s"] for v in stages.values())
            out["stages_min_served_fraction"] = min(v["served_fraction"] for v in stages.values())
            reply = s.chat(chat[-1])
            prev = len(ids(chat[-2]))
            out["chat_next_turn"] = {
                "turn": turns,
                "prev_prompt_tokens": prev,
                "prompt_tokens": reply["usage"]["prompt_tokens"],
                "cached_tokens": _cached(reply),
                "served_over_prev_prompt": _cached(reply) / prev,
                "ttft_s": reply["ttft_s"],
            }
        finally:
            s.stop()
        # the whole conversation: the last turn, served after the restart, is learned too
        if arch == "llama":
            out["bytes"] = _chat_bytes(home, model, ids(chat[-1]), learned, True)
        else:
            daemon_text = (root / f"daemon-{arch}.log").read_text(errors="replace")
            out["bytes"] = _state_chat_bytes(home, model, ids(chat[-1]), daemon_text)
    finally:
        _stop_daemon(daemon)
        daemon_log.close()
    return out


def _chat_bytes(home: Path, model: Path, final: list[int], learned: dict, records: bool) -> dict:
    """What the chat stored against the KV of its final learned prompt, and bytes written per
    learned token (records: the whole store's; snapshots: their entries)."""
    from kvstore.learned.blockstore import BlockStore, is_snapshot
    from kvstore.store.store import Store

    per_token, fixed = _kv_bytes_per_token(model)
    store = Store(home, readonly=True)
    try:
        if records:
            blocks = BlockStore(store)
            recs = blocks.records()
            fp = recs[0].key[:16]
            chain = blocks.lookup(fp, final)
            stored = sum(m.nbytes for m in chain)
            covered = chain[-1].end if chain else 0
            learned_tokens = sum(m.end - m.start for m in recs)
            written = blocks.written_today()
            kind = "block records"
        else:
            snaps = [m for m in store.metas(errors=[]) if is_snapshot(m)]
            chat = [m for m in snaps if m.token_ids() == final[: m.ntokens]]
            stored = sum(m.nbytes for m in chat)
            covered = max((m.ntokens for m in chat), default=0)
            learned_tokens = sum(m.ntokens for m in snaps)
            written = int(learned.get("written_today") or 0)
            kind = f"snapshot entries ({len(chat)} kept on the chat's chain)"
    finally:
        store.close()
    kv_final = fixed + per_token * covered  # the KV of the prompt the chain stores
    return {
        **_chat_figures(kind, per_token, fixed, final, covered, stored, kv_final, written),
        "learned_tokens": learned_tokens,
        "written_per_learned_token_over_kv": (written / learned_tokens / per_token
                                              if learned_tokens else None),
    }  # fmt: skip


def _chat_figures(kind, per_token, fixed, final, covered, stored, kv_final, written) -> dict:
    """The figures every layout's chat reports: what it stored against its final prompt's KV."""
    return {
        "kind": kind,
        "kv_bytes_per_token": per_token,
        "fixed_state_bytes": fixed,
        "final_prompt_tokens": len(final),
        "chain_covers_tokens": covered,
        "chat_stored_bytes": stored,
        "final_prompt_kv_bytes": kv_final,
        "stored_over_final_kv": stored / kv_final if covered else float("inf"),
        "written_bytes": written,
    }


SNAPSHOT_LINE = re.compile(r"learned snapshot [0-9a-f]+: (\d+) tokens, (\d+) bytes written")


def _state_chat_bytes(home: Path, model: Path, final: list[int], daemon_log: str) -> dict:
    """A state layout (qwen3_5): what the chat stored (its chain's KV records + the snapshots
    kept on it) against the final prompt's KV + max_snapshots_per_prefix states, and what all
    learning wrote (records + snapshots, the daemon's daily counter) against what it added: the
    new tokens' KV + one state per snapshot written (the daemon's log lines count them)."""
    from kvstore.home.settings import DEFAULT
    from kvstore.learned.blockstore import BlockStore, is_snapshot
    from kvstore.store.store import Store

    per_token, fixed = _kv_bytes_per_token(model)
    cap = int(DEFAULT.max_snapshots_per_prefix)
    snaps_written = [(int(t), int(b)) for t, b in SNAPSHOT_LINE.findall(daemon_log)]
    store = Store(home, readonly=True)
    try:
        blocks = BlockStore(store)
        snaps = [m for m in store.metas(errors=[]) if is_snapshot(m)]
        chat = [m for m in snaps if m.token_ids() == final[: m.ntokens]]
        fp = chat[0].fingerprint if chat else b""
        chain = blocks.lookup(fp, final) if chat else []
        record_tokens = sum(m.end - m.start for m in blocks.records())
        covered = max((m.ntokens for m in chat), default=0)
        stored = sum(m.nbytes for m in chain if m.end <= covered) + sum(m.nbytes for m in chat)
        written = blocks.written_today()
        state_only = all(m.extra.kv_layers for m in chat)
    finally:
        store.close()
    kv_final = per_token * covered + cap * fixed
    # whole-cache snapshots keep no records to count the new tokens by: no ratio (the shapes
    # figure gives the old form's cost)
    added = per_token * record_tokens + len(snaps_written) * fixed if state_only else 0
    kind = ("KV records + state-only snapshots" if state_only else "whole-cache snapshots") + (
        f" ({len(chat)} kept on the chat's chain)"
    )
    return {
        **_chat_figures(kind, per_token, fixed, final, covered, stored, kv_final, written),
        "snapshots_written": len(snaps_written),
        "snapshot_bytes_written": sum(b for _, b in snaps_written),
        "written_over_added": written / added if added else None,
    }


TURN_TOKENS = 256  # new tokens a chat turn adds in the shapes figure (one block)
SHAPE_PROMPTS = (1024, 4096, 16384)


def hybrid_shapes(prompts: tuple[int, ...] = SHAPE_PROMPTS, turn: int = TURN_TOKENS) -> dict:
    """Bytes one learned chat turn writes at Qwen3.5-9B's shapes (bench.shapes.HYBRID_9B: random
    arrays, no model), encoded as the store would: before, a whole-cache snapshot at the turn's
    end; after, the turn's new tokens as KV block records + a state-only snapshot. And the turns
    per day the default daily write budget (learn_write_bytes_per_day) then covers."""
    from bench.shapes import HYBRID_9B, make_cache
    from kvstore.codec import codec
    from kvstore.home.settings import DEFAULT
    from kvstore.learned.chain import cuts
    from kvstore.learned.records import kv_layers, slice_record, state_part

    budget = int(DEFAULT.learn_write_bytes_per_day)
    out: dict = {"shape": HYBRID_9B.name, "turn_tokens": turn, "write_budget": budget, "rows": []}
    for n in prompts:
        cache = make_cache(HYBRID_9B, n)
        layers = kv_layers(cache)
        before = len(codec.encode(cache))
        records = sum(len(slice_record(cache, s, e, layers=layers))
                      for s, e in cuts(n - turn, n))  # fmt: skip
        state = len(codec.encode(state_part(cache, layers)))
        after = records + state
        added = turn * HYBRID_9B.bytes_per_token + HYBRID_9B.fixed_bytes
        out["rows"].append({
            "prompt_tokens": n, "before_bytes": before, "after_bytes": after,
            "after_over_added": after / added, "turns_per_day_before": budget // before,
            "turns_per_day_after": budget // after,
        })  # fmt: skip
        del cache
    return out


def restore(root: Path, prefix: int, reps: int) -> dict:
    """Tiny llama, a `prefix`-token prefix stored as block records: restore vs memory vs prefill."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.server import LRUPromptCache
    from mlx_lm.utils import load

    from kvstore.client.learn import Learner
    from kvstore.client.persistent import PinnedPromptCache
    from kvstore.learned.blockstore import BlockStore
    from kvstore.learned.chain import cuts
    from kvstore.learned.coldtier import LearnTarget
    from kvstore.learned.records import slice_record
    from kvstore.store.store import Store
    from kvstore.tiny import make_tiny_model

    path = make_tiny_model(root / "model-restore", "llama").resolve()
    model, _ = load(str(path))
    home = root / "home-restore"
    fp = b"\x01" * 16
    tokens = [(i * 7919) % 250 + 3 for i in range(prefix)]
    turn = [(i * 31) % 250 + 3 for i in range(32)]  # a new user turn after the prefix
    request = tokens + turn

    def prefill(cache: list, ids: list[int]) -> None:
        x = mx.array(ids)
        for i in range(0, len(ids), 2048):
            model(x[i : i + 2048][None], cache=cache)
            mx.eval([c.state for c in cache])

    def first_token(cache: list, rest: list[int]) -> None:
        logits = None
        x = mx.array(rest)
        for i in range(0, len(rest), 2048):
            logits = model(x[i : i + 2048][None], cache=cache)
        mx.eval(mx.argmax(logits[0, -1]))

    full = make_prompt_cache(model)
    prefill(full, tokens)
    store = Store(home)
    try:
        blobs = [(s, e, slice_record(full, s, e)) for s, e in cuts(0, prefix)]
        BlockStore(store).put_records(fp, tokens, blobs, label="bench")
    finally:
        store.close()

    target = LearnTarget(fingerprint=fp, model=str(path), model_obj=model, extra={})
    learner = Learner(home, learn=False)
    key = "tiny-llama"  # the LRU's model key (serve's is model_provider.model_key)
    learner.add_target(key, target)
    mem = LRUPromptCache(max_size=4)
    mem.insert_cache(key, tokens, full)
    cold: dict = {}

    def fresh_cold() -> None:
        cold["lru"] = PinnedPromptCache(max_size=4)
        cold["lru"].learner = learner

    def from_store() -> None:
        cache, rest = cold["lru"].fetch_nearest_cache(key, request)
        assert len(rest) == len(turn), len(rest)  # served by the store, not prefilled
        cold["got"] = cache

    def from_memory() -> None:
        cache, rest = mem.fetch_nearest_cache(key, request)
        assert len(rest) == len(turn)

    def ttft_store() -> None:
        cache, rest = cold["lru"].fetch_nearest_cache(key, request)
        first_token(cache, rest)

    def ttft_memory() -> None:
        cache, rest = mem.fetch_nearest_cache(key, request)
        first_token(cache, rest)

    def ttft_prefill() -> None:
        first_token(make_prompt_cache(model), request)

    try:
        copy_stats = interleave(
            {"restore from the store": from_store, "LRUPromptCache in-memory copy": from_memory},
            reps=reps,
            before=lambda name: fresh_cold() if "store" in name else None,
        )
        got = cold["got"]
        exact = all(
            mx.array_equal(a.keys[..., :prefix, :], b.keys[..., :prefix, :]).item()
            for a, b in zip(got, full, strict=True)
        )
        ttft = interleave(
            {"store": ttft_store, "memory": ttft_memory, "prefill": ttft_prefill},
            reps=reps,
            before=lambda name: fresh_cold() if name == "store" else None,
        )
    finally:
        learner.close(1.0)
    r, m = (
        copy_stats["restore from the store"].median,
        copy_stats["LRUPromptCache in-memory copy"].median,
    )
    kv = sum(c.keys[..., :prefix, :].nbytes + c.values[..., :prefix, :].nbytes for c in full)
    return {
        "model": "tiny llama",
        "prefix_tokens": prefix,
        "turn_tokens": len(turn),
        "kv_bytes": kv,
        "restored_exact": bool(exact),
        "restore_s": r,
        "memory_copy_s": m,
        "restore_over_memory_copy": r / m,
        "ttft_store_s": ttft["store"].median,
        "ttft_memory_s": ttft["memory"].median,
        "ttft_prefill_s": ttft["prefill"].median,
        "ttft_store_over_memory": ttft["store"].median / ttft["memory"].median,
        "prefill_over_restore": ttft["prefill"].median / r,
        "prefill_ttft_over_store_ttft": ttft["prefill"].median / ttft["store"].median,
        "stats": {**{k: v.to_json() for k, v in copy_stats.items()},
                  **{f"ttft {k}": v.to_json() for k, v in ttft.items()}},
    }  # fmt: skip


def report(root: Path, ntokens: int, reps: int) -> dict:
    """The request path's cost of reporting a prompt (Learner.fetched + Learner.inserted) on a
    tiny llama cache of `ntokens`, and, for context, the daemon's chain hashing (off the path)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from kvstore.client.learn import Learner
    from kvstore.learned.chain import chain_hashes
    from kvstore.learned.coldtier import LearnTarget
    from kvstore.store.entry import pack_tokens
    from kvstore.tiny import make_tiny_model

    path = make_tiny_model(root / "model-report", "llama").resolve()
    model, _ = load(str(path))
    cache = make_prompt_cache(model)
    for c in cache:  # an 8k-token cache without running the model: contents do not matter here
        n_kv, hd = model.args.num_key_value_heads, model.args.head_dim
        z = mx.zeros((1, n_kv, ntokens, hd))
        c.update_and_fetch(z, z)
    mx.eval([c.state for c in cache])
    prompt = [(i * 13) % 250 + 3 for i in range(ntokens)]
    learner = Learner(root / "home-report")  # no daemon: the worker drops the jobs, off the path
    learner.add_target(
        "tiny-llama", LearnTarget(b"\x02" * 16, str(path), model, {}, sliceable=True)
    )

    def reported() -> None:
        learner.fetched("tiny-llama", prompt)
        learner.inserted("tiny-llama", prompt + [5, 6], cache)

    fp = b"\x02" * 16
    data = pack_tokens(prompt)
    try:
        st = interleave(
            {"report": reported, "chain": lambda: chain_hashes(fp, data)},
            reps=reps,
            before=lambda _: learner.writer.flush(5.0),  # an empty queue, as with a daemon
        )
    finally:
        learner.close(1.0)
    return {
        "model": "tiny llama",
        "tokens": ntokens,
        "request_path_ms": st["report"].median * 1e3,
        "daemon_chain_hash_ms": st["chain"].median * 1e3,
        "stats": {k: v.to_json() for k, v in st.items()},
    }


def run(quick: bool, *, turns: int | None = None, prefix: int | None = None) -> dict:
    """All figures; `turns` and `prefix` override the sizes (the smoke test's smallest)."""
    turns = turns or 20
    res: dict = {}
    root = Path(tempfile.mkdtemp(prefix="kvbench-learned-"))
    # the in-process learners have no daemon: their jobs say so, off the measured path
    quiet = logging.getLogger("kvstore.client")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        archs = ("llama", "qwen3_5")
        res["restart"] = {a: restart(a, root, turns) for a in archs}
        res["hybrid_shapes"] = hybrid_shapes(SHAPE_PROMPTS if prefix is None else (1024,))
        res["restore"] = restore(root, prefix or (800 if quick else 4096), 5 if quick else 15)
        res["report"] = report(root, 8192 if prefix is None else 1024, 20 if quick else 100)
    finally:
        quiet.setLevel(level)
        shutil.rmtree(root, ignore_errors=True)
    _print(res)
    return res


def _print(res: dict) -> None:
    for r in res["restart"].values():
        print(f"  restart ({r['model']}): stages served {r['stages_min_served_fraction']:.3f} of "
              f"their shared prefix, total TTFT {r['stages_total_ttft_s'] * 1e3:.0f} ms; chat turn "
              f"{r['turns']} served {r['chat_next_turn']['served_over_prev_prompt']:.3f} of turn "
              f"{r['turns'] - 1}'s prompt; stored {r['bytes']['stored_over_final_kv']:.3f}x the "
              f"final prompt's KV")  # fmt: skip
    h = res["hybrid_shapes"]
    print(
        f"  one learned chat turn ({h['turn_tokens']} new tokens) at {h['shape']} shapes, "
        f"bytes written (turns/day in {h['write_budget'] / 2**30:.0f} GiB) before -> after:"
    )
    for row in h["rows"]:
        print(f"    {row['prompt_tokens']:>6} tokens: {row['before_bytes'] / 1e6:.0f} MB "
              f"({row['turns_per_day_before']}) -> {row['after_bytes'] / 1e6:.1f} MB "
              f"({row['turns_per_day_after']}), {row['after_over_added']:.3f}x its new KV + one "
              f"state")  # fmt: skip
    r = res["restore"]
    ms = {k: r[k] * 1e3 for k in ("restore_s", "memory_copy_s", "ttft_store_s", "ttft_memory_s",
                                  "ttft_prefill_s")}  # fmt: skip
    print(f"  restore {r['prefix_tokens']} tokens: {ms['restore_s']:.2f} ms vs in-memory copy "
          f"{ms['memory_copy_s']:.3f} ms; TTFT store {ms['ttft_store_s']:.1f} / memory "
          f"{ms['ttft_memory_s']:.1f} / prefill {ms['ttft_prefill_s']:.1f} ms")  # fmt: skip
    print(f"  report {res['report']['tokens']} tokens: {res['report']['request_path_ms']:.3f} ms")


if __name__ == "__main__":
    print(json.dumps(run(quick="--full" not in sys.argv), indent=1, default=str))
