"""How much memory there is for a warm: the one reader of the memory available now (the daemon
defers a model's load on it, and every warm checks each pin's prefill against it). Stdlib only:
the daemon imports it at start."""

from __future__ import annotations

import ctypes
import sys


def available_memory_bytes() -> int | None:
    """Memory the system can give a new allocation without swapping; None when unknown (then
    nothing is deferred or refused). The one place that reads it; callers look it up when they
    call it, so tests patch it: here (a warm's prefill check), or as the daemon names it
    (`kvstore.daemon.lifecycle.available_memory_bytes`, which the daemon's checks read).

    Linux: MemAvailable of /proc/meminfo, "an estimate of how much memory is available for
    starting new applications, without swapping" (Documentation/filesystems/proc.rst).
    macOS: sysctl kern.memorystatus_level, the percentage of memory available that the kernel's
    memorystatus keeps (xnu bsd/kern/kern_memorystatus.c; `memory_pressure` prints it as
    "System-wide memory free percentage"), times hw.memsize."""
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024  # the file says kB: KiB
        except (OSError, ValueError, IndexError):
            return None
        return None
    if sys.platform == "darwin":
        level, total = _sysctl_int("kern.memorystatus_level"), _sysctl_int("hw.memsize")
        if level is None or total is None or not 0 < level <= 100:
            return None
        return total * level // 100
    return None


def _sysctl_int(name: str) -> int | None:
    """An integer sysctl (4 or 8 bytes, little-endian on every Mac mlx runs on); None on error."""
    value, size = ctypes.c_uint64(0), ctypes.c_size_t(8)
    try:
        rc = ctypes.CDLL(None).sysctlbyname(
            name.encode(), ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)
        )
    except (OSError, AttributeError):
        return None
    return value.value if rc == 0 else None
