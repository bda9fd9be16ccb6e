"""Fleet read-through on a request's miss (issue 32), measured on real processes: N boxes, each a
home with its own `kvstore daemon` and its own `kvstore serve` (mlx-lm's OpenAI-compatible
server underneath), over one real SeaweedFS server (`weed mini`) behind a counting proxy. A
round-robin balancer replays C chats that share system prompts over HTTP (streaming: time to
first token is the first content chunk), each chat's next turn on the next box, so a turn
continues a transcript another box served. Assistant replies are fixed text, so every prompt
extends the chat's previous one whatever the random tiny model answers.

Between rounds (every chat's next turn) the balancer waits until the fleet is quiet (the daemons'
learning and write-behind uploads done: a user's think time). A box learns a prefix that recurs
on it (the shared system prompt after two chats; a chat's turn when its own earlier turn came
back to it) and uploads it; with read-through on, another box's miss asks the bucket first.

Modes: read-through off (`[remote] download = false`), on, and on through a throttled link (the
proxy moves THROTTLE_BPS bytes a second towards the boxes and waits THROTTLE_DELAY_S before
each request: slower than this machine prefills, so a fetch loses: abandoned at its deadline, the
expected prefill, or declined once the link is measured). Each mode is a fleet of its own (its
boxes, proxy and bucket prefix), all running at once; their rounds are interleaved, the order
rotated each round, so a shared machine's load falls on every mode alike (requests are sent one
at a time). Per mode, summed over the fleet: prefilled tokens (each reply's usage: prompt tokens
less `prompt_tokens_details.cached_tokens`), tokens served by source (each serve's `/metrics`
`kvstore_prompt_tokens_total`), bytes fetched and read-through asks (its `kvstore_fleet_*`
counters), every bucket request (the proxy's count: uploads included) per served request, and
mean / median time to first token; first, this machine's prefill rate (the regime the cost rule
compares against).

    python -m bench.fleet_readthrough              # 3 boxes, 6 chats x 5 turns, 2 system prompts
    python -m bench.fleet_readthrough --quick      # 2 boxes, 2 chats x 4 turns, 1 system prompt
    python -m bench.fleet_readthrough --out DIR    # also DIR/fleet-readthrough.{json,txt}
    python -m bench.fleet_readthrough --modes on,throttled --keep DIR   # some modes; logs kept
"""

from __future__ import annotations

import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.learned import Server, _daemon_stats, _kv, free_port, running_daemon

FULL = dict(boxes=3, chats=6, turns=5, block=256, system=600, turn=300, systems=2)
QUICK = dict(boxes=2, chats=2, turns=4, block=256, system=600, turn=300, systems=1)
REPLY_TOKENS = 40  # each turn's fixed assistant reply
MAX_TOKENS = 2  # generated per request: the first token is what is timed
THROTTLE_BPS = 100_000.0  # bytes a second towards the box: slower than this VM prefills
THROTTLE_DELAY_S = 0.02  # added to each request's way to the server
QUIET_S = 1.5  # the fleet is settled when nothing changed for this long
SETTLE_TIMEOUT = 90.0
MODES = {"off": (False, 0.0, 0.0), "on": (True, 0.0, 0.0),
         "throttled": (True, THROTTLE_BPS, THROTTLE_DELAY_S)}  # fmt: skip
LABELS = {"off": "read-through off", "on": "read-through on", "throttled": "on, throttled link"}
WORDS = (
    "invoice order parcel account password export team wiki page guide shipping refund plan "
    "support ticket customer data report billing update login region quota backup"
).split()


def _text(tok, target: int, seed: int) -> str:
    """Words (a fixed random choice) whose tokens are about `target`."""
    rng = random.Random(seed)
    words: list[str] = []
    while len(tok.encode(" ".join(words))) < target:
        words += [rng.choice(WORDS) for _ in range(8)]
    return " ".join(words)


@dataclass
class Script:
    """What the balancer sends: every chat's system prompt, user turns and fixed replies."""

    systems: list[str]
    users: dict[int, list[str]]
    replies: dict[int, list[str]]

    def messages(self, chat: int, turn: int) -> list[dict]:
        msgs = [{"role": "system", "content": self.systems[chat % len(self.systems)]}]
        for t in range(turn + 1):
            if t:
                msgs.append({"role": "assistant", "content": self.replies[chat][t - 1]})
            msgs.append({"role": "user", "content": self.users[chat][t]})
        return msgs


def script(tok, cfg: dict) -> Script:
    chats, turns = range(cfg["chats"]), range(cfg["turns"])
    return Script(
        systems=[_text(tok, cfg["system"], 1 + s) for s in range(cfg["systems"])],
        users={c: [_text(tok, cfg["turn"], 100 * c + t + 10) for t in turns] for c in chats},
        replies={c: [_text(tok, REPLY_TOKENS, 100 * c + t + 60) for t in turns] for c in chats},
    )


def _home(home: Path, endpoint: str, key: str, *, block: int, download: bool, prefix: str) -> Path:
    from bench.weed import ACCESS_KEY, BUCKET, SECRET_KEY

    home.mkdir(parents=True, mode=0o700)
    creds = home / "s3.toml"
    creds.write_text(f'access_key_id = "{ACCESS_KEY}"\nsecret_access_key = "{SECRET_KEY}"\n'
                     f'fleet_key = "{key}"\n')  # fmt: skip
    creds.chmod(0o600)
    (home / "settings.toml").write_text(
        f"block_tokens = {block}\n[remote]\n"
        f'endpoint = "{endpoint}"\nbucket = "{BUCKET}"\nprefix = "{prefix}"\n'
        f'credentials = "{creds}"\ndownload = {str(download).lower()}\nretry_interval = 1.0\n'
    )
    return home


@contextmanager
def fleet(homes: list[Path], model: Path, logs: Path):
    """Each home's daemon (started first, answering), then each home's `kvstore serve`, spawned
    together and ready (`/v1/models` answers); all stopped at the end."""
    hub = logs / "hf-hub"  # mlx-lm's /v1/models lists the hub cache: an empty one of its own
    hub.mkdir(exist_ok=True)
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", HF_HUB_CACHE=str(hub)
    )
    with ExitStack() as stack:
        for i, h in enumerate(homes):
            stack.enter_context(running_daemon(h, logs / f"daemon{i}.log", env))
        servers = []
        for i, h in enumerate(homes):
            port = free_port()
            argv = _kv("serve", "--home", str(h), "--model", str(model), "--port", str(port))
            s = Server(argv, port, logs / f"serve{i}.log", env)
            stack.callback(s.stop)
            servers.append(s)
        for s in servers:
            s.wait_ready("/v1/models")
        yield servers


def stream_chat(server: Server, messages: list[dict]) -> dict:
    """One streamed completion: seconds to its first content chunk, and its usage."""
    body = dict(messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
                stream_options={"include_usage": True})  # fmt: skip
    req = urllib.request.Request(
        f"http://127.0.0.1:{server.port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t, ttft, usage = time.perf_counter(), None, {}
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - t
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - t,
            "prompt_tokens": int(usage.get("prompt_tokens", 0)),
            "cached_tokens": int(details.get("cached_tokens") or 0)}  # fmt: skip


def _queued(home: Path) -> int:
    from kvstore.fleet.queue import UploadQueue

    q = UploadQueue(home)
    try:
        c = q.counts()
    finally:
        q.close()
    return c["queued"] + c["records_queued"]


def settle(homes: list[Path], proxy) -> float:
    """Wait until the daemons' learning and uploads are done (nothing queued, and neither their
    learned records nor the bucket's request count changed for QUIET_S); seconds waited."""
    t0 = time.monotonic()
    last, since = None, t0
    while time.monotonic() - t0 < SETTLE_TIMEOUT:
        learned = [(_daemon_stats(h).get("learned") or {}).get("records") for h in homes]
        state = (learned, proxy.requests, sum(_queued(h) for h in homes))
        if state != last:
            last, since = state, time.monotonic()
        elif not state[2] and time.monotonic() - since >= QUIET_S:
            break
        time.sleep(0.2)
    return time.monotonic() - t0


def _metrics(server: Server) -> dict[str, float]:
    """The samples of a serve's `/metrics` this benchmark reads (name with labels -> value)."""
    _, body = server._get("/metrics")
    out = {}
    for line in body.decode().splitlines():
        if line.startswith(("kvstore_prompt_tokens_total", "kvstore_fleet_")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@dataclass
class Mode:
    """One mode's fleet: its boxes' homes and servers, its proxy, its rows so far."""

    name: str
    homes: list[Path]
    servers: list[Server]
    proxy: Any
    before: int = 0  # the proxy's count when the replay began
    rows: list = field(default_factory=list)

    def round(self, plan: Script, cfg: dict, t: int) -> None:
        """Every chat's turn t on box (chat + t) mod N; then the fleet settles."""
        for c in range(cfg["chats"]):
            b = (c + t) % len(self.servers)
            reply = stream_chat(self.servers[b], plan.messages(c, t))
            self.rows.append(dict(reply, box=b, chat=c, turn=t))
        settle(self.homes, self.proxy)

    def figures(self) -> dict:
        metrics = [_metrics(s) for s in self.servers]
        return figures(self.rows, metrics, self.proxy.requests - self.before,
                       self.proxy.snapshot())  # fmt: skip


@contextmanager
def mode_fleet(name: str, root: Path, *, weed, model: Path, cfg: dict, key: str):
    """`name`'s boxes, running and settled, behind a proxy of their own, on a bucket prefix of
    their own (nothing learned is shared between modes)."""
    from bench.s3proxy import S3Proxy

    read_through, bps, delay = MODES[name]
    proxy = S3Proxy(weed.ports["s3"], bps=bps, delay=delay)
    prefix = "rt-" + secrets.token_hex(4)
    homes = [_home(root / f"box{i}", proxy.endpoint, key, block=cfg["block"],
                   download=read_through, prefix=prefix) for i in range(cfg["boxes"])]  # fmt: skip
    try:
        with fleet(homes, model, root) as servers:
            yield Mode(name, homes, servers, proxy)
    finally:
        proxy.close()


def replay(modes: list[Mode], plan: Script, cfg: dict) -> None:
    """Round by round, the modes interleaved (their order rotated each round), so a shared
    machine's load drifts over all of them alike."""
    for m in modes:
        settle(m.homes, m.proxy)  # whatever the boxes asked the bucket at their start
        m.before = m.proxy.requests
    for t in range(cfg["turns"]):
        for m in modes[t % len(modes) :] + modes[: t % len(modes)]:
            m.round(plan, cfg, t)


def _sum(metrics: list[dict], name: str) -> float:
    return sum(m.get(name, 0.0) for m in metrics)


def figures(rows: list[dict], metrics: list[dict], bucket_requests: int, proxied: dict) -> dict:
    n = len(rows)
    ttft = [r["ttft_s"] for r in rows]
    sources = ("memory", "store", "fleet", "prefill")
    outcomes = ("fetched", "miss", "slower", "abandoned", "refused", "error")
    return {
        "requests": n,
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "prefilled_tokens": sum(r["prompt_tokens"] - r["cached_tokens"] for r in rows),
        "tokens_by_source": {
            s: int(_sum(metrics, f'kvstore_prompt_tokens_total{{source="{s}"}}')) for s in sources
        },
        "fetched_bytes": int(_sum(metrics, "kvstore_fleet_fetch_bytes_total")),
        "read_through_requests_per_request": _sum(metrics, "kvstore_fleet_round_trips_total") / n,
        "bucket_requests_per_request": bucket_requests / n,
        "bucket": proxied,
        "reads": {
            o: int(_sum(metrics, f'kvstore_fleet_reads_total{{outcome="{o}"}}')) for o in outcomes
        },  # fmt: skip
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p50_s": statistics.median(ttft),
        "per_request": rows,
    }


def prefill_rate(model_path: Path, n: int = 1024) -> float:
    """This machine's prefill rate of the model, tokens a second (in this process, alone)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(model_path))
    ids = mx.array([[(31 * i) % 400 + 3 for i in range(n)]])
    mx.eval(model(ids[:, :64], cache=make_prompt_cache(model)))  # the first kernels
    cache = make_prompt_cache(model)
    t = time.perf_counter()
    mx.eval(model(ids, cache=cache))
    return n / (time.perf_counter() - t)


def run(quick: bool, modes: tuple[str, ...] = tuple(MODES), keep: Path | None = None) -> dict:
    from mlx_lm.utils import load_tokenizer

    from bench.weed import Weed
    from kvstore.tiny import make_tiny_model

    cfg = dict(QUICK if quick else FULL)
    with tempfile.TemporaryDirectory() as tmp:
        root = keep or Path(tmp)  # keep: the homes and logs stay there
        model = make_tiny_model(root / "model", "llama").resolve()
        plan = script(load_tokenizer(model), cfg)
        out: dict = {"config": cfg, "prefill_tokens_per_s": prefill_rate(model)}
        weed = Weed(root / "weed").start()
        try:
            key = secrets.token_hex(32)
            with ExitStack() as stack:
                fleets = [stack.enter_context(mode_fleet(name, root / f"mode{i}", weed=weed,
                                                         model=model, cfg=cfg, key=key))
                          for i, name in enumerate(modes)]  # fmt: skip
                replay(fleets, plan, cfg)
                out.update((m.name, m.figures()) for m in fleets)
        finally:
            weed.stop()
    return out


def table(res: dict) -> str:
    cfg = res["config"]
    lines = [
        f"regime: this machine prefills the tiny llama at {res['prefill_tokens_per_s']:.0f} "
        f"tokens/s; {cfg['boxes']} boxes (each its daemon and kvstore serve), {cfg['chats']} chats"
        f" x {cfg['turns']} turns, {cfg['systems']} shared system prompt(s) of ~{cfg['system']}"
        f" tokens, turns of ~{cfg['turn']}, blocks of {cfg['block']}; throttled: "
        f"{THROTTLE_BPS / 1000:.0f} kB/s, {THROTTLE_DELAY_S * 1000:.0f} ms a request",
        "| mode | prefilled tokens | served: memory / store / fleet | bytes fetched "
        "| bucket requests per request: all / read-through "
        "| asks: fetched / miss / slower / abandoned "
        "| TTFT mean / p50 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in MODES:
        if name not in res:
            continue
        m, s, r = res[name], res[name]["tokens_by_source"], res[name]["reads"]
        lines.append(
            f"| {LABELS[name]} | {m['prefilled_tokens']:,} of {m['prompt_tokens']:,} "
            f"| {s['memory']:,} / {s['store']:,} / {s['fleet']:,} "
            f"| {m['fetched_bytes'] / 1e6:.1f} MB "
            f"| {m['bucket_requests_per_request']:.1f} / "
            f"{m['read_through_requests_per_request']:.1f} "
            f"| {r['fetched']} / {r['miss']} / {r['slower']} / {r['abandoned']} "
            f"| {m['ttft_mean_s']:.2f} / {m['ttft_p50_s']:.2f} s |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    modes = tuple(argv[argv.index("--modes") + 1].split(",")) if "--modes" in argv else MODES
    keep = Path(argv[argv.index("--keep") + 1]) if "--keep" in argv else None
    res = run("--quick" in argv, tuple(modes), keep)
    text = table(res)
    print(text)
    if "--out" in argv:
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "fleet-readthrough.json").write_text(json.dumps(res, indent=1) + "\n")
        (out / "fleet-readthrough.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
