"""The fleet tier wired to a store, from a home's [remote] table (none: the tier is off), the one
place both writers set it up. The daemon uploads on a worker thread as the store commits
(`daemon_tier`); a warm without a daemon queues its commits for the next daemon or `kvstore remote
push` (`warm_tier`). Both read through the same fetcher when [remote] downloads."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.errors import KVStoreError
from kvstore.fleet.fetch import WarmFetcher
from kvstore.fleet.objects import Remote
from kvstore.fleet.queue import Uploader, UploadQueue, enqueue_on_commit, start_uploader
from kvstore.fleet.remote_settings import RemoteSettings, remote_settings
from kvstore.home.ledger import Ledger
from kvstore.home.settings import Settings, load_settings
from kvstore.store.store import Store

if TYPE_CHECKING:
    from kvstore.fleet.check import Checked


RecordChecks = Callable[[list["Checked"]], object]  # a warm's fleet verdicts, recorded


@dataclass
class DaemonTier:
    remote: Remote
    settings: RemoteSettings
    uploader: Uploader | None  # None when [remote] does not upload
    fetcher: WarmFetcher | None  # None when [remote] does not download


def open_remote(settings: Settings, home: Path) -> tuple[RemoteSettings, Remote] | None:
    """The home's remote and its settings; None without a [remote] table. A table that is wrong
    or a remote that cannot be reached raises KVStoreError naming why."""
    rs = remote_settings(settings, home)
    return None if rs is None else (rs, Remote(rs))


def daemon_tier(
    settings: Settings,
    home: Path,
    store: Store,
    ledger: Ledger,
    *,
    record_checks: RecordChecks,
) -> DaemonTier | None:
    """The daemon's tier: an upload worker draining what `store` commits, and the read-through
    fetcher its warms use (`record_checks` records what they check: kvstore.ops.fleet)."""
    found = open_remote(settings, home)
    if found is None:
        return None
    rs, remote = found
    fetcher = (
        WarmFetcher(remote, UploadQueue(home), ledger=ledger, record_checks=record_checks)
        if rs.download
        else None
    )
    with ExitStack() as undo:  # the fetcher's queue closed again if the uploader cannot start
        if fetcher is not None:
            undo.callback(fetcher.queue.close)
        uploader = start_uploader(remote, store, home) if rs.upload else None
        undo.pop_all()
    return DaemonTier(remote, rs, uploader, fetcher)


@contextmanager
def warm_tier(
    home: Path, store: Store, *, warn: Callable[[str], None], record_checks: RecordChecks
) -> Iterator[WarmFetcher | None]:
    """For a warm without a daemon: commits queued for upload, and the read-through fetcher (None
    when there is no [remote] table, or when it is unusable: then `warn` says why;
    `record_checks` as daemon_tier's)."""
    try:
        found = open_remote(load_settings(home), home)
    except KVStoreError as e:
        warn(f"remote: {e}; warming local-only")
        found = None
    if found is None:
        yield None
        return
    rs, remote = found
    queue = UploadQueue(home)
    hooked = enqueue_on_commit(store, home) if rs.upload else None
    try:
        yield (
            WarmFetcher(remote, queue, ledger=Ledger(home), record_checks=record_checks)
            if rs.download
            else None
        )
    finally:
        if hooked is not None:
            store.on_commit.pop()
            hooked.close()
        queue.close()
