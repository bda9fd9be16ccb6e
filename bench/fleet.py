"""The fleet scenario: N boxes (homes) warm the demo pipeline's four-stage manifest, each on its
own (every box prefills every pin), and with the fleet tier (box 1 prefills and uploads, boxes
2..N fetch from a real SeaweedFS server). Reports total prefill seconds across the fleet and each
box's time to ready (its warm's wall time), side by side in one run.

    python -m bench.fleet            # N = 4, the demo's tiny hybrid model (qwen3_5 layout)
    python -m bench.fleet --quick    # N = 4, a tiny llama (what `bench.run --quick` runs)
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

N_BOXES = 4


def _settings(home: Path, server) -> None:
    from bench.weed import ACCESS_KEY, BUCKET, SECRET_KEY

    home.mkdir(parents=True, mode=0o700)
    creds = home / "s3.toml"
    creds.write_text(f'access_key_id = "{ACCESS_KEY}"\nsecret_access_key = "{SECRET_KEY}"\n')
    creds.chmod(0o600)
    (home / "settings.toml").write_text(
        "allow_unsigned = true\n"  # the bench's boxes hold no fleet key (docs/fleet.md)
        f'[remote]\nendpoint = "{server.endpoint}"\nbucket = "{BUCKET}"\nprefix = "bench"\n'
        f'credentials = "{creds}"\n'
    )


def _box(home: Path, manifest, *, remote: bool) -> dict:
    """Warm one box; with the fleet tier, read-through first and upload after (write-behind)."""
    from kvstore.fleet.fetch import WarmFetcher
    from kvstore.fleet.objects import Remote
    from kvstore.fleet.queue import UploadQueue, upload_one
    from kvstore.fleet.remote_settings import remote_settings
    from kvstore.home.ledger import Ledger
    from kvstore.home.settings import load_settings
    from kvstore.ops.warm import warm
    from kvstore.store.store import Store

    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    with Store(home) as store:
        fetch = queue = None
        if remote:
            rs = remote_settings(load_settings(home), home)
            queue = UploadQueue(home)
            fetch = WarmFetcher(Remote(rs), queue, ledger=Ledger(home))
        t = time.perf_counter()
        report = warm(manifest, store, home=home, fetch=fetch)
        ready = time.perf_counter() - t
        upload_s = 0.0
        if remote:  # what the daemon's worker does after the warm, off the ready path
            t = time.perf_counter()
            for key in store.keys():
                queue.add([key])
                upload_one(fetch.remote, store, queue, key)
            upload_s = time.perf_counter() - t
            queue.close()
    return {
        "ready_s": ready,
        "prefill_s": sum(p.seconds for p in report.pins if p.status == "warmed"),
        "prefilled": report.warmed,
        "fetched": report.fetched,
        "present": sum(p.status == "present" for p in report.pins),
        "models_loaded": report.models_loaded,
        "upload_s": upload_s,
    }


def run(quick: bool) -> dict:
    from bench.stages import write_manifest
    from bench.weed import Weed
    from kvstore.pins.manifest import load_manifest
    from kvstore.tiny import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="kvstore-fleet-") as tmp:
        root = Path(tmp)
        # quick: the tiny llama (plain KV, fast to prefill); full: the demo's hybrid model
        model = make_tiny_model(root / "model", "llama" if quick else "qwen3_5")
        manifest = load_manifest(write_manifest(root, model.resolve()))
        server = Weed(root / "weed").start()
        try:
            out = {"n": N_BOXES, "pins": sum(len(m.prefixes) for m in manifest.models)}
            # interleaved per box index, so the machine's state drifts equally on both sides
            local, fleet = [], []
            for i in range(N_BOXES):
                local.append(_box(root / f"local{i}", manifest, remote=False))
                _settings(root / f"fleet{i}", server)
                fleet.append(_box(root / f"fleet{i}", manifest, remote=True))
        finally:
            server.stop()
    for name, boxes in (("local", local), ("fleet", fleet)):
        out[name] = {
            "boxes": boxes,
            "total_prefill_s": sum(b["prefill_s"] for b in boxes),
            "ready_s": [b["ready_s"] for b in boxes],
        }
    rest = fleet[1:]
    out["boxes_2_to_n_prefill_s"] = sum(b["prefill_s"] for b in rest)
    out["boxes_2_to_n_models_loaded"] = sum(b["models_loaded"] for b in rest)
    out["boxes_2_to_n_fetched_all"] = all(b["fetched"] == out["pins"] for b in rest)
    return out


def main() -> int:
    res = run(quick="--quick" in sys.argv)
    print(json.dumps(res, indent=1))
    for name in ("local", "fleet"):
        r = res[name]
        ready = ", ".join(f"{s:.2f}" for s in r["ready_s"])
        print(f"{name:6} total prefill {r['total_prefill_s']:.2f}s; ready per box: {ready}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
