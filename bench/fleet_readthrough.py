"""Fleet read-through on a request's miss (issue 32): N boxes behind a round-robin balancer
replay C chats that share one system prompt; each chat's next turn lands on the next box, so
it continues a transcript another box served. With read-through the box asks the fleet for the
transcript before prefilling; without it, it prefills what its own memory lacks.

Each box is a home with its own prompt cache and learner (the library's path, in this one
process), over one real SeaweedFS server (`weed mini`). No daemons: what a box served is learned
at once (its records cut and uploaded, as a daemon's learn + write-behind upload do after a
request recurs), off the clock. Reported per mode: fleet-wide prefilled tokens, bytes fetched,
bucket requests per served request, mean and p50 time to first token (fetch + prefill of the
rest), and this machine's prefill rate (the regime the cost rule compares against).

    python -m bench.fleet_readthrough            # 3 boxes, 6 chats x 3 turns, tiny llama
    python -m bench.fleet_readthrough --quick    # 2 boxes, 3 chats x 2 turns
"""

from __future__ import annotations

import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

SYSTEM_TOKENS = 600
TURN_TOKENS = 300
THROTTLE_BPS = 100_000.0  # bytes a second towards the box: slower than this VM prefills
THROTTLE_DELAY_S = 0.02  # added to each request's way to the server


class Throttle:
    """A TCP proxy in front of the S3 port that moves at most `bps` bytes a second towards the
    client and waits `delay` seconds before each chunk it forwards to the server: a slow LAN."""

    def __init__(self, target_port: int, *, bps: float, delay: float = 0.0):
        import socket
        import threading

        self.target, self.bps, self.delay = target_port, bps, delay
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(client, server, 0, self.delay),
                             daemon=True).start()  # fmt: skip
            threading.Thread(target=self._pump, args=(server, client, self.bps, 0),
                             daemon=True).start()  # fmt: skip

    @staticmethod
    def _pump(src, dst, bps: float, delay: float) -> None:
        try:
            while chunk := src.recv(16384):
                if delay:
                    time.sleep(delay)
                dst.sendall(chunk)
                if bps:
                    time.sleep(len(chunk) / bps)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def _home(home: Path, server, key: str) -> Path:
    from bench.weed import ACCESS_KEY, BUCKET, SECRET_KEY

    home.mkdir(parents=True, mode=0o700)
    creds = home / "s3.toml"
    creds.write_text(f'access_key_id = "{ACCESS_KEY}"\nsecret_access_key = "{SECRET_KEY}"\n'
                     f'fleet_key = "{key}"\n')  # fmt: skip
    creds.chmod(0o600)
    (home / "settings.toml").write_text(
        f'[remote]\nendpoint = "{server.endpoint}"\nbucket = "{BUCKET}"\nprefix = "rt"\n'
        f'credentials = "{creds}"\n'
    )
    return home


def _tokens(n: int, seed: int) -> list[int]:
    return [(7919 * seed + 31 * i) % 400 + 3 for i in range(n)]


def _learn(home: Path, fp: bytes, model_path: Path, prompt: list[int], cache: list) -> None:
    """What the box's daemon would do: store the prompt's records and upload them."""
    from kvstore.fleet.learned import push_records
    from kvstore.fleet.objects import Remote
    from kvstore.fleet.remote_settings import remote_settings
    from kvstore.home.settings import load_settings
    from kvstore.learned.blockstore import BlockStore
    from kvstore.learned.chain import cuts
    from kvstore.learned.records import slice_record
    from kvstore.store.store import Store

    rows = [(s, e, slice_record(cache, s, e)) for s, e in cuts(0, len(prompt))]
    with Store(home) as store:
        BlockStore(store).put_records(fp, prompt, rows, label="learned",
                                      extra={"model": str(model_path)})  # fmt: skip
        push_records(Remote(remote_settings(load_settings(home), home)), store, say=lambda s: None)


def _sample(name: str) -> float:
    from kvstore import metrics

    return metrics.REGISTRY.get_sample_value(name, {}) or 0.0


OUTCOMES = ("fetched", "miss", "slower", "abandoned", "refused", "error")


def _outcome(name: str) -> float:
    from kvstore import metrics

    return metrics.REGISTRY.get_sample_value("kvstore_fleet_reads_total", {"outcome": name}) or 0


def run(*, boxes: int, chats: int, turns: int, read_through: bool, root: Path, server,
        model, model_path: Path, key: str, via=None) -> dict:  # fmt: skip
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kvstore.client.learn import Learner, LearnTarget
    from kvstore.client.persistent import PinnedPromptCache

    fp = secrets.token_bytes(16)  # a fresh model identity per mode: nothing shared between them
    homes = [_home(root / f"box{i}", via or server, key) for i in range(boxes)]
    learned = root / "learned"  # the boxes' learning, one store (what their daemons keep)
    _home(learned, server, key)
    lrus, learners = [], []
    for h in homes:
        lru, learner = PinnedPromptCache(max_size=64), Learner(h, learn=False)
        learner.add_target("m", LearnTarget(fingerprint=fp, model=str(model_path),
                                            model_obj=model, extra={}))  # fmt: skip
        learner.fleet.on = read_through
        lru.learner = learner
        lrus.append(lru)
        learners.append(learner)
    system = _tokens(SYSTEM_TOKENS, 1)
    transcripts = {c: list(system) for c in range(chats)}
    trips0, bytes0 = (
        _sample("kvstore_fleet_round_trips_total"),
        _sample("kvstore_fleet_fetch_bytes_total"),
    )
    outcomes0 = {o: _outcome(o) for o in OUTCOMES}
    prefilled, ttft, requests = 0, [], 0
    for t in range(turns):
        for c in range(chats):
            b = (c + t) % boxes  # round robin: a chat's next turn lands on the next box
            prompt = transcripts[c] + _tokens(TURN_TOKENS, 100 * c + t + 2)
            t0 = time.perf_counter()
            cache, rest = lrus[b].fetch_nearest_cache("m", prompt)
            cache = cache if cache is not None else make_prompt_cache(model)
            logits = model(mx.array(rest)[None], cache=cache)
            mx.eval(logits)
            ttft.append(time.perf_counter() - t0)
            prefilled += len(rest)
            requests += 1
            lrus[b].insert_cache("m", prompt, cache)
            _learn(learned, fp, model_path, prompt, cache)
            transcripts[c] = prompt
    for learner in learners:
        learner.close(timeout=5.0)
    return {
        "read_through": read_through,
        "requests": requests,
        "prefilled_tokens": prefilled,
        "fetched_bytes": int(_sample("kvstore_fleet_fetch_bytes_total") - bytes0),
        "bucket_requests_per_request": (_sample("kvstore_fleet_round_trips_total") - trips0)
        / requests,
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p50_s": statistics.median(ttft),
        "reads": {o: int(_outcome(o) - outcomes0[o]) for o in OUTCOMES},
    }


def prefill_rate(model, n: int = 1024) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    t = time.perf_counter()
    mx.eval(model(mx.array(_tokens(n, 9))[None], cache=cache))
    return n / (time.perf_counter() - t)


def main() -> int:
    from mlx_lm import load

    from bench.weed import Weed
    from kvstore.tiny import make_tiny_model

    quick = "--quick" in sys.argv
    boxes, chats, turns = (2, 3, 2) if quick else (3, 6, 3)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        server = Weed(root / "weed").start()
        try:
            path = make_tiny_model(root / "model", "llama")
            model, _ = load(str(path))
            key = secrets.token_hex(32)
            out = {"boxes": boxes, "chats": chats, "turns": turns,
                   "prefill_tokens_per_s": prefill_rate(model)}  # fmt: skip
            for rt in (False, True):
                out["on" if rt else "off"] = run(
                    boxes=boxes, chats=chats, turns=turns, read_through=rt,
                    root=root / ("on" if rt else "off"), server=server, model=model,
                    model_path=path, key=key,
                )  # fmt: skip
            # a slow link (THROTTLE_BPS, THROTTLE_DELAY_S a request): the cost rule declines
            slow = Throttle(server.ports["s3"], bps=THROTTLE_BPS, delay=THROTTLE_DELAY_S)
            try:
                out["on_throttled"] = run(
                    boxes=boxes, chats=chats, turns=turns, read_through=True,
                    root=root / "slow", server=server, model=model, model_path=path, key=key,
                    via=slow,
                )  # fmt: skip
            finally:
                slow.close()
        finally:
            server.stop()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
