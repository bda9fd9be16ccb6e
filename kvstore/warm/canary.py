"""The upgrade canary: does the installed mlx / mlx-lm still compute the KV that is stored?

The fingerprint covers the mlx-lm source that computes the KV, but not mlx's compiled kernels; a
release can change the KV with no source change we hash. So after an upgrade, one short pin per
model is prefilled again and compared with its stored entry by the one KV check
(kvstore.kvcheck.check: per layer, within a few unit roundoffs of the KV dtype).

`kvstore verify --deep` runs it on demand; the daemon after an upgrade (kvstore.daemon.canary). The
versions a home's daemon last ran with are kept in HOME/runtime.json.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.errors import KVStoreError
from kvstore.home.settings import write_atomically
from kvstore.identity.model import ModelIdentity
from kvstore.kvcheck.check import check_kv

log = logging.getLogger("kvstore")

RUNTIME_NAME = "runtime.json"  # the mlx / mlx-lm versions the home's daemon last ran with


@dataclass
class CanaryResult:
    model: str
    label: str  # the pin re-prefilled
    key: str
    tokens: int
    difference: float  # largest per-layer relative RMS difference, stored vs fresh
    tolerance: float
    error: str | None = None  # the check itself failed (load, decode): not a verdict on the KV
    detail: str | None = None  # what was compared (ok) or what differs (first layer, position)

    @property
    def ok(self) -> bool:
        return self.error is None and self.difference <= self.tolerance


def check_plan(plan: Any, store: Any, model: Any = None) -> CanaryResult | None:
    """Re-prefill the shortest present pin of a planned model (kvstore.pins.plan.ModelPlan) and
    compare it with its stored entry. None when the model has no pin stored. Loads the model (with
    the plan's overrides) unless given one; the caller releases it."""
    from kvstore.kvcheck.prefill import load_model

    present = [pp for pp in plan.pins if pp.present]
    if not present:
        return None
    pp = min(present, key=lambda p: len(p.pin.tokens))
    result = CanaryResult(plan.spec.path, pp.pin.name, pp.key.hex(), len(pp.pin.tokens), 0.0, 0.0)
    try:
        _, stored = store.load(pp.key)
        model = model if model is not None else load_model(plan)
        verdict = check_kv(model, stored, pp.pin.tokens, identity=plan.spec.identity)
    except (KVStoreError, KeyError, ValueError, RuntimeError) as e:
        result.error = str(e)
        return result
    result.difference, result.tolerance = verdict.difference, verdict.tolerance
    return result


def check_manifest(manifest: Any, store: Any, *, home: Path) -> list[CanaryResult]:
    """The canary for every model of a manifest, one model loaded at a time."""
    from kvstore.kvcheck.prefill import release_model
    from kvstore.warm.warm import plan_model

    out = []
    for spec in manifest.models:
        try:
            plan = plan_model(spec, store, home=home)
        except KVStoreError as e:
            out.append(CanaryResult(spec.path, "", "", 0, 0.0, 0.0, error=str(e)))
            continue
        result = check_plan(plan, store)
        release_model()
        if result is not None:
            out.append(result)
    return out


def check_entries(store: Any, metas: list, *, home: Path, judge: Any = None) -> list[CanaryResult]:
    """Re-prefill each entry with its model as it was stored (adapter, KV quantization,
    overrides) and compare it as an import is compared (kvstore.warm.importfit.kv_check), or by
    `judge(model, identity, meta, cache)` (returns what it compared; raises ImportMismatch). One
    model loaded at a time; an entry whose model changed since is not judged."""
    from kvstore.home.settings import FILEHASH_NAME
    from kvstore.identity.fingerprint import FileHashCache, model_fingerprint, resolve_model
    from kvstore.warm.importfit import ImportMismatch, kv_check, loaded_for_check

    groups: dict[tuple, list] = {}
    for m in metas:
        groups.setdefault(ModelIdentity.of_entry(m).same_model(), []).append(m)
    out = []
    for entries in groups.values():
        results = [
            CanaryResult(m.model, m.label, m.key.hex(), m.ntokens, 0.0, 0.0) for m in entries
        ]
        identity = ModelIdentity.of_entry(entries[0])
        try:
            located = resolve_model(identity)  # its directory and config read once
            model_dir = located.directory
            fp = model_fingerprint(located, hash_cache=FileHashCache(home / FILEHASH_NAME))
            todo = []
            for m, r in zip(entries, results):
                if m.fingerprint != fp.digest:
                    r.error = (
                        "its model changed since it was stored (kvstore evict --stale drops it)"
                    )
                else:
                    todo.append((m, r))
            if todo:
                with loaded_for_check(identity, model_dir, fp) as model:
                    for m, r in todo:
                        try:
                            from kvstore.learned.blockstore import load_entry

                            _, cache = load_entry(store, m.key, m.tokens)
                            r.detail = (
                                judge(model, identity, m, cache)
                                if judge is not None
                                else kv_check(model, cache, m.token_ids(), what="")
                            )
                        except ImportMismatch as e:
                            r.difference, r.detail = float("inf"), str(e)
                        except (KVStoreError, ValueError, RuntimeError) as e:
                            r.error = str(e)
        except KVStoreError as e:
            for r in results:
                r.error = r.error or str(e)
        out.extend(results)
    return out


def describe(result: CanaryResult) -> str:
    if result.error:
        return f"{result.model}: canary pin {result.label!r} could not be checked: {result.error}"
    verdict = "matches" if result.ok else "DIFFERS from"
    return (
        f"{result.model}: pin {result.label!r} ({result.tokens} tokens) re-prefilled {verdict} "
        f"its stored KV (relative RMS difference {result.difference:.3g}, tolerance "
        f"{result.tolerance:.3g})"
    )


def stored_versions(home: Path) -> dict | None:
    try:
        data = json.loads((home / RUNTIME_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def save_versions(home: Path, versions: dict) -> None:
    path = home / RUNTIME_NAME
    try:
        write_atomically(path, json.dumps(versions, sort_keys=True).encode())
    except OSError as e:
        log.warning("cannot record the mlx versions in %s: %s", path, e)
