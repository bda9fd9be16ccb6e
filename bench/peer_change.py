"""The change row of issue 44: bench/peer_survival.py (`--only peer_change`)."""

from bench.peer_survival import change_run as run
from bench.peer_survival import change_targets as targets

__all__ = ["run", "targets"]
