"""Copy validated tensors out of a blob into mlx memory: the one place mlx receives stored bytes.

In a process that has just started, most of a hydrate is the kernel faulting in fresh pages for
the copy (both mlx-lm's loader and ours pay it). Two paths give the same arrays (evaluated, owning
their memory, so the blob may be released):
- small blobs: one `mx.array(np.frombuffer(...))` per tensor, the least fixed cost;
- large blobs: mlx allocates one buffer for the whole data section (`mx.load` of a one-tensor
  stream whose header this module writes, so mlx never parses stored bytes), which is filled in
  chunks on a few threads after asking the kernel to populate its pages in one call; each tensor
  is a view of it. The threads only run numpy copies (GIL released) and the checksum over plain
  buffers: no mlx call leaves mlx's own threads, so mlx's stream rules do not apply to them.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import struct
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future

import mlx.core as mx
import numpy as np
import xxhash

from kvstore.codec.safetensors import DTYPES, Layout
from kvstore.degrade import settle

# From here on the one-buffer path (pages populated in one call, then copied and checked chunk by
# chunk), when the copy lands in new pages: per-tensor copies into fresh pages fault each page
# in from user space, which costs more than populating them in one call.
LARGE_BYTES = 8 << 20
# Few, large units of work: each hand-over between threads needs the GIL, which an app thread
# busy in Python (mlx_lm.load building the model while kvstore.client.load prefetches) holds for up
# to the switch interval, so small chunks leave a concurrent prefetch waiting at every hand-over.
CHUNK_BYTES = 64 << 20  # checksum: the GIL is released between chunks, for the copy's hand-overs
PIECE_BYTES = 2 << 20  # copied, then hashed while still in the core's cache (L2 is 1-4 MiB)
# mlx's own loader reads with 4 threads; KVSTORE_COPY_THREADS overrides (for measuring)
THREADS = int(os.environ.get("KVSTORE_COPY_THREADS", 0)) or max(1, min(4, os.cpu_count() or 1))


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault a range in one call; elsewhere a no-op
_PAGE = 4096  # madvise needs a page-aligned start; 4 KiB divides every page size in use


def _libc_madvise() -> Callable | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_madvise = _libc_madvise()


def _populate(dst: np.ndarray) -> None:
    """Ask the kernel for all of `dst`'s pages at once: cheaper than a fault per page. Only a
    hint (a failure, or an older kernel's EINVAL, leaves the copy to fault them)."""
    if _madvise is not None and dst.nbytes:
        addr = dst.ctypes.data
        start = addr - addr % _PAGE
        _madvise(start, dst.nbytes + addr - start, _MADV_POPULATE_WRITE)


def checksum(buf) -> int:
    """xxh3-64 of `buf` (the value `xxhash.xxh3_64_intdigest` gives), in chunks so that other
    threads get the GIL between them."""
    data = np.frombuffer(buf, np.uint8)
    if data.nbytes <= CHUNK_BYTES:
        return xxhash.xxh3_64_intdigest(data)
    h = xxhash.xxh3_64()
    for i in range(0, data.nbytes, CHUNK_BYTES):
        h.update(data[i : i + CHUNK_BYTES])
    return h.intdigest()


class _Copiers:
    """Worker threads started by the hydrating thread and joined before `arrays` returns. mlx's
    io thread (which calls readinto) only queues jobs and waits: creating threads there would
    register a dummy Thread for each of mlx's pool threads, and copying there (one worker run
    inline) aborted the process at exit now and then (2 in 12 runs)."""

    def __init__(self, n: int):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._work, name=f"kvstore-copy-{i}", daemon=True)
                        for i in range(max(1, n))]  # fmt: skip
        self.width = len(self.threads)
        for t in self.threads:
            t.start()

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            settle(*job)  # its result or error handed to whoever waits on it

    def submit(self, fn: Callable[[], object]) -> Future:
        done: Future = Future()
        self.jobs.put((done, fn))
        return done

    def close(self) -> None:
        for _ in self.threads:
            self.jobs.put(None)
        for t in self.threads:
            t.join()

    def __enter__(self) -> _Copiers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _DataStream:
    """What mx.load reads: a safetensors header for one U8 tensor (ours), then the blob's data
    section, which `readinto` hands to `fill` (mlx's freshly allocated buffer as a numpy array)
    to copy on the pool's threads; `fill` returns whether the bytes checked out."""

    closed = False

    def __init__(self, n: int, fill: Callable[[np.ndarray], bool]):
        text = json.dumps({"data": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}})
        head = text.encode() + b" " * (-len(text) % 8)
        self.head = struct.pack("<Q", len(head)) + head
        self.n, self.fill, self.pos, self.ok = n, fill, 0, False

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.pos, len(self.head) + self.n)[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf) -> int:
        n, pos = len(buf), self.pos
        self.pos += n
        if pos + n <= len(self.head):
            buf[:n] = self.head[pos : pos + n]
            return n
        if pos != len(self.head) or n != self.n:
            raise OSError(f"unexpected read of {n} bytes at {pos}")  # mlx reads the tensor whole
        self.ok = self.fill(np.frombuffer(buf, np.uint8))
        return n


def _fill_shares(pool: _Copiers, data: np.ndarray) -> Callable[[np.ndarray], bool]:
    """Copy `data` in one share per thread, each share's pages populated in one call first."""

    def fill(dst: np.ndarray) -> bool:
        n = dst.nbytes
        step = max(1 << 20, -(-n // pool.width))

        def share(i: int) -> Callable[[], None]:
            def run() -> None:
                part = dst[i : i + step]
                _populate(part)
                np.copyto(part, data[i : i + step])

            return run

        for job in [pool.submit(share(i)) for i in range(0, n, step)]:
            job.result()
        return True

    return fill


def _fill_checked(
    pool: _Copiers, mv: memoryview, data_start: int, size: int, sums: list[int]
) -> Callable[[np.ndarray], bool]:
    """Copy the data section in one share of whole checksum chunks per thread and check each
    chunk's xxh3-64 (`sums`, recorded when the entry was stored: chunk c is the blob's bytes
    [c * size, (c + 1) * size)) on the copied bytes, piece by piece while they are in cache:
    one pass over the source instead of a copy plus a separate checksum pass."""
    total = len(mv)

    def fill(dst: np.ndarray) -> bool:
        per = -(-len(sums) // pool.width)

        def share(first: int, last: int) -> Callable[[], bool]:
            def run() -> bool:
                lo, hi = max(first * size, data_start), min(last * size, total)
                if hi > lo:
                    _populate(dst[lo - data_start : hi - data_start])
                ok = True
                for c in range(first, last):
                    begin, end = c * size, min((c + 1) * size, total)
                    h = xxhash.xxh3_64()
                    if begin < data_start:  # the header's bytes: checked where they are
                        h.update(mv[begin : min(end, data_start)])
                    for at in range(max(begin, data_start), end, PIECE_BYTES):
                        stop = min(at + PIECE_BYTES, end)
                        piece = dst[at - data_start : stop - data_start]
                        np.copyto(piece, np.frombuffer(mv, np.uint8, stop - at, at))
                        h.update(piece)
                    ok = ok and h.intdigest() == sums[c]
                return ok

            return run

        jobs = [pool.submit(share(c, min(c + per, len(sums)))) for c in range(0, len(sums), per)]
        return all([job.result() for job in jobs])

    return fill


def _recycled(nbytes: int) -> bool:
    """mlx's buffer cache holds as much: per-tensor copies land in recycled, already-faulted
    pages (a long-lived process), where one thread copies at memory speed. mlx caches only
    buffers of a few MiB (a freed 64 MiB one goes back to the OS), so the one buffer of the
    threaded path always takes new pages: it is for processes whose cache is still empty."""
    return mx.get_cache_memory() >= nbytes


def _aligned(layout: Layout) -> bool:
    """Every tensor starts at a multiple of its item size (codec.encode writes them so; a blob
    from elsewhere may not), so each can be a view of one buffer."""
    return all(t.begin % DTYPES[t.code][0].itemsize == 0 for t in layout.tensors.values())


def arrays(
    mv: memoryview,
    layout: Layout,
    keys: list[str],
    *,
    expect_checksum: int | None = None,
    chunk_sums: tuple[int, list[int]] | None = None,
) -> tuple[dict[str, mx.array], bool]:
    """mlx arrays of the tensors `keys` (validated by `layout`), evaluated; and whether the
    blob's checksum equals `expect_checksum` (True when none is expected).

    A large blob's checksum runs alongside the copy: with `chunk_sums` ((chunk size, xxh3-64 of
    each chunk) as stored with the entry) on the copied bytes, chunk by chunk, else as one pass
    over the blob on a thread of its own. The caller must drop the arrays if False.
    """
    data_len = len(mv) - layout.data_start
    if data_len < LARGE_BYTES or _recycled(data_len) or not _aligned(layout):
        ok = expect_checksum is None or checksum(mv) == expect_checksum
        if not ok:
            return {}, False
        out = {k: _copy_one(mv, layout, k) for k in keys}
        mx.eval(list(out.values()))
        return out, True
    data = np.frombuffer(mv, np.uint8, data_len, layout.data_start)
    with _Copiers(THREADS) as pool:
        if chunk_sums is not None:
            summed = None
            fill = _fill_checked(pool, mv, layout.data_start, *chunk_sums)
        else:
            summed = pool.submit(lambda: checksum(mv)) if expect_checksum is not None else None
            fill = _fill_shares(pool, data)
        stream = _DataStream(data_len, fill)
        big = mx.load(stream, format="safetensors")["data"]  # evaluated
        ok = stream.ok and (summed is None or summed.result() == expect_checksum)
    if not ok:
        return {}, False
    return _views(big, layout, keys), True


def _copy_one(mv: memoryview, layout: Layout, key: str) -> mx.array:
    t = layout.tensors[key]
    np_dt, mx_dt = DTYPES[t.code]
    if t.end == t.begin:
        return mx.zeros(t.shape, mx_dt)
    count = (t.end - t.begin) // np_dt.itemsize
    src = np.frombuffer(mv, np_dt, count, layout.data_start + t.begin)
    a = mx.array(src.reshape(t.shape))  # the one copy: blob -> mlx memory
    return a.view(mx.bfloat16) if t.code == "BF16" else a


def _views(big: mx.array, layout: Layout, keys: list[str]) -> dict[str, mx.array]:
    """Each tensor as a view of the one buffer (split shares it), on the CPU stream: the ops are
    metadata only, and a CPU stream needs no GPU command encoder on whatever thread this runs."""
    cpu = mx.cpu
    # every non-empty tensor, scalars included: together they cover the data exactly from 0
    spans = sorted((t.begin, k) for k, t in layout.tensors.items() if t.end > t.begin)
    parts = mx.split(big, [b for b, _ in spans[1:]], stream=cpu)
    piece = {k: p for (_, k), p in zip(spans, parts, strict=True)}
    out: dict[str, mx.array] = {}
    for k in keys:
        t = layout.tensors[k]
        mx_dt = DTYPES[t.code][1]
        if k not in piece:
            out[k] = mx.zeros(t.shape, mx_dt, stream=cpu)
            continue
        part = piece[k] if mx_dt == mx.uint8 else mx.view(piece[k], mx_dt, stream=cpu)
        out[k] = mx.reshape(part, t.shape, stream=cpu)
    mx.eval(list(out.values()))
    return out
