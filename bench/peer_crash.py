"""The crash row of issue 44: bench/peer_survival.py (`--only peer_crash`)."""

from bench.peer_survival import crash_run as run
from bench.peer_survival import crash_targets as targets

__all__ = ["run", "targets"]
