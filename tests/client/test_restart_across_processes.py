"""The restart scenario across real processes: one process warms, a fresh one hydrates and its
first call prefills only the dynamic suffix, with the output of a run without kvstore."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import TWO_PINS, manifest_for

APP = r"""
import json, sys
from mlx_lm import load, generate
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from kvstore.client import hydrate

model_path, home, use_store = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
model, tok = load(model_path)
messages = json.loads(sys.stdin.read())
prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
lru = LRUPromptCache()
report = hydrate(lru, model_path, model_path, home=home, model=model) if use_store else None
cache, rest = lru.fetch_nearest_cache(model_path, prompt)
if cache is None:
    cache, rest = make_prompt_cache(model), prompt
text = generate(model, tok, rest, max_tokens=12, prompt_cache=cache)
print(json.dumps({"prompt": len(prompt), "prefilled": len(rest), "text": text,
                  "entries": report.entries if report else 0}))
"""


def _app(model, home, use_store, messages):
    proc = subprocess.run(
        [sys.executable, "-c", APP, str(model), str(home), "1" if use_store else "0"],
        input=json.dumps(messages),
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "KVSTORE_HOME": str(home)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_prefill_survives_restart(hybrid_path, kv_home, tmp_path):
    manifest = manifest_for(tmp_path, hybrid_path, TWO_PINS)
    warm = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "warm",
            "--manifest",
            str(manifest),
            "--home",
            str(kv_home),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert "2 warmed" in warm.stdout

    from kvstore.pins.manifest import load_manifest

    system = load_manifest(manifest).models[0].prefixes[0].messages[0]["content"]
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Invoice 2291 was charged twice; please fix it."},
    ]
    cold = _app(hybrid_path, kv_home, False, messages)
    hot = _app(hybrid_path, kv_home, True, messages)
    assert hot["entries"] == 2
    assert cold["prefilled"] == cold["prompt"]
    assert 0 < hot["prefilled"] < hot["prompt"] // 3  # only the dynamic suffix
    assert hot["text"] == cold["text"]  # the output does not change
