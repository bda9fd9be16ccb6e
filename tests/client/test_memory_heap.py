"""`kvstore serve` keeps glibc's mmap threshold fixed (issue 34 item 6): a buffer above 128 KiB
is a mapping of its own even after a larger one was freed, where glibc's default would have
raised the threshold and taken it from the heap (serve's KV buffers of every size then
fragmented the heap: anonymous memory grew by kilobytes a request, docs/soak.md)."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

SCRIPT = r"""
import ctypes, sys
libc = ctypes.CDLL(None)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd usmblks "
                                               "fsmblks uordblks fordblks keepcost").split()]
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "serve":
    from kvstore.client.cli import fixed_mmap_threshold
    assert fixed_mmap_threshold()
libc.free(libc.malloc(8 << 20))  # a mapped buffer freed: by default the threshold rises to it
before = libc.mallinfo2().hblks
p = libc.malloc(1 << 20)
print(libc.mallinfo2().hblks - before)  # 1: a mapping of its own; 0: from the heap
libc.free(p)
"""


def _glibc_with_mallinfo2() -> bool:
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.gnu_get_libc_version and libc.mallinfo2)
    except (OSError, AttributeError):
        return False


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="glibc 2.33+ only (mallopt, mallinfo2)")
@pytest.mark.parametrize(("how", "mapped"), [("default", "0"), ("serve", "1")])
def test_a_large_buffer_stays_a_mapping_after_a_larger_one_was_freed(how, mapped):
    out = subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == mapped, (how, out.stdout)


def test_elsewhere_it_sets_nothing_and_says_so(monkeypatch):
    from kvstore.client import cli

    def no_libc(*a, **k):
        raise OSError("no libc here")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    assert cli.fixed_mmap_threshold() is False


def test_serves_memory_gauges_say_where_its_memory_is():
    """/metrics' memory gauges (what bench.soak reads at each sample to tell which part of
    RssAnon moved): mlx's active buffers follow an array kept alive, malloc's in-use bytes
    (glibc) a buffer held."""
    import mlx.core as mx

    from kvstore.client.serve import gauges
    from kvstore.metrics import exposition

    def read() -> dict[str, float]:
        gauges.process_memory()
        text = exposition()[0].decode()
        return {
            name: float(value)
            for name, _, value in (line.partition(" ") for line in text.splitlines())
            if name.startswith(("kvstore_mlx_", "kvstore_python_", "kvstore_malloc_"))
        }

    before = read()
    kept = mx.zeros((1 << 20,), dtype=mx.float32)
    mx.eval(kept)
    after = read()
    assert after["kvstore_mlx_active_bytes"] >= before["kvstore_mlx_active_bytes"] + (4 << 20)
    assert after["kvstore_python_allocated_blocks"] > 0
    if _glibc_with_mallinfo2():
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        p = libc.malloc(8 << 20)
        held = read()
        libc.free(p)
        assert held["kvstore_malloc_in_use_bytes"] >= after["kvstore_malloc_in_use_bytes"] + (
            8 << 20
        )
        assert "kvstore_malloc_free_bytes" in held
    del kept
