"""The upgrade canary's tolerance, measured: how far float rounding moves a tiny llama's KV, and how
far a real change of the computation (a RoPE base override) does, as kvstore.warm.canary measures it
(largest per-layer relative RMS difference). The tolerance must sit above the rounding and below the
change: `targets` says whether it does.

    python -m bench.canary_noise
    python -m bench.run --quick --only canary_noise
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

from kvstore.kvcheck.kvdiff import ROUNDOFFS, kv_difference
from kvstore.kvcheck.prefill import prefill
from kvstore.tiny import make_tiny_model

TOKENS = list(range(3, 303))


def run(quick: bool = True) -> dict:
    """Each case's difference from the float32 reference and the tolerance there (one size)."""
    with tempfile.TemporaryDirectory(prefix="kvbench-canary-") as tmp:
        path = str(make_tiny_model(Path(tmp) / "llama", "llama"))
        base, _ = load(path)
        reference = prefill(base, TOKENS)
        out = {}
        for name, dtype in (("float16", mx.float16), ("bfloat16", mx.bfloat16)):
            model, _ = load(path)
            model.set_dtype(dtype)
            diff, tol = kv_difference(prefill(model, TOKENS), reference)
            out[f"whole model rounded to {name}"] = (diff, tol)
        chunked, tol = kv_difference(prefill(base, TOKENS, step=7), reference)
        out["chunked prefill (step 7), float32"] = (chunked, tol)
        other, _ = load(path, model_config={"rope_theta": 1e6})
        out["RoPE base 1e4 -> 1e6, float32"] = kv_difference(prefill(other, TOKENS), reference)
    print(f"tolerance: {ROUNDOFFS} unit roundoffs of the KV dtype")
    for what, (diff, tol) in out.items():
        print(f"  {what:36}: relative RMS {diff:.3g} (tolerance there {tol:.3g})")
    return {k: {"difference": d, "tolerance": t} for k, (d, t) in out.items()}


def targets(res: dict) -> list[dict]:
    """bench.run's rows: float rounding within the tolerance, a real change of the computation
    beyond it."""
    out = []
    for case, r in res.items():
        change = case.startswith("RoPE")
        d, tol = r["difference"], r["tolerance"]
        out.append({
            "target": f"upgrade canary: {case} {'beyond' if change else 'within'} the tolerance "
                      f"({tol:.3g}), tiny llama",
            "measured": float(f"{d:.3g}"),
            "unit": "relative RMS",
            "ok": d > tol if change else d <= tol,
            "note": "",
        })  # fmt: skip
    return out


if __name__ == "__main__":
    run()
