"""Pipeline replay: the motivating tiers, cold process without kvstore vs restarted process with it.

A tiny qwen3_5 (hybrid: Gated DeltaNet + full attention every 2nd layer, as kvstore.tiny makes it)
stands in for Qwen3.5-9B: hybrid caches cannot be trimmed, so mlx-lm's in-process LRU only reuses
exact transcript prefixes, which is why the motivating pipeline pays the static-prefix tax on every
cold start. Token ids are generated (seeded), not tokenized: the replay needs exact token counts.

Each tier's static stage prefixes are pinned first (prefill + encode + Store.put, as `kvstore warm`
does). Then fresh subprocesses run the tier, alternating: "cold" (empty LRUPromptCache, plain mlx-lm
behaviour) and "kvstore" (kvstore.client.hydrate at start). Each call fetches the nearest cache,
prefills
the rest, decodes greedily and inserts its transcript, as mlx_lm.server does.

Decode length: this CPU prefills only ~3x faster per token than it decodes, where an M-series GPU
prefills ~10-15x faster; the same token counts would give a different time split. So decode tokens
per query are calibrated so that each tier's cold prefill share of model time is the one the seed
measured for that tier (SEED_SHARES: 44% / 47% / 17%), from a probe replay's own rates; prompt
tokens are the motivating ones (divided by 4 in --quick). It runs on the hybrid and on a
plain-attention model (tiny llama, whose trimmable caches mlx-lm's LRU can reuse in-process), and
reports end-to-end model time (prefill + decode), cold against kvstore after a restart, beside the
seed's own change (SEED_CHANGE).

    python -m bench.pipeline [--quick] [--models hybrid,plain] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.timing import fresh_process, fresh_rounds, worker

# the seed's measured cold static-prefix share of model time, and its end-to-end model time with
# kvstore after a restart against cold, per tier
SEED_SHARES = {"standard": 0.44, "agentic": 0.47, "research": 0.17}
SEED_CHANGE = {"standard": -0.34, "agentic": -0.45, "research": -0.24}
MODELS = {"hybrid": "qwen3_5", "plain": "llama"}  # kvstore.tiny architectures
VOCAB = 512


def _ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, n).tolist()  # 0-2: special tokens


def tiers(scale: float) -> dict[str, dict]:
    """Static prefixes and dynamic suffixes; token totals are the motivating ones at scale 1."""

    def s(n: int) -> int:
        return max(1, round(n * scale))

    standard = dict(  # 4 stages: 8,400 static + 480 dynamic = 8,880 (94.6% static)
        calls=[
            dict(static=s(a), suffix=s(b))
            for a, b in [(2150, 90), (2400, 150), (2000, 130), (1850, 110)]
        ],
        chain=False,
    )
    agentic = dict(  # one agent prompt, each call continues the transcript: 5,749 prompt tokens
        calls=[dict(static=s(1187), suffix=s(n)) for n in (85, 60, 60, 61)],
        chain=True,
        tool_call=s(50),  # decode tokens of calls 1-3: tool calls fed to the next call
    )
    research = dict(  # 6 stages twice: 12 x 1,650 static + 2,189 dynamic = 21,989 (90% static)
        calls=[
            dict(static=s(1650), suffix=s(182 + (i % 2 == 1 and i < 11)), stage=i % 6)
            for i in range(12)
        ],
        chain=False,
    )
    out = {"standard": standard, "agentic": agentic, "research": research}
    for t, (name, tier) in enumerate(out.items()):
        for i, c in enumerate(tier["calls"]):
            stage = 0 if tier["chain"] else c.get("stage", i)
            c["static_ids"] = _ids(1000 * t + stage, c["static"])
            c["suffix_ids"] = _ids(10**6 + 1000 * t + i, c["suffix"])
        tier["name"] = name
    return out


def static_tokens(tier: dict) -> int:
    """Static tokens a cold process prefills: each stage prefix once per call (no reuse)."""
    return sum(c["static"] for c in tier["calls"][: 1 if tier["chain"] else None])


# -- the child process ---------------------------------------------------------------------------


def child(model_path: Path, home: Path | None, spec: dict) -> dict:
    t0 = time.perf_counter()
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

    model, _ = load(str(model_path))
    out: dict = {"load_s": time.perf_counter() - t0, "tiers": {}}
    lru = LRUPromptCache(max_size=64)
    if home is not None:
        from kvstore.client import hydrate

        rep = hydrate(lru, "m", model_path, home=home, model=model)
        out["hydrate"] = {
            "entries": rep.entries,
            "tokens": rep.tokens,
            "s": rep.seconds,
            "warning": rep.warning,
        }
    for name, tier in spec["tiers"].items():
        r = dict(
            calls=0,
            prompt_tokens=0,
            prefilled=0,
            pinned_prefilled=0,
            prefill_s=0.0,
            decode_s=0.0,
            decode_tokens=0,
        )
        transcript: list[int] = []
        for i, call in enumerate(tier["calls"]):
            if tier["chain"] and transcript:
                prompt = transcript + call["suffix_ids"]
            else:
                prompt = call["static_ids"] + call["suffix_ids"]
            n_decode = tier["decode"][i]
            t = time.perf_counter()
            cache, rest = lru.fetch_nearest_cache("m", prompt)
            if cache is None:
                cache, rest = make_prompt_cache(model), prompt
            reused = len(prompt) - len(rest)
            logits = model(mx.array(rest)[None], cache=cache)
            y = mx.argmax(logits[:, -1, :], axis=-1)
            mx.eval(y)
            t1 = time.perf_counter()
            tokens = [y.item()]
            for _ in range(n_decode - 1):
                y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
                mx.eval(y)
                tokens.append(y.item())
            t2 = time.perf_counter()
            # the cache now holds prompt + all generated tokens but the last, as in mlx_lm.server
            lru.insert_cache("m", prompt + tokens[:-1], cache, cache_type="assistant")
            transcript = prompt + tokens
            r["calls"] += 1
            r["prompt_tokens"] += len(prompt)
            r["prefilled"] += len(rest)
            if not (tier["chain"] and i):
                r["pinned_prefilled"] += max(0, call["static"] - reused)
            r["prefill_s"] += t1 - t
            r["decode_s"] += t2 - t1
            r["decode_tokens"] += len(tokens)
        out["tiers"][name] = r
        mx.clear_cache()
    return out


# -- the parent ----------------------------------------------------------------------------------


def _warm_and_calibrate(model_path: Path, home: Path, all_tiers: dict) -> dict:
    """Pin every tier's static prefixes; measure this machine's prefill and decode rates."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from kvstore.codec import codec
    from kvstore.home.settings import FILEHASH_NAME, ensure_home
    from kvstore.identity.fingerprint import FileHashCache, describe_cache, model_fingerprint
    from kvstore.kvcheck.prefill import prefill
    from kvstore.store.entry import entry_key, pack_tokens
    from kvstore.store.store import Store

    model, _ = load(str(model_path))
    ensure_home(home)
    layout = tuple(describe_cache(c) for c in make_prompt_cache(model))
    fp = model_fingerprint(
        model_path, layout=layout, hash_cache=FileHashCache(home / FILEHASH_NAME)
    )
    t = time.perf_counter()
    pins = {}
    for tier in all_tiers.values():
        for c in tier["calls"]:
            pins[tuple(c["static_ids"])] = tier["name"]
    with Store(home) as store:
        for ids, label in pins.items():
            cache = prefill(model, list(ids))
            store.put(
                entry_key(fp.digest, ids),
                codec.encode(cache),
                tokens=pack_tokens(ids),
                label=label,
                pinned=True,
                model=str(model_path),
                classes=codec.cache_classes(cache),
            )
    warm_s = time.perf_counter() - t
    # rates: a 1,024-token prefill and 64 decode steps, best of 3
    ids = mx.array(_ids(7, 1024))[None]
    pre, dec = [], []
    for _ in range(3):
        cache = make_prompt_cache(model)
        t = time.perf_counter()
        y = mx.argmax(model(ids, cache=cache)[:, -1, :], axis=-1)
        mx.eval(y)
        pre.append(1024 / (time.perf_counter() - t))
        t = time.perf_counter()
        for _ in range(64):
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
            mx.eval(y)
        dec.append(64 / (time.perf_counter() - t))
    return {"pins": len(pins), "warm_s": warm_s, "prefill_tps": max(pre), "decode_tps": max(dec)}


def _decode_plan(tier: dict, rates: dict, share: float | None = None) -> list[int]:
    """Decode tokens per call so that static prefill is `share` of cold model time (default: the
    seed's share for this tier)."""
    share = SEED_SHARES[tier["name"]] if share is None else share
    static_s = static_tokens(tier) / rates["prefill_tps"]
    dyn = sum(c["suffix"] for c in tier["calls"])  # tool-call tokens are decoded, not here
    decode_s = static_s / share - static_s - dyn / rates["prefill_tps"]
    return _split(tier, round(decode_s * rates["decode_tps"]))


def _recalibrate(tier: dict, probe: dict, share: float | None = None) -> list[int]:
    """Decode tokens per call from a probe's cold replay (bench.timing.worker, short decodes):
    its prefill seconds and seconds per decoded token, so that cold prefill is `share` of model
    time (default: the seed's for this tier). The rates a 1,024-token calibration measures miss
    how prefill chunks and decode contexts of the replay itself cost (a tiny llama's attention)."""
    share = SEED_SHARES[tier["name"]] if share is None else share
    per_token = probe["decode_s"] / probe["decode_tokens"]
    return _split(tier, round(probe["prefill_s"] * (1 / share - 1) / per_token))


def _split(tier: dict, total: int) -> list[int]:
    """`total` decode tokens over a tier's calls."""
    n = len(tier["calls"])
    total = max(n, total)
    if tier["chain"]:  # calls 1..n-1 emit fixed-size tool calls; the last one writes the answer
        tc = tier["tool_call"]
        return [tc] * (n - 1) + [max(tc, total - tc * (n - 1))]
    return [max(1, total // n)] * n


def replay(argv: list[str]) -> dict:
    """One fresh process's replay of every tier (`bench.timing.worker`): MODEL, HOME ("" for the
    cold run: no store), the spec file."""
    model, home, spec = argv
    return child(Path(model), Path(home) if home else None, json.loads(Path(spec).read_text()))


def _equal_decode(row: dict) -> float:
    """The change with decode counted once for both: the same decode tokens are the same work,
    so only the prefill saved counts (decode seconds swing most on a shared machine)."""
    cold = row["cold"]
    return -(cold["prefill_s"] - row["kvstore"]["prefill_s"]) / (
        cold["prefill_s"] + cold["decode_s"]
    )


def _median_rows(runs: dict, name: str) -> dict:
    row = {}
    for mode, results in runs.items():
        per = [res["tiers"][name] for res in results]
        med = {k: statistics.median(p[k] for p in per) for k in per[0]}
        med["prefill_s_range"] = [
            min(p["prefill_s"] for p in per),
            max(p["prefill_s"] for p in per),
        ]
        med["model_s"] = med["prefill_s"] + med["decode_s"]
        med["prefill_share"] = med["prefill_s"] / med["model_s"]
        row[mode] = med
    row["prefill_speedup"] = row["cold"]["prefill_s"] / row["kvstore"]["prefill_s"]
    # end-to-end model time (prefill + decode) after a restart with kvstore, against cold
    row["model_time_change"] = row["kvstore"]["model_s"] / row["cold"]["model_s"] - 1
    row["model_time_change_equal_decode"] = _equal_decode(row)
    row["seed_share"] = SEED_SHARES[name]
    row["seed_change"] = SEED_CHANGE[name]
    return row


def run_model(arch: str, quick: bool) -> dict:
    """One model's replay: pin, calibrate each tier to its seed share, alternate fresh processes."""
    from kvstore.tiny import make_tiny_model

    scale = 0.25 if quick else 1.0
    reps = 2 if quick else 3
    all_tiers = tiers(scale)
    with tempfile.TemporaryDirectory(prefix="kvbench-pipeline-") as tmp:
        root = Path(tmp)
        model_path = make_tiny_model(root / "model", arch).resolve()
        home = root / "home"
        rates = _warm_and_calibrate(model_path, home, all_tiers)
        print(
            f"  pipeline {arch}: pinned {rates['pins']} prefixes in {rates['warm_s']:.1f}s; "
            f"prefill {rates['prefill_tps']:.0f} tok/s, decode {rates['decode_tps']:.0f} tok/s",
            flush=True,
        )
        spec_path = root / "spec.json"
        for tier in all_tiers.values():  # a probe first: the first guess, at most 128 a call
            tier["decode"] = [min(128, d) for d in _decode_plan(tier, rates)]
        spec_path.write_text(json.dumps({"tiers": all_tiers}))
        probe = fresh_process(worker(replay, model_path, "", spec_path))
        for name, tier in all_tiers.items():
            tier["decode"] = _recalibrate(tier, probe["tiers"][name])
        spec_path.write_text(json.dumps({"tiers": all_tiers}))
        cases = {"cold": worker(replay, model_path, "", spec_path),
                 "kvstore": worker(replay, model_path, home, spec_path)}  # fmt: skip
        runs = fresh_rounds(cases, reps=reps, warmup=0)  # alternating, first place rotating
    table = {}
    for name, tier in all_tiers.items():
        row = table[name] = _median_rows(runs, name)
        row["static_share_of_prompt"] = (
            sum(c["static"] for c in tier["calls"]) / row["cold"]["prompt_tokens"]
        )
        for mode in ("cold", "kvstore"):
            m = row[mode]
            print(
                f"  {arch:7} {name:9} {mode:8} calls {m['calls']:3.0f} prompt "
                f"{m['prompt_tokens']:6.0f} prefilled {m['prefilled']:6.0f} (pinned "
                f"{m['pinned_prefilled']:5.0f}) prefill {m['prefill_s']:6.2f}s decode "
                f"{m['decode_s']:6.2f}s share {m['prefill_share']:5.1%}",
                flush=True,
            )
    return {
        "arch": arch,
        "scale": scale,
        "reps": reps,
        "rates": rates,
        "tiers": table,
        "hydrate": [r.get("hydrate", {}) for r in runs["kvstore"]],
        "load_s": {m: [r["load_s"] for r in v] for m, v in runs.items()},
    }


def run(quick: bool, models: tuple[str, ...] = ("hybrid", "plain")) -> dict:
    """Every model's replay; the hybrid's (the seed's model class) also at the top level, as
    bench.run and its plot read it."""
    by_model = {m: run_model(MODELS[m], quick) for m in models}
    first = by_model["hybrid" if "hybrid" in by_model else models[0]]
    return {**first, "models": by_model}


def table(res: dict) -> str:
    """Each model and tier: the cold share it was calibrated to and got, end-to-end model time
    cold and after a restart with kvstore, its change beside the seed's."""
    lines = [
        "| model | tier | cold share (seed) | cold model s | kvstore model s | change | at equal "
        "decode | seed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, r in res["models"].items():
        for name, row in r["tiers"].items():
            c, k = row["cold"], row["kvstore"]
            lines.append(
                f"| {model} ({r['arch']}) | {name} | {c['prefill_share']:.0%} "
                f"({row['seed_share']:.0%}) | {c['model_s']:.2f} | {k['model_s']:.2f} | "
                f"{row['model_time_change']:+.0%} | **{_equal_decode(row):+.0%}** | "
                f"{row['seed_change']:+.0%} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default="hybrid,plain", help="comma-separated: hybrid, plain")
    ap.add_argument("--out", help="write the JSON here (the table goes to stdout)")
    a = ap.parse_args()
    names = tuple(a.models.split(","))
    if unknown := [m for m in names if m not in MODELS]:
        ap.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    out = run(a.quick, names)
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    else:
        print(json.dumps(out, indent=1))
    print(table(out))
