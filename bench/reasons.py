"""What working out a reason costs, and `kvstore explain` over a day of a busy server's ledger.

1. Attribution per request, as the request path pays it (`kvstore.reasons.Attributor`:
   the attribution, the recent prompt kept, the counter), against 8 pins, 512 learned prefixes
   and the 64 recent prompts; a 2,048-token prompt that diverges from a pin at token 14 (the
   costly case: a `diverged` span, its text decoded by a real tokenizer) and one served whole.
2. `kvstore explain --since 1d --json` over 200,000 ledger records with reasons (a day at about
   2.3 requests a second), in a subprocess as a user runs it, three times.
3. The worked example of docs/reasons.md: a pin warmed with yesterday's date, three requests
   with today's through the library, their records in a ledger, `kvstore explain` on it.

    python -m bench.reasons                      # all three, the worked example printed
    python -m bench.run --quick --only reasons   # 1 and 2, as rows of the targets table
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvstore.reasons import RECENT_PROMPTS, Attributor
from kvstore.tokens import pack

PROMPT = 2048
PINS = 8
LEARNED = 512
DAY_RECORDS = 200_000


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def attribution(decode) -> dict[str, float]:
    rng = random.Random(0)
    pins = {tuple(_tokens(rng, 1500)): f"pin{i}" for i in range(PINS)}
    sys_pin = next(iter(pins))
    attr = Attributor()
    attr.learned = sorted(pack(_tokens(rng, rng.randrange(300, 4096))) for _ in range(LEARNED))
    for _ in range(RECENT_PROMPTS):
        attr(_tokens(rng, PROMPT), 0, {})
    diverging = list(sys_pin[:14]) + [7] + list(sys_pin[15:]) + _tokens(rng, PROMPT - 1500)
    served = list(sys_pin) + _tokens(rng, PROMPT - 1500)
    out = {}
    for name, prompt, cached in (("diverged", diverging, 14), ("served", served, 1500)):
        times = []
        for _ in range(2000):
            t0 = time.perf_counter()
            attr(prompt, cached, pins, decode)
            times.append(time.perf_counter() - t0)
        times.sort()
        out[f"{name}: median ms"] = statistics.median(times) * 1e3
        out[f"{name}: p99 ms"] = times[int(0.99 * len(times))] * 1e3
    return out


def explain_a_day() -> list[float]:
    import msgpack

    from kvstore.home.ledger import LEDGER_NAME

    with tempfile.TemporaryDirectory(prefix="kvbench-explain-") as tmp:
        home = Path(tmp)
        now = time.time()
        text = "system\nToday is {}. You are the router. Classify t"
        div = {"reason": "diverged", "tokens": 386, "entry": "router", "stored_length": 400,
               "stored_text": text.format("2026-11-30"),
               "request_text": text.format("2026-12-01")}  # fmt: skip
        with open(home / LEDGER_NAME, "wb") as f:
            for i in range(DAY_RECORDS):
                f.write(msgpack.packb({
                    "model": "/models/router", "label": f"serve:stage{i % 4}",
                    "prompt_tokens": 500, "cached_tokens": 14, "prefilled_tokens": 486,
                    "prefill_s": 0.1, "decode_s": 0.1, "ts": now - i * 0.43,
                    "reasons": [dict(div, position=14 + i % 5),
                                {"reason": "suffix", "tokens": 100}],
                }))  # fmt: skip
        walls = []
        for _ in range(3):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "kvstore", "explain", "--since", "1d", "--json",
                            "--home", str(home)], check=True, capture_output=True)  # fmt: skip
            walls.append(time.perf_counter() - t0)
        return walls


def worked_example() -> str:
    """A pin of a dated system prompt warmed for yesterday, then three requests with today's."""
    from mlx_lm import load

    from kvstore.cli.main import main
    from kvstore.client import PersistentPromptCache, generate
    from kvstore.home.ledger import Ledger, validate
    from kvstore.ops.warm import warm
    from kvstore.pins.manifest import load_manifest
    from kvstore.store.store import Store
    from kvstore.tiny import make_tiny_model

    def system(day: str) -> str:
        return f"You are the support router of Acme. Today is {day}. Classify the request and " \
               "answer with JSON only: category and reason."  # fmt: skip

    with tempfile.TemporaryDirectory(prefix="kvbench-example-") as tmp:
        model_path = make_tiny_model(Path(tmp) / "models" / "router-model", "llama")
        home = Path(tmp) / "home"
        manifest = Path(tmp) / "kvstore.toml"
        pin = f'[{{ role = "system", content = "{system("2026-11-30")}" }}]'
        manifest.write_text(
            f'[[model]]\npath = "{model_path}"\n[[model.prefix]]\nname = "router"\n'
            f"messages = {pin}\n"
        )
        with Store(home) as store:
            warm(load_manifest(manifest), store, home=home)
        model, tokenizer = load(str(model_path))
        with PersistentPromptCache.open(
            model, tokenizer, model_path, home=home, verbose=False
        ) as c:
            for user in ("My invoice 2291 was charged twice.", "Where is my parcel?",
                         "Is the blue shirt in stock?"):  # fmt: skip
                msgs = [{"role": "system", "content": system("2026-12-01")},
                        {"role": "user", "content": user}]  # fmt: skip
                ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
                generate(c, model, tokenizer, ids, label="classify", max_tokens=2)
            recs = [dict(vars(call), reasons=list(call.reasons)) for call in c.stats.calls]
        Ledger(home).append(validate(recs))  # what the daemon does with the records sent to it
        from click.testing import CliRunner

        out = CliRunner().invoke(main, ["explain", "--label", "classify", "--home", str(home)])
        return out.output.replace(str(model_path), "/models/router-model")


def run(quick: bool = True) -> dict:
    """1 and 2 (one size: the day is what a user asks `explain` about)."""
    from mlx_lm.utils import load_tokenizer

    from kvstore.tiny import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="kvbench-reasons-") as tmp:
        tokenizer = load_tokenizer(make_tiny_model(Path(tmp) / "llama", "llama"))
        attr = attribution(tokenizer.decode)
    for what, ms in attr.items():
        print(f"  attribution, {what}: {ms:.4f}", flush=True)
    walls = explain_a_day()
    print(f"  kvstore explain --since 1d --json over {DAY_RECORDS:,} records: "
          + ", ".join(f"{w:.2f} s" for w in walls), flush=True)  # fmt: skip
    return {"attribution_ms": attr, "explain_s": walls, "records": DAY_RECORDS,
            "prompt_tokens": PROMPT, "pins": PINS, "learned": LEARNED}  # fmt: skip


def targets(res: dict) -> list[dict]:
    """bench.run's rows (context: no target is set for them)."""
    a = res["attribution_ms"]
    rows = [
        {"target": f"attribution on the request path, a {res['prompt_tokens']}-token prompt "
                   f"{how} ({res['pins']} pins, {res['learned']} learned prefixes)",
         "measured": round(a[f"{what}: median ms"], 4), "unit": "ms", "ok": None,
         "note": f"p99 {a[f'{what}: p99 ms']:.4f} ms"}
        for what, how in (("diverged", "that diverges inside a pin"),
                          ("served", "served its pin whole"))
    ]  # fmt: skip
    rows.append({
        "target": f"`kvstore explain --since 1d --json` over {res['records']:,} ledger records "
                  "(a new process)",
        "measured": round(statistics.median(res["explain_s"]), 2),
        "unit": "s",
        "ok": None,
        "note": ", ".join(f"{w:.2f}" for w in res["explain_s"]),
    })  # fmt: skip
    return rows


def main() -> None:
    run()
    print("worked example:")
    print(worked_example())
    print(json.dumps({"prompt_tokens": PROMPT, "pins": PINS, "learned": LEARNED,
                      "recent": RECENT_PROMPTS}))  # fmt: skip


if __name__ == "__main__":
    main()
