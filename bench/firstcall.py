"""The first `generate` after `kvstore.client.load` against the steady ones: time to first token
of call 1 over the median of calls 2-10, each a new user turn on the same pinned prefix.

A tiny llama (kvstore.tiny, generated here) with one manifest pin of ~330 tokens is warmed into
a home; then new interpreters alternate `kvstore.client.load(warm=True)` (the default: the first
call's one-time costs paid inside load) and `warm=False`, each timing `load` and then ten calls
of `kvstore.client.stream_generate` (max_tokens=1) through the hydrated cache. A tiny model is
the hard case: its forward costs milliseconds, so what only the first call pays shows in full.

Calls 2-10 also reuse the start of the user turn from the calls before ("My invoice ", 9 of the
tiny llama's tokens), which call 1 has to prefill: part of their lead is not a one-time cost.
So each process then repeats call 1's request with its first letter changed (served by the pin
alone, as call 1 was) and reports the first call over those too.

    python -m bench.firstcall
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.timing import fresh_rounds, worker

SYSTEM = (
    "You are the router. "
    + "Classify the request into billing, outage, account or other and answer with JSON only. " * 8
)
CALLS = 10
PIN_ONLY_LETTERS = "ABCDEFGHJ"  # first letters that no other call's user turn starts with
MODES = ("warm", "no warm")  # kvstore.client.load(warm=True), and warm=False


def calls(argv: list[str]) -> dict:
    """One process's `load` and calls (`bench.timing.worker`): load seconds, each call's TTFT."""
    model_path, home, warm = argv[0], argv[1], argv[2] == "1"
    import mlx_lm  # noqa: F401  (imported before the timer, as an app has it)

    from kvstore import client

    t = time.perf_counter()
    model, tokenizer, cache = client.load(model_path, home=home, stats=False, warm=warm)
    load_s = time.perf_counter() - t
    assert cache.report.entries == 1, cache.report

    def ttft(user: str) -> float:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        t = time.perf_counter()
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        for _ in client.stream_generate(cache, model, tokenizer, prompt, max_tokens=1):
            return time.perf_counter() - t
        raise AssertionError("no token")

    ttft_s = [ttft(user_turn(i)) for i in range(CALLS)]
    # then call 1's request again with its first letter changed: served by the pin alone, as
    # call 1 was (calls 2-10 also reuse the user turn's start from the call before)
    pin_ttft_s = [ttft(letter + user_turn(0)[1:]) for letter in PIN_ONLY_LETTERS]
    cache.close()
    return {"load_s": load_s, "ttft_s": ttft_s, "pin_ttft_s": pin_ttft_s}


def user_turn(i: int) -> str:
    return f"My invoice {i * 7919} was charged twice, case {i}"


def _setup(root: Path) -> tuple[Path, Path]:
    from kvstore.home.settings import ensure_home
    from kvstore.ops.warm import warm
    from kvstore.pins.manifest import load_manifest
    from kvstore.store.store import Store
    from kvstore.tiny import make_tiny_model

    model, home = root / "tiny-llama", root / "home"
    make_tiny_model(model, "llama")
    ensure_home(home)
    manifest = root / "manifest.toml"
    manifest.write_text(
        f'[[model]]\npath = "{model}"\n\n[[model.prefix]]\nname = "classify"\n'
        f'messages = [{{ role = "system", content = "{SYSTEM}" }}]\n'
    )
    with Store(home) as store:
        assert warm(load_manifest(manifest), store, home=home).warmed == 1
    return model, home


def summarize(samples: dict[str, list[dict]]) -> dict:
    """Per mode: the first call's TTFT over the median of calls 2-10, per process, and the
    medians over processes; load seconds too."""
    out = {}
    for mode, runs in samples.items():
        ratios = [r["ttft_s"][0] / statistics.median(r["ttft_s"][1:]) for r in runs]
        out[mode] = {
            "processes": len(runs),
            "first_s": statistics.median(r["ttft_s"][0] for r in runs),
            "steady_s": statistics.median(statistics.median(r["ttft_s"][1:]) for r in runs),
            "first_over_steady": statistics.median(ratios),
            "ratios": ratios,
            "load_s": statistics.median(r["load_s"] for r in runs),
        }
        if all(r.get("pin_ttft_s") for r in runs):
            # the first call over steady calls that, like it, reuse only the pin
            pin = [r["ttft_s"][0] / statistics.median(r["pin_ttft_s"]) for r in runs]
            out[mode]["pin_steady_s"] = statistics.median(
                statistics.median(r["pin_ttft_s"]) for r in runs
            )
            out[mode]["first_over_pin_steady"] = statistics.median(pin)
            out[mode]["pin_ratios"] = pin
    return out


def run(quick: bool) -> dict:
    reps = 4 if quick else 8
    with tempfile.TemporaryDirectory(prefix="kvbench-firstcall-") as tmp:
        model, home = _setup(Path(tmp))
        cases = {mode: worker(calls, model, home, int(mode == "warm")) for mode in MODES}
        samples = fresh_rounds(cases, reps=reps)  # round 0 (untimed) fills the page cache
    out = summarize(samples)
    for mode, row in out.items():
        print(
            f"  first generate after client.load ({mode}): {row['first_s'] * 1e3:.1f} ms vs "
            f"steady {row['steady_s'] * 1e3:.1f} ms (x{row['first_over_steady']:.2f}); load "
            f"{row['load_s'] * 1e3:.1f} ms"
            + (
                f"; steady from the pin alone {row['pin_steady_s'] * 1e3:.1f} ms "
                f"(x{row['first_over_pin_steady']:.2f})"
                if "pin_steady_s" in row
                else ""
            ),
            flush=True,
        )
    return out


if __name__ == "__main__":
    print(json.dumps(run("--full" not in sys.argv), indent=1))
