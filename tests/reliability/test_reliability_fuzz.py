"""Fuzzing (hypothesis, derandomized): malformed frames and mutated requests against a real daemon
socket; malformed safetensors blobs against codec.decode; corrupted values inside LMDB. Nothing
crashes, every bad input is rejected before mlx reads a byte of it, and the daemon serves on.

The same blobs are then given to `mx.load` (and mlx-lm's `load_prompt_cache`) in a child
process, to count what the validation spares the app: crashes, hangs, and garbage that loads.
"""

from __future__ import annotations

import json
import resource
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import battery
import msgpack
import pytest
from helpers import Proc
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvstore.codec import codec, materialize
from kvstore.errors import CodecError, CorruptEntryError, ProtocolError
from kvstore.store.entry import blob_checksum
from kvstore.store.store import Store
from kvstore.wire import daemon_client, protocol

FUZZ = settings(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
FRAMES = battery.scale(2000, 10000)
BLOBS = battery.scale(2000, 10000)
STORED = battery.scale(300, 2000)
COUNTS: dict[str, dict[str, int]] = {}


def _count(part: str, outcome: str) -> None:
    COUNTS.setdefault(part, {}).setdefault(outcome, 0)
    COUNTS[part][outcome] += 1


# -- frames against a real daemon -------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzzd")
    home = root / "home"
    home.mkdir(mode=0o700)
    (home / "settings.toml").write_text("header_timeout = 0.5\nidle_timeout = 1.0\n")
    d = Proc(home, log=root / "daemon.log")
    d.wait_ready()
    yield d
    rc, _ = d.stop()
    assert rc == 0, d.text()[-3000:]


REQUESTS = [
    {"cmd": "ping"},
    {"cmd": "ls", "args": {"model": "m", "label": "x"}},
    {"cmd": "stats", "args": {}},
    {"cmd": "touch", "args": {"keys": [b"k" * 32]}},
    {"cmd": "evict", "args": {"keys": [b"k" * 32]}},
    {"cmd": "record", "args": {"records": [{"model": "m", "label": "l", "prompt_tokens": 1}]}},
    {
        "cmd": "put",
        "args": {
            "key": b"k" * 32,
            "fields": {"tokens": b"\0" * 8},
            "nbytes": 16,
            "checksum": 1,
            "blob": b"\0" * 16,
        },
    },  # fmt: skip
    {
        "cmd": "put",
        "args": {"key": b"k" * 32, "fields": {"tokens": b"\0" * 8}, "nbytes": 9, "checksum": 1},
    },  # fmt: skip  (a streamed put that never streams)
]
_mutation = st.tuples(st.integers(0, 10_000), st.integers(0, 255))
_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
)
_values = st.recursive(
    _leaves | st.binary(max_size=40),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=12,
)
frames = st.one_of(
    # a header whose length lies about the body that follows (0, huge, 2^32-1, truncated)
    st.builds(
        lambda n, body: protocol.HEADER.pack(n) + body,
        st.sampled_from([0, 1, 7, 2**31, 2**32 - 1, 64 * 2**20, 64 * 2**20 + 1])
        | st.integers(0, 2**32 - 1),
        st.binary(max_size=64),
    ),
    st.binary(max_size=300),  # raw bytes, header and all
    # a valid request's msgpack with bytes overwritten, deleted or appended
    st.builds(
        lambda req, muts, cut: _mutate(msgpack.packb(req, use_bin_type=True), muts, cut),
        st.sampled_from(REQUESTS),
        st.lists(_mutation, min_size=1, max_size=4),
        st.none() | st.integers(0, 200),
    ),
    # well-formed frames holding odd maps: unknown commands, wrong argument types
    st.builds(
        lambda cmd, args: protocol.pack({"cmd": cmd, "args": args}),
        st.sampled_from(["ping", "ls", "stats", "put", "evict", "touch", "record", "warm"])
        | st.text(max_size=12),
        _values,
    ),
)


def _mutate(payload: bytes, muts: list[tuple[int, int]], cut: int | None) -> bytes:
    b = bytearray(payload)
    for pos, val in muts:
        b[pos % len(b)] = val
    if cut is not None:
        b = b[: cut % (len(b) + 1)]
    return protocol.HEADER.pack(len(b)) + bytes(b)


def _exchange(home: Path, raw: bytes) -> str:
    """Send raw bytes, half-close, read replies until the daemon hangs up: the outcome."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    try:
        s.connect(str(daemon_client.socket_path(home)))
        try:
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            return "closed"  # it hung up while we wrote: a refused frame
        outcome = "closed"
        while True:
            try:
                reply = protocol.recv(s, timeout=5)
            except ProtocolError as e:
                if "timed out" in str(e):
                    return "hung"  # the daemon neither answered nor closed
                return "closed"
            if reply is None:
                return outcome
            assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool), reply
            outcome = "ok reply" if reply["ok"] else "error reply"
    finally:
        s.close()


def test_malformed_frames_and_mutated_requests(fuzz_daemon):
    home = fuzz_daemon.home
    rss0 = fuzz_daemon.rss()
    t0 = time.monotonic()
    seen = [0]

    @settings(FUZZ, max_examples=FRAMES)
    @given(frames)
    def run(raw):
        assume(b"shutdown" not in raw and b"reload" not in raw)  # real commands, not bugs
        outcome = _exchange(home, raw)
        _count("frames", outcome)
        assert outcome != "hung"
        seen[0] += 1
        if seen[0] % 100 == 0:
            assert fuzz_daemon.request("ping")["pid"] == fuzz_daemon.pid

    run()
    assert fuzz_daemon.p.poll() is None, fuzz_daemon.text()[-3000:]
    assert fuzz_daemon.request("ping")["pid"] == fuzz_daemon.pid
    battery.record(
        "6_fuzz_frames",
        examples=seen[0],
        outcomes=COUNTS["frames"],
        daemon_crashes=0,
        pings_after_every_100=seen[0] // 100,
        daemon_rss_growth_mib=round((fuzz_daemon.rss() - rss0) / 2**20, 1),
        seconds=round(time.monotonic() - t0, 1),
    )


# -- safetensors blobs against codec.decode ------------------------------------------------------


def _split(blob: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _join(header_text: str, data: bytes) -> bytes:
    raw = header_text.encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.fixture(scope="module")
def base_blobs(llama_path, hybrid_path) -> list[bytes]:
    """Valid blobs: a synthetic KVCache, and real caches of a llama and a hybrid model."""
    from mlx_lm import load

    from kvstore.kvcheck.prefill import prefill

    out = [battery.entry(1, 20_000)[1]]
    for path in (llama_path, hybrid_path):
        model, _ = load(str(path))
        out.append(codec.encode(prefill(model, list(range(5, 30)))))
    for b in out:
        codec.decode(b)
    return out


def _structural(blob: bytes, how: str, pick: int, value) -> bytes:
    """One of the named header corruptions, each of which makes the blob invalid."""
    header, data = _split(blob)
    meta = header.pop("__metadata__")
    names = sorted(header)
    name = names[pick % len(names)]
    t = header[name]
    if how == "hdrlen":
        return struct.pack("<Q", value) + blob[8:]
    if how == "hdrlen_past_end":
        return struct.pack("<Q", len(blob) - 8 + 1 + value % 1000) + blob[8:]
    if how == "overlap":
        a, b = sorted((header[n]["data_offsets"] for n in names), key=lambda o: o[0])[:2]
        other = next(n for n in names if header[n]["data_offsets"] == b)
        header[other]["data_offsets"] = [a[0], a[0] + (b[1] - b[0])]
    elif how == "duplicate":
        text = json.dumps({**header, "__metadata__": meta}, separators=(",", ":"))
        dup = json.dumps({name: t}, separators=(",", ":"))[1:-1]
        return _join(text[:-1] + "," + dup + "}", data)
    elif how == "shape":
        dims = t["shape"] or [1]
        dims[pick % len(dims)] = value
        t["shape"] = dims
    elif how == "dtype":
        t["dtype"] = value
    elif how == "offsets":
        t["data_offsets"] = [t["data_offsets"][0], value]
    elif how == "metadata":
        key = sorted(meta)[pick % len(meta)]
        meta[key] = value
    elif how == "class":
        key = next(k for k in sorted(meta) if k.startswith("1."))
        meta[key] = value
    header["__metadata__"] = meta
    return _join(json.dumps(header, separators=(",", ":")), data)


STRUCTURAL = st.one_of(
    st.tuples(st.just("hdrlen"), st.integers(0, 9), st.sampled_from([0, 1, 7, 2**63, 2**64 - 1])),
    st.tuples(st.just("hdrlen_past_end"), st.integers(0, 9), st.integers(0, 10**6)),
    st.tuples(st.just("overlap"), st.integers(0, 9), st.none()),
    st.tuples(st.just("duplicate"), st.integers(0, 9), st.none()),
    st.tuples(
        st.just("shape"),
        st.integers(0, 9),
        st.sampled_from([-1, -(2**31), 2**31, 2**63, 2**64, 10**30, 1.5, "3", None]),
    ),
    st.tuples(
        st.just("dtype"),
        st.integers(0, 9),
        st.sampled_from(["F64", "Q4", "", "f32", "float32", "C64", 7, None, ["F32"]]),
    ),
    st.tuples(st.just("offsets"), st.integers(0, 9), st.integers(-(2**63), 2**64)),
    st.tuples(
        st.just("metadata"),
        st.integers(0, 9),
        st.sampled_from([1, 2.5, None, True, ["KVCache"], {"a": "b"}]),
    ),
    st.tuples(
        st.just("class"),
        st.integers(0, 9),
        st.sampled_from(
            [
                "Path",
                "BatchKVCache",
                "LRUPromptCache",
                "os.system",
                "__import__",
                "kvcache",
                "KVCache ",
                "",
                "TokenBuffer",
                "PromptTrie",
            ]
        ),
    ),  # fmt: skip
)
NOISE = st.one_of(
    st.tuples(
        st.just("bitflip"),
        st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 7)), min_size=1, max_size=8),
    ),  # fmt: skip
    st.tuples(st.just("truncate"), st.integers(0, 2**40)),
)


class _Watch:
    """Counts the decoder's copies of tensor bytes into mlx: a rejected blob must have none."""

    def __init__(self) -> None:
        self.calls = 0
        real = materialize.arrays

        def arrays(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        self.arrays = arrays


def _noisy(blob: bytes, mutation) -> bytes:
    """`blob` with NOISE's bits flipped, or truncated."""
    out = bytearray(blob)
    if mutation[0] == "bitflip":
        for pos, bit in mutation[1]:
            out[pos % len(out)] ^= 1 << bit
    else:
        out = out[: mutation[1] % len(out)]
    return bytes(out)


def _decode(blob: bytes, watch: _Watch) -> str:
    watch.calls = 0
    try:
        codec.decode(blob, name="fuzz")
    except CodecError:
        assert watch.calls == 0, "mlx read bytes of a blob that was then rejected"
        return "rejected"
    return "accepted"


def test_malformed_blobs_are_rejected_before_mlx_reads_them(base_blobs):
    watch = _Watch()
    t0 = time.monotonic()

    @settings(FUZZ, max_examples=BLOBS // 2)
    @given(st.integers(0, 2), STRUCTURAL)
    def structural(which, mutation):
        blob = _structural(base_blobs[which], *mutation)
        outcome = _decode(blob, watch)
        _count("structural", outcome)
        assert outcome == "rejected", mutation

    @settings(FUZZ, max_examples=BLOBS // 2)
    @given(st.integers(0, 2), NOISE)
    def noise(which, mutation):
        outcome = _decode(_noisy(base_blobs[which], mutation), watch)  # a flipped data bit may
        _count(mutation[0], outcome)  # decode: that is fine, the store's checksum catches it

    with mock.patch.object(materialize, "arrays", watch.arrays):
        structural()
        noise()
    battery.record(
        "6_fuzz_blobs",
        examples=sum(sum(v.values()) for k, v in COUNTS.items() if k != "frames"),
        structural=COUNTS["structural"],
        bitflip=COUNTS.get("bitflip", {}),
        truncate=COUNTS.get("truncate", {}),
        crashes=0,
        mlx_reads_of_rejected_blobs=0,
        seconds=round(time.monotonic() - t0, 1),
    )


def test_corrupted_stored_values_are_caught(tmp_path, base_blobs):
    """Bytes changed inside LMDB: the checksum, the meta schema or the codec refuses them."""
    home = tmp_path / "home"
    with Store(home) as store:
        key, blob, fields = battery.entry(3, 50_000)
        good_meta = store.put(key, blob, **fields)
        raw_meta = store._read(lambda txn: bytes(txn.get(key, db=store._meta)))

        @settings(FUZZ, max_examples=STORED)
        @given(
            st.sampled_from(["meta", "blob", "blob+checksum"]),
            st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 255)), min_size=1,
                     max_size=6),
            st.none() | st.integers(0, 2**40),
        )  # fmt: skip
        def corrupt(where, muts, cut):
            target = bytearray(raw_meta if where == "meta" else blob)
            for pos, val in muts:
                target[pos % len(target)] = val
            if cut is not None:
                target = target[: cut % (len(target) + 1)]
            with store.env.begin(write=True) as txn:
                if where == "meta":
                    txn.put(key, bytes(target), db=store._meta)
                    txn.put(key, blob, db=store._blob)
                else:
                    meta = good_meta
                    if where == "blob+checksum":  # a consistent checksum: the codec must judge
                        meta.nbytes, meta.checksum = len(target), blob_checksum(bytes(target))
                    txn.put(key, meta.pack(), db=store._meta)
                    txn.put(key, bytes(target), db=store._blob)
            try:
                store.load(key)
                outcome = "loaded"
            except CorruptEntryError:
                outcome = "rejected"
            _count(f"stored:{where}", outcome)
            if outcome == "loaded":  # only a change that left the value valid may load
                assert where != "blob" or bytes(target) == blob

        corrupt()
    battery.record(
        "6_fuzz_stored",
        examples=STORED,
        **{k.split(":")[1]: v for k, v in COUNTS.items() if k.startswith("stored:")},
        crashes=0,
    )


# -- the same blobs given to mx.load -------------------------------------------------------------

MX_CHILD = r"""
import sys
import mlx.core as mx
from mlx_lm.models import cache as mlc

files = sys.argv[2:]
out = open(sys.argv[1], "a", buffering=1)
for f in files:
    out.write(f"start {f}\n")
    try:
        arrays = mx.load(f)
        mx.eval(list(arrays.values()))
        r = "loaded"
    except Exception as e:
        r = "exception"
    try:
        c = mlc.load_prompt_cache(f)
        r2 = "cache"
        if any(type(x).__name__ not in ALLOWED for x in c):
            r2 = "foreign-class"
    except Exception as e:
        r2 = "exception"
    out.write(f"done {f} {r} {r2}\n")
"""
ALLOWED = sorted(codec.ALLOWED_CLASSES)


def _limit_memory() -> None:  # the child may try huge allocations: keep the box alive
    resource.setrlimit(resource.RLIMIT_AS, (12 * 2**30, 12 * 2**30))


def _rejected_corpus(base_blobs: list[bytes], n: int) -> list[tuple[str, bytes]]:
    """(kind, blob) for blobs the fuzzing above makes (each mutation kind, `n` of each family)
    that codec.decode rejects before mlx reads them."""
    watch, out = _Watch(), []

    @settings(FUZZ, max_examples=n)
    @given(st.integers(0, 2), STRUCTURAL)
    def structural(which, mutation):
        out.append((mutation[0], _structural(base_blobs[which], *mutation)))

    @settings(FUZZ, max_examples=n)
    @given(st.integers(0, 2), NOISE)
    def noise(which, mutation):
        out.append((mutation[0], _noisy(base_blobs[which], mutation)))

    structural()
    noise()
    with mock.patch.object(materialize, "arrays", watch.arrays):
        return [(kind, blob) for kind, blob in out if _decode(blob, watch) == "rejected"]


def test_the_same_blobs_with_mx_load(tmp_path, base_blobs):
    """What the validation prevents: mx.load (and load_prompt_cache) in a child, on inputs
    codec.decode rejected. Whatever mlx does with each (a clean exception, garbage that loads, a
    crash or a hang), every input gets an outcome and the counts add up."""
    limit = battery.scale(300, 1500)
    rejected = _rejected_corpus(base_blobs, limit)
    assert len(rejected) >= limit  # every structural mutation is rejected, some noise too
    assert {kind for kind, _ in rejected} >= {"hdrlen", "overlap", "shape", "dtype", "class"}
    picked = rejected[:: max(1, len(rejected) // limit)][:limit]
    files = []
    for i, (kind, blob) in enumerate(picked):
        f = tmp_path / f"{i:05d}-{kind}.safetensors"
        f.write_bytes(blob)
        files.append(str(f))
    progress = tmp_path / "progress.txt"
    code = MX_CHILD.replace("ALLOWED", repr(set(ALLOWED)))
    results: dict[str, tuple[str, str]] = {}
    crashes, hangs = [], []
    todo = list(files)
    t0 = time.monotonic()
    while todo:
        p = subprocess.Popen(
            [sys.executable, "-c", code, str(progress), *todo],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_limit_memory,
        )  # fmt: skip
        timed_out = False
        try:
            p.wait(timeout=20 + len(todo) * 0.2)
        except subprocess.TimeoutExpired:
            timed_out = True
            p.kill()
            p.wait()
        started = None
        for line in progress.read_text().splitlines():
            kind, f, *rest = line.split(" ")
            if kind == "start":
                started = f
            else:
                results[f] = tuple(rest)
                started = None
        if started is not None and started not in results:  # died (or hung) on this file
            (hangs if timed_out else crashes).append((Path(started).name, p.returncode))
            results[started] = ("crash", "crash")
        todo = [f for f in files if f not in results]
    assert set(results) == set(files)  # every input has an outcome, none lost with a crash
    assert {r[0] for r in results.values()} <= {"loaded", "exception", "crash"}, results
    assert {r[1] for r in results.values()} <= {"cache", "foreign-class", "exception", "crash"}
    crashed = [Path(f).name for f, r in results.items() if r == ("crash", "crash")]
    assert sorted(crashed) == sorted(name for name, _ in crashes + hangs)
    loaded = sum(r[0] == "loaded" for r in results.values())
    foreign = sum(r[1] == "foreign-class" for r in results.values())
    built = sum(r[1] in ("cache", "foreign-class") for r in results.values())
    battery.record(
        "6_mx_load_comparison",
        inputs=len(files),
        rejected_by_codec_decode=len(files),
        mx_load_crashes_or_aborts=len(crashes),
        mx_load_hangs_or_killed=len(hangs),
        mx_load_garbage_loads=loaded,
        mx_load_clean_exceptions=sum(r[0] == "exception" for r in results.values()),
        load_prompt_cache_built_a_cache=built,
        load_prompt_cache_foreign_classes=foreign,
        crash_examples=[c[0] for c in crashes[:5]],
        seconds=round(time.monotonic() - t0, 1),
    )
