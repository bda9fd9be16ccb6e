"""Run the benchmarks and write JSON + PNG plots to bench/results/.

    python -m bench.run --quick                 # about 4-5 minutes on a shared 2-core box
    python -m bench.run --full                  # the full sizes (up to 1 GiB), ~15 minutes
    python -m bench.run --quick --only hydrate,persist
    python -m bench.run --quick --reference     # also refresh bench/results/reference/
    KVSTORE_PEER_VENV=V KVSTORE_RAPID_VENV=R python -m bench.run --quick --only peer --out peer
    python -m bench.run --quick --only peer_crash,peer_change --out peer  # crash, changed model

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
    "startup", "learned", "firstreq", "firstcall", "fleet_trust", "reasons", "canary_noise", "peer",
    "peer_crash", "peer_change", "soak",
)  # fmt: skip
# run only when named (`make bench-peer`): the peers (vllm-mlx, Rapid-MLX) in venvs of their own
OPT_IN = ("peer", "peer_crash", "peer_change")


def _largest(rows: list[dict], **match) -> dict:
    sel = [r for r in rows if all(r[k] == v for k, v in match.items())]
    return max(sel, key=lambda r: r["nbytes"])


def targets(res: dict) -> list[dict]:
    """Each target with its measured value; `ok` is None where the module did not run."""
    out = []

    def add(name, value, unit, ok, note=""):
        out.append({"target": name, "measured": value, "unit": unit, "ok": ok, "note": note})

    if o := res.get("overlap"):
        x = o["client_load_vs_mlx_lm_load"]
        add(
            f"kvstore.client.load within 5% of mlx_lm.load "
            f"({o['weights_bytes'] / 2**30:.2f} GiB weights, "
            f"{o['entries_bytes'] / 2**30:.2f} GiB hydrated)",
            round(x, 3),
            "x",
            x <= 1.05,
            f"load then hydrate: {o['sequential_vs_mlx_lm_load']:.3f}x; load, then only touching "
            f"as many new bytes: {o['touch_floor_vs_mlx_lm_load']:.3f}x",
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
    if le := res.get("learned"):
        out.extend(learned_targets(le))
    if "firstreq" in res:  # issue 22: each pinned stage's first request after a restart
        out.extend(own_targets("firstreq", res))
    out.extend(restart_targets(res))
    for name in ("fleet_trust", "reasons", "canary_noise", "peer", "peer_crash", "peer_change",
                 "soak"):  # fmt: skip
        out.extend(own_targets(name, res))
    return out


def own_targets(name: str, res: dict) -> list[dict]:
    """The rows a module builds from its result with its own `targets`, if it ran."""
    return importlib.import_module(f"bench.{name}").targets(res[name]) if name in res else []


def _floor_note(stats: dict) -> str:
    """What faulting in the entry's new pages alone took (bench.coldstart's `fresh pages`)."""
    if "fresh pages" not in stats or "kvstore" not in stats:
        return ""
    floor, kv = stats["fresh pages"]["median"], stats["kvstore"]["median"]
    return f"; faulting in as many new pages alone {floor * 1e3:.1f} ms of kvstore's {kv * 1e3:.1f}"


def restart_targets(res: dict) -> list[dict]:
    """Issue 22's targets for the library side of a restart: the first hydrate of a new process
    and a long-lived one against load_prompt_cache, kvstore.client.load against mlx_lm.load, the
    first generate after it against the steady ones."""
    from bench.coldstart import target

    out = []

    def add(name, value, unit, ok, note=""):
        out.append({"target": name, "measured": value, "unit": unit, "ok": ok, "note": note})

    if c := res.get("coldstart"):
        quick = max(r["size_mb"] for r in c["rows"]) < 1024
        for r in c["rows"]:
            x, aim = r["kvstore_vs_load_prompt_cache"], target(r["size_mb"])
            add(
                f"first hydrate in a fresh process >= {aim}x load_prompt_cache: {r['shape']}, "
                f"{r['size_mb']} MB",
                round(x, 2),
                "x",
                x >= aim,
                f"ratio of medians (wall); pair by pair {r['pairwise']['median']:.2f}x "
                f"[{r['pairwise']['min']:.2f}-{r['pairwise']['max']:.2f}]; CPU time "
                f"{r['cpu_ratio']:.2f}x"
                + _floor_note(r.get("stats", {}))
                + ("; quick: no 1 GiB row (--full)" if quick else ""),
            )
            if "fresh pages" in r.get("stats", {}):  # what any loader pays first: the floor
                st = r["stats"]
                x = st["kvstore"]["median"] / st["fresh pages"]["median"]
                add(
                    f"first hydrate in a fresh process over its floor (faulting in as many new "
                    f"pages, nothing copied): {r['shape']}, {r['size_mb']} MB",
                    round(x, 2),
                    "x",
                    None,
                    f"kvstore {st['kvstore']['median'] * 1e3:.1f} ms, load_prompt_cache "
                    f"{st['load_prompt_cache']['median'] * 1e3:.1f} ms, fresh pages "
                    f"{st['fresh pages']['median'] * 1e3:.1f} ms",
                )
    if h := res.get("hydrate"):
        for r in h["rows"]:
            if r["regime"] != "reused" or r["size_mb"] < 16:
                continue
            x = r["hydrate_vs_load_prompt_cache"]
            add(
                f"long-lived process, kvstore.client.hydrate >= 1.0x load_prompt_cache from 16 MB: "
                f"{r['shape']}, {r['size_mb']} MB",
                round(x, 2),
                "x",
                x >= 1,
                "end to end, repeated in one interpreter (allocations recycled)",
            )
    if o := res.get("overlap"):
        add(
            "load, then hydrate (no overlap) vs mlx_lm.load (context for kvstore.client.load)",
            round(o["sequential_vs_mlx_lm_load"], 3),
            "x",
            None,
            f"kvstore.client.load read the entries {o.get('mode', 'beside the load')}",
        )
    if fc := res.get("firstcall"):
        row = fc["warm"]
        x = row["first_over_steady"]
        add(
            "first generate after kvstore.client.load <= 1.1x a steady one (TTFT, tiny llama, "
            "one pin)",
            round(x, 2),
            "x",
            x <= 1.1,
            f"{row['first_s'] * 1e3:.1f} vs {row['steady_s'] * 1e3:.1f} ms; without load's "
            f"warm-up {fc['no warm']['first_over_steady']:.2f}x; the warm-up costs load "
            f"{(row['load_s'] - fc['no warm']['load_s']) * 1e3:.1f} ms"
            + (
                f"; {row['first_over_pin_steady']:.2f}x a steady call served by the pin alone"
                if "first_over_pin_steady" in row
                else ""
            ),
        )
    return out


def learned_targets(le: dict) -> list[dict]:
    """Issue 18's targets from bench.learned's figures."""
    out = []

    def add(name, value, unit, ok, note=""):
        out.append({"target": name, "measured": value, "unit": unit, "ok": ok, "note": note})

    for r in le["restart"].values():
        m = r["model"]
        x = r["stages_min_served_fraction"]
        add(
            f"after a restart (kill -9, no manifest), first request of each of 3 stages served "
            f">= 99% of its shared prefix: {m}, kvstore serve",
            round(x, 4),
            "fraction",
            x >= 0.99,
            "cached/shared tokens per stage: "
            + ", ".join(
                f"{k} {v['cached_tokens']}/{v['shared_tokens']}" for k, v in r["stages"].items()
            ),
        )
        c = r["chat_next_turn"]
        x = c["served_over_prev_prompt"]
        add(
            f"chat interrupted by a restart: turn {c['turn']} served >= turn {c['turn'] - 1}'s "
            f"whole prompt: {m}",
            round(x, 4),
            "x",
            x >= 1,
            f"{c['cached_tokens']} cached of {c['prev_prompt_tokens']}",
        )
        b = r["bytes"]
        trimmable = b["kind"] == "block records"
        x = b["stored_over_final_kv"]
        add(
            f"{r['turns']}-turn chat stores <= 1.1x its final prompt's KV"
            + ("" if trimmable else " + max_snapshots_per_prefix states")
            + f": {m} ({b['kind']})",
            round(x, 3),
            "x",
            x <= 1.1,
        )
        if "written_over_added" in b:  # a state layout (issue 24)
            x = b["written_over_added"]
            add(
                f"bytes written per learned turn <= 1.15x its new tokens' KV + one state: {m}",
                None if x is None else round(x, 3),
                "x",
                None if x is None else x <= 1.15,
                f"{b['snapshots_written']} snapshots written, {b['written_bytes']} bytes in all",
            )
        x = b.get("written_per_learned_token_over_kv")
        if x is not None:
            add(
                f"bytes written per learned token <= 1.1x KV per token: {m} ({b['kind']})",
                round(x, 3),
                "x",
                x <= 1.1 if trimmable else None,
            )
        add(
            f"learned KV acknowledged after the last request: {m}",
            r["ack_after_last_request_s"],
            "s",
            None,
            "issue: within a few seconds",
        )
    rs = le["restore"]
    tag = f"{rs['model']}, {rs['prefix_tokens']} tokens"
    x = rs["restore_over_memory_copy"]
    add(
        f"restore from the store <= 1.5x LRUPromptCache's in-memory copy (literal): {tag}",
        round(x, 2),
        "x",
        x <= 1.5,
        f"{rs['restore_s'] * 1e3:.2f} ms vs {rs['memory_copy_s'] * 1e3:.3f} ms: mlx-lm's copy is "
        "a deepcopy sharing immutable buffers; the restore reads and builds the arrays",
    )
    x = rs["ttft_store_over_memory"]
    add(
        f"time to first token served from the store <= 1.5x from memory: {tag}",
        round(x, 3),
        "x",
        x <= 1.5,
        f"{rs['ttft_store_s'] * 1e3:.1f} vs {rs['ttft_memory_s'] * 1e3:.1f} ms, "
        f"{rs['turn_tokens']}-token new turn",
    )
    x = rs["prefill_over_restore"]
    add(
        f"restore >= 10x faster than prefilling the prefix: {tag}",
        round(x, 1),
        "x",
        x >= 10,
        f"time to first token: prefill {rs['ttft_prefill_s'] * 1e3:.0f} ms, store "
        f"{rs['ttft_store_s'] * 1e3:.1f} ms",
    )
    rp = le["report"]
    x = rp["request_path_ms"]
    add(
        f"reporting a request's chain adds <= 1 ms to a {rp['tokens']}-token request: "
        f"{rp['model']}",
        round(x, 4),
        "ms",
        x <= 1 if rp["tokens"] >= 8192 else None,
        f"request path (fetched + inserted); the daemon's chain hash "
        f"{rp['daemon_chain_hash_ms']:.3f} ms, off the path",
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quick", action="store_true")
    mode.add_argument("--full", action="store_true")
    ap.add_argument("--only", default=",".join(m for m in MODULES if m not in OPT_IN),
                    help="comma-separated modules")  # fmt: skip
    ap.add_argument("--reference", action="store_true", help="copy summary + plots to reference/")
    ap.add_argument("--out", help="folder under bench/results (default: quick or full)")
    args = ap.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from bench import plots

    tag = "quick" if args.quick else "full"
    out_dir = RESULTS / (args.out or tag)
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
