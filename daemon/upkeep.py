"""Keeping the store true: reconcile manifests (warm) and hold the byte budget.

Everything here runs on the writer thread. The warm itself is kvstore.ops.warm (the one warm: it
purges stale pins, loads a model only when a pin is missing, releases it afterwards, and puts
through the put operation); the daemon adds its memory gate and its log lines around it. The
budgets are kvstore.ops.budget's.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvstore.daemon import lifecycle
from kvstore.daemon.canary import VersionWatch, check_at_boot, restart_into_new_code
from kvstore.daemon.lifecycle import memory_to_load, peak_rss_bytes, rss_bytes, trim_heap
from kvstore.degrade import daemon_handler
from kvstore.errors import KVStoreError, PrefillStopped, StoreDamaged, counted
from kvstore.home.registry import canonical
from kvstore.home.settings import Settings
from kvstore.identity.fingerprint import (
    ADAPTER_GLOBS,
    TEMPLATE_FILES,
    WEIGHT_GLOBS,
    resolve_model_path,
)
from kvstore.kvcheck.prefill import stop_when
from kvstore.learned.blockstore import BlockStore
from kvstore.ops import warm as warm_ops
from kvstore.ops.budget import Budget
from kvstore.pins.clock import local_now
from kvstore.pins.manifest import Manifest, load_manifest, manifest_files
from kvstore.store.store import Store
from kvstore.warm.warm import STORED, PinStatus, PrefillBounds, WarmReport, max_pin_tokens

log = logging.getLogger("kvstore.daemon")

WARM_LOG_EVERY = 10.0  # seconds between a long prefill's progress lines in the log


class WarmCancelled(KVStoreError):
    """The daemon is stopping: the warm stopped between pins or prefill chunks (pins done are
    kept; the one being prefilled is dropped and warmed again at the next boot)."""


class RssSampler:
    """Peak resident memory while a block runs, sampled on a side thread (ru_maxrss only knows
    the lifetime peak, which says nothing about a second warm)."""

    def __init__(self, interval: float = 0.05 if sys.platform.startswith("linux") else 0.5):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> RssSampler:
        self.before = rss_bytes()
        self._maxrss_before = peak_rss_bytes()
        self.peak = self.before
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        maxrss = peak_rss_bytes()
        if maxrss > self._maxrss_before:  # a new lifetime peak: it happened inside this block
            self.peak = max(self.peak, maxrss)
        self.after = rss_bytes()
        self.peak = max(self.peak, self.after)


def watched_files(manifest_paths: list[Path]) -> list[Path]:
    """What the watcher re-hashes: each manifest and the files it references, and each model's
    config, weights, tokenizer and chat-template files and adapter files."""
    out: list[Path] = []
    for path in manifest_paths:
        out.append(path)
        try:
            m = load_manifest(path)
        except KVStoreError:
            continue  # mid-edit or gone: the manifest itself stays watched
        out.extend(manifest_files(m))
        for spec in m.models:
            try:
                model_dir = resolve_model_path(spec.path)
            except KVStoreError:
                continue
            out.extend(p for g in WEIGHT_GLOBS for p in sorted(model_dir.glob(g)))
            # Template files that do not exist yet are watched too: adding one changes the template.
            out.extend(model_dir / name for name in TEMPLATE_FILES)
            if spec.identity.adapter:
                adir = Path(spec.identity.adapter).expanduser()
                out.extend(p for g in ADAPTER_GLOBS for p in sorted(adir.glob(g)))
    return list(dict.fromkeys(out))


class Upkeep:
    """The warm/reconcile and budget jobs; owned by the daemon, run on its writer thread."""

    def __init__(
        self,
        store: Store,
        home: Path,
        settings: Settings | Mapping[str, object],
        stopping: threading.Event,
        *,
        clock: Callable[[], dt.datetime] = local_now,
        blocks: BlockStore | None = None,
    ):
        self.store = store
        self.settings = settings = Settings.of(settings)  # a mapping as Settings.of takes one
        self.blocks = blocks or BlockStore(store, block=int(settings.block_tokens))
        self.clock = clock  # the local time pins render for (clock-bound pins); tests move it
        self.home = home
        self.stopping = stopping
        self.last_warm: dict[str, Any] | None = None
        # Manifests whose warm waits for memory to load a model: path -> why, since, bytes needed.
        # Written on the writer thread, read (copied) by stats and the accept loop's re-check.
        self.deferred: dict[str, dict[str, Any]] = {}
        self.budget = Budget(store, self.blocks, home, settings)
        self._versions: VersionWatch | None = None
        self.uploader: Any = None  # the fleet tier (kvstore.fleet.queue), when [remote] is set
        self.fetcher: Any = None
        # Each pin's prefill: its length bounded, its memory checked against what the daemon's
        # reader says is available (looked up at each call: tests patch it), its progress
        # logged every WARM_LOG_EVERY seconds once it runs that long.
        self.bounds = PrefillBounds(
            max_pin_tokens=max_pin_tokens(settings),
            available_memory=lambda: lifecycle.available_memory_bytes(),
            progress_every=WARM_LOG_EVERY,
        )

    def start_remote(self, ledger: Any) -> None:
        """Start the fleet tier's upload worker and read-through, when settings have [remote].
        Any problem is one log line and the daemon runs local-only."""
        from kvstore.fleet.tier import daemon_tier  # boto3 and the tier: only with [remote]
        from kvstore.ops.fleet import record_verdicts

        record = functools.partial(record_verdicts, self.store, self.home)
        try:
            tier = daemon_tier(self.settings, self.home, self.store, ledger, record_checks=record)
        except KVStoreError as e:
            log.error("remote: %s; running local-only", e)
            return
        if tier is None:
            return
        self.uploader, self.fetcher = tier.uploader, tier.fetcher
        rs = tier.settings
        log.info("remote: %s (upload %s, download %s)", tier.remote.where(), rs.upload, rs.download)

    def stop_remote(self) -> bool:
        """Stop the upload worker between entries; False if an upload is still in flight (its
        queue is then left for the process exit to release, like the store)."""
        stopped = self.uploader is None or self.uploader.stop()
        if stopped:
            for user in (self.uploader, self.fetcher):
                if user is not None:
                    user.queue.close()
        return stopped

    def _progress(self, msg: str) -> None:
        if self.stopping.is_set():
            raise WarmCancelled("the daemon is stopping; the warm stopped between pins")
        if not msg.startswith("purged pin"):  # kvstore.warm.warm logs purges itself
            log.info("warm: %s", msg)

    def warm(
        self,
        manifest: Manifest,
        *,
        cause: str,
        now: dt.datetime | None = None,
        purge: bool = True,
    ) -> WarmReport:
        """The warm operation (kvstore.ops.warm) as the daemon runs it, on the writer thread:
        stopped between pins when the daemon stops, a model's load deferred while memory is
        short, each pin's source logged; returns its report, naming the manifest."""
        log.info("warm %s (%s)", manifest.path, cause)
        now = now or self.clock()
        if self.fetcher is not None:
            self.fetcher.start()
        short: dict[str, int] = {}  # model path -> bytes its load needs, for models deferred
        with RssSampler() as rss, stop_when(self.stopping.is_set):
            try:
                report = warm_ops.warm(
                    manifest,
                    self.store,
                    home=self.home,
                    progress=self._progress,
                    warn=log.warning,
                    fetch=self.fetcher,
                    budget=self.budget,
                    purge=purge,
                    now=now,
                    may_load=lambda plan: self._may_load(plan, short),
                    bounds=self.bounds,
                )
            except PrefillStopped as e:
                raise WarmCancelled(f"the daemon is stopping: {e}") from None
            if report.models_loaded:
                trim_heap()  # kvstore.warm.warm released the model; hand its freed pages back too
        self._log_pins(report)
        self._after_warm(report, manifest, cause, short, rss)
        report.manifest = str(manifest.path)
        return report

    def _may_load(self, plan: Any, short: dict[str, int]) -> str | None:
        """The daemon must not double a model's memory: no load unless it fits now."""
        need = memory_to_load(plan.model_dir, plan.spec.identity.adapter)
        avail = lifecycle.available_memory_bytes()  # looked up here: tests patch it
        if avail is None or avail >= need:
            return None
        short[plan.spec.path] = need
        return (
            f"not enough memory to load model {plan.spec.path!r}: it needs about "
            f"{need / 2**20:.0f} MiB (weights + margin), {avail / 2**20:.0f} MiB is available; "
            f"warm deferred, retried when memory allows (checked every "
            f"{float(self.settings.memory_check_interval):g}s)"
        )

    @staticmethod
    def _log_pins(report: WarmReport) -> None:
        for p in report.pins:  # where each pin's KV came from
            if p.status in STORED:
                source = {PinStatus.WARMED: "prefilled", PinStatus.PRESENT: "already present"}.get(
                    p.status, p.status
                )
                why = f" ({p.remote})" if p.remote else ""
                log.info("warm: pin %r of %s: %s%s", p.name, p.model, source, why)

    def _after_warm(
        self,
        report: WarmReport,
        manifest: Manifest,
        cause: str,
        short: dict[str, int],
        rss: RssSampler,
    ) -> None:
        """The warm's summary line, its failures, its deferred models and `last_warm`."""
        present = sum(p.status is PinStatus.PRESENT for p in report.pins)
        log.info(
            "warm %s done in %.2fs: %d warmed, %d fetched, %d present, %d failed, %d purged, "
            "%s loaded; rss %.0f MiB before, %.0f MiB peak, %.0f MiB after",
            manifest.path,
            report.seconds,
            report.warmed,
            report.fetched,
            present,
            len(report.failed),
            len(report.purged),
            counted(report.models_loaded, "model"),
            rss.before / 2**20,
            rss.peak / 2**20,
            rss.after / 2**20,
        )
        for p in report.failed:
            log.error("warm: pin %r of %s failed: %s", p.name, p.model, p.error)
        self._note_deferred(str(manifest.path), report, short)
        self.last_warm = {
            "at": time.time(),
            "manifest": str(manifest.path),
            "cause": cause,
            "seconds": report.seconds,
            "warmed": report.warmed,
            "fetched": report.fetched,
            "present": present,
            "failed": len(report.failed),
            "deferred": len(report.deferred),
            "purged": len(report.purged),
            "models_loaded": report.models_loaded,
            "rss_before": rss.before,
            "rss_peak": rss.peak,
            "rss_after": rss.after,
        }

    def _note_deferred(self, manifest: str, report: WarmReport, short: dict[str, int]) -> None:
        """Remember a warm deferred for memory; said once in the log, not at every retry."""
        if not short:
            if self.deferred.pop(manifest, None) is not None:
                log.info("warm of %s no longer deferred", manifest)
            return
        # each deferred pin's error says why (the memory it needs), so none is left out here
        reasons = list(dict.fromkeys(p.error for p in report.deferred if p.error))
        first = manifest not in self.deferred
        self.deferred[manifest] = {
            "since": self.deferred.get(manifest, {}).get("since", time.time()),
            "pins": len(report.deferred),
            "need": max(short.values()),
            "reason": "; ".join(reasons),
        }
        if first:
            log.warning("warm of %s: %d pin(s) deferred: %s", manifest, len(report.deferred),
                        "; ".join(reasons))  # fmt: skip

    def memory_allows_retry(self) -> bool:
        """Whether some deferred warm would now find the memory it needs."""
        deferred = list(self.deferred.values())
        if not deferred:
            return False
        avail = lifecycle.available_memory_bytes()
        return avail is None or any(avail >= d["need"] for d in deferred)

    def retry_deferred(self, manifest_paths: list[Path]) -> list[WarmReport]:
        """Warm again each deferred manifest (still watched) that memory now allows."""
        watched = {str(canonical(p)) for p in manifest_paths}
        reports = []
        for path, d in list(self.deferred.items()):
            if path not in watched:
                self.deferred.pop(path, None)
                continue
            avail = lifecycle.available_memory_bytes()
            if avail is not None and avail < d["need"]:
                continue
            try:
                manifest = load_manifest(Path(path))
            except KVStoreError as e:
                log.error("retrying the deferred warm: %s", e)
                continue
            reports.append(self.warm(manifest, cause="memory available"))
        return reports

    def reconcile(
        self,
        manifest_paths: list[Path],
        *,
        cause: str,
        now: dt.datetime | None = None,
        purge: bool = True,
    ) -> list[WarmReport]:
        """Warm every manifest; one that does not load is logged and its pins are left alone, one
        whose warm fails is logged with its path, and the next manifest is warmed regardless."""
        if cause == "boot":
            self.boot_canary(manifest_paths)
        reports = []
        for path in manifest_paths:
            try:
                manifest = load_manifest(path)
            except KVStoreError as e:
                log.error("reconcile: %s (its pins are kept until it loads again)", e)
                continue
            # one manifest's failure must not starve the others
            what = f"reconcile: warming {path} failed; continuing with the next"
            damage = None
            with daemon_handler(what, logger=log):
                try:
                    reports.append(self.warm(manifest, cause=cause, now=now, purge=purge))
                except WarmCancelled:
                    log.info("warm of %s cancelled: the daemon is stopping", path)
                    break
                except StoreDamaged as e:  # no manifest can be warmed: the caller is told
                    damage = e
            if damage is not None:
                raise damage
        return reports

    def boot_canary(self, manifest_paths: list[Path]) -> None:
        """After an upgrade the stored KV is checked before the boot warm (kvstore.daemon.canary),
        and
        from then on the installed versions are watched."""
        # the canary must never keep the daemon from warming
        with daemon_handler("upgrade canary failed; warming as usual", logger=log):
            check_at_boot(self.store, self.home, manifest_paths)
        if self._versions is None:
            interval = float(self.settings.version_check_interval)
            self._versions = VersionWatch(interval, self.stopping, restart_into_new_code)
            self._versions.start()
