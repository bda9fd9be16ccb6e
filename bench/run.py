"""Run the benchmarks and write JSON + PNG plots to bench/results/.

    python -m bench.run --quick                 # under three minutes on a 2-core box
    python -m bench.run --full                  # the full sizes (up to 1 GiB), ~15 minutes
    python -m bench.run --quick --only hydrate,persist
    python -m bench.run --quick --reference     # also refresh bench/results/reference/

Every comparison inside a module runs its alternatives interleaved in this one process (the
pipeline replay alternates fresh subprocesses); `summary.json` lists each target and its measure.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
MODULES = (
    "coldstart", "overlap", "hydrate", "pipeline", "scaling", "fingerprint", "persist", "fleet",
    "startup",
)  # fmt: skip


def _largest(rows: list[dict], **match) -> dict:
    sel = [r for r in rows if all(r[k] == v for k, v in match.items())]
    return max(sel, key=lambda r: r["nbytes"])


def targets(res: dict) -> list[dict]:
    """Each target with its measured value; `ok` is None where the module did not run."""
    out = []

    def add(name, value, unit, ok, note=""):
        out.append({"target": name, "measured": value, "unit": unit, "ok": ok, "note": note})

    if c := res.get("coldstart"):
        for r in c["rows"]:
            x = r["kvstore_vs_load_prompt_cache"]
            add(
                f"first hydrate in a fresh process >= load_prompt_cache (aim 2x): {r['shape']}, "
                f"{r['size_mb']} MB",
                round(x, 2),
                "x",
                x >= 1,
                f"wall; CPU-time ratio {r['cpu_ratio']:.2f}x",
            )
    if o := res.get("overlap"):
        x = o["client_load_vs_mlx_lm_load"]
        add(
            f"kvstore.client.load within 5% of mlx_lm.load "
            f"({o['weights_bytes'] / 2**30:.2f} GiB weights, "
            f"{o['entries_bytes'] / 2**30:.2f} GiB hydrated)",
            round(x, 3),
            "x",
            x <= 1.05,
            f"load then hydrate: {o['sequential_vs_mlx_lm_load']:.3f}x",
        )
    if h := res.get("hydrate"):
        for shape in sorted({r["shape"] for r in h["rows"]}):
            r = _largest(h["rows"], shape=shape, regime="reused")
            x = r["hydrate_vs_load_prompt_cache"]
            add(
                f"steady state, end to end (kvstore.client.hydrate) >= load_prompt_cache (aim 2x): "
                f"{shape}, {r['size_mb']} MB",
                round(x, 2),
                "x",
                x >= 1,
            )
        for k, ms in h.get("fixed_cost_ms", {}).items():
            add(f"fixed cost per entry <= 0.2 ms: {k}", round(ms, 3), "ms", ms <= 0.2)
        for regime in ("fresh", "reused"):
            for shape in sorted({r["shape"] for r in h["rows"]}):
                r = _largest(h["rows"], shape=shape, regime=regime)
                tag = f"{shape}, {r['size_mb']} MB, {regime} buffers"
                x = r["kvstore_vs_load_prompt_cache"]
                add(f"hydrate >= load_prompt_cache (aim 2x): {tag}", round(x, 2), "x", x >= 1)
                g = r["gbps"]["kvstore"]
                add(f"hydrate >= 4 GB/s: {tag}", round(g, 2), "GB/s", g >= 4)
    if p := res.get("pipeline"):
        for name, row in p["tiers"].items():
            k = row["kvstore"]
            add(
                f"pinned tokens prefilled after restart: {name}",
                k["pinned_prefilled"],
                "tokens",
                k["pinned_prefilled"] == 0,
            )
            ok = k["prefill_share"] <= 0.05 if name in ("standard", "agentic") else None
            add(
                f"prefill share after restart <= 5%: {name}",
                round(k["prefill_share"], 4),
                "share",
                ok,
                "target applies to standard and agentic",
            )
    if f := res.get("fingerprint"):
        w = f["warm, layout from config"]["median"]
        add("fingerprint 8 GiB warm <= 0.3 s (layout from config)", round(w, 4), "s", w <= 0.3)
        w = f["warm, layout from loaded model"]["median"]
        add("fingerprint 8 GiB warm <= 0.3 s (layout from model)", round(w, 4), "s", w <= 0.3)
        add(
            "fingerprint 8 GiB cold (context, reads every byte)",
            round(f["cold"]["median"], 2),
            "s",
            None,
            "sparse files: a lower bound for a real disk",
        )
    if s := res.get("scaling"):
        for k, v in s["admin_10k"].items():
            if "new process" in k:
                add(f"`kvstore {k}` (context: interpreter start)", round(v["median"], 3), "s", None)
            else:
                add(
                    f"`kvstore {k}` at 10,000 entries <= 1 s",
                    round(v["median"], 3),
                    "s",
                    v["median"] <= 1,
                )
        o = s["vs_population"]["10000 entries"]["overhead"]
        add(
            "hydrate overhead from 10,000 other-model entries <= 5%",
            round(o, 4),
            "fraction",
            o <= 0.05,
        )
    if pe := res.get("persist"):
        for r in pe["rows"]:
            m = r["stats"]["PersistentPromptCache._persist"]["median"] * 1e3
            add(
                f"request-path persist <= 5 ms: PersistentPromptCache, {r['shape']} "
                f"{r['nbytes'] / 2**20:.0f} MB",
                round(m, 3),
                "ms",
                m <= 5,
            )
    if fl := res.get("fleet"):
        add(
            f"fleet: boxes 2..{fl['n']} ready with zero prefill after box 1 warmed",
            round(fl["boxes_2_to_n_prefill_s"], 3),
            "s",
            fl["boxes_2_to_n_prefill_s"] == 0 and fl["boxes_2_to_n_models_loaded"] == 0,
        )
        ratio = fl["fleet"]["total_prefill_s"] / fl["local"]["total_prefill_s"]
        add(f"fleet: total prefill with / without the remote tier ({fl['n']} boxes)",
            round(ratio, 3), "ratio", None, "ideal 1/N: only box 1 prefills")  # fmt: skip
    if st := res.get("startup"):
        x = st["ratios"]["kvstore ls (empty home)"]
        add("`kvstore ls` on an empty home <= 2x `import lmdb, click` (fresh processes)",
            round(x, 2), "x", x <= 2)  # fmt: skip
        x = st["ratios"]["kvstore --help"]
        add("`kvstore --help` vs `import lmdb, click` (fresh processes)", round(x, 2), "x", None,
            "loads every command, the daemon's and client's too")  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quick", action="store_true")
    mode.add_argument("--full", action="store_true")
    ap.add_argument("--only", default=",".join(MODULES), help="comma-separated modules")
    ap.add_argument("--reference", action="store_true", help="copy summary + plots to reference/")
    args = ap.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from bench import plots

    tag = "quick" if args.quick else "full"
    out_dir = RESULTS / tag
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {}
    meta = {
        "mode": tag,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "python": sys.version,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "seconds": {},
    }
    for name in args.only.split(","):
        if name not in MODULES:
            ap.error(f"unknown module {name!r}; choose from {', '.join(MODULES)}")
        print(f"== {name}", flush=True)
        t = time.perf_counter()
        res[name] = importlib.import_module(f"bench.{name}").run(args.quick)
        meta["seconds"][name] = round(time.perf_counter() - t, 1)
    figs = {
        "hydrate": plots.hydrate_plot,
        "pipeline": plots.pipeline_plot,
        "scaling": plots.scaling_plot,
    }
    written = []
    for name, fn in figs.items():
        if name in res:
            fn(res[name], out_dir / f"{name}.png")
            written.append(out_dir / f"{name}.png")
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, **res}, indent=1))
    summary = {"meta": meta, "targets": targets(res)}
    if "pipeline" in res:
        summary["pipeline"] = {
            t: {
                m: {
                    k: row[m][k]
                    for k in (
                        "calls",
                        "prompt_tokens",
                        "prefilled",
                        "pinned_prefilled",
                        "prefill_s",
                        "decode_s",
                        "prefill_share",
                    )
                }
                for m in ("cold", "kvstore")
            }
            for t, row in res["pipeline"]["tiers"].items()
        }
        summary["pipeline_scale"] = res["pipeline"]["scale"]
        summary["pipeline_rates"] = res["pipeline"]["rates"]
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\n== targets ({tag})")
    for t in summary["targets"]:
        mark = {True: "ok  ", False: "MISS", None: "    "}[t["ok"]]
        print(f"  {mark} {t['target']}: {t['measured']} {t['unit']}")
    print(
        f"\nwrote {out_dir}/results.json, summary.json, {len(written)} plots "
        f"in {sum(meta['seconds'].values()):.0f}s"
    )
    if args.reference:
        ref = RESULTS / "reference"
        ref.mkdir(exist_ok=True)
        shutil.copy(out_dir / "summary.json", ref / "summary.json")
        for p in written:
            shutil.copy(p, ref / p.name)
        print(f"refreshed {ref}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
