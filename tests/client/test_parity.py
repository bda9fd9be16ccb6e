"""The parity gate passes on honest entries and says no to a doctored one whose checksum is
recomputed (so `kvstore verify` cannot see it)."""

from __future__ import annotations

import json

import mlx.core as mx
from helpers import TWO_PINS, cli, manifest_for

from kvstore.codec import codec
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store


def _setup(tmp_path, home, model_path):
    manifest_path = manifest_for(tmp_path, model_path, TWO_PINS)
    manifest = load_manifest(manifest_path)
    with Store(home) as store:
        assert warm(manifest, store, home=home).warmed == 2
    lines = []
    for prefix, user in zip(
        manifest.models[0].prefixes,
        ["My invoice 2291 was charged twice.", "Plan: refund approved."],
    ):
        lines.append(
            json.dumps(
                {
                    "stage": prefix.name,
                    "messages": [*prefix.messages, {"role": "user", "content": user}],
                }
            )
        )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    return manifest_path, prompts


def _parity(home, manifest, prompts, *extra):
    return cli(
        "parity",
        "--home",
        home,
        "--manifest",
        manifest,
        "--prompts",
        prompts,
        "--max-tokens",
        "8",
        *extra,
    )


def _doctor(home, label: str) -> None:
    """Nudge one layer's values of one entry and store it again with a fresh checksum."""
    with Store(home) as store:
        meta = next(m for m in store.metas() if m.label == label)
        meta, cache = store.load(meta.key, meta.tokens)
        layer = cache[0]
        # 2% of the values' scale on one layer: "subtle", yet far past the gate's tolerance.
        noise = mx.random.normal(layer.values.shape, key=mx.random.key(1)) * 0.02
        layer.values = layer.values + noise.astype(layer.values.dtype)
        mx.eval(layer.values)
        blob = codec.encode(cache, {"model": meta.model, "tokenizer_config": "{}"})
        store.put(
            meta.key,
            blob,
            tokens=meta.tokens,
            label=meta.label,
            pinned=meta.pinned,
            model=meta.model,
            template_hash=meta.template_hash,
            classes=meta.classes,
            extra=meta.extra,
        )


def test_parity_passes_on_honest_entries(llama_path, kv_home, tmp_path):
    manifest, prompts = _setup(tmp_path, kv_home, llama_path)
    res = _parity(kv_home, manifest, prompts, "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["ok"] and len(report["results"]) == 2
    for r in report["results"]:
        assert r["served"] > 0 and r["served"] < r["prompt_tokens"]
        assert r["divergence"] is None and r["tokens"] == r["reference"]
        assert r["max_logit_diff"] <= 1e-3


def test_parity_whole_prompt_reference(hybrid_path, kv_home, tmp_path):
    manifest, prompts = _setup(tmp_path, kv_home, hybrid_path)
    res = _parity(kv_home, manifest, prompts, "--reference", "whole")
    assert res.exit_code == 0, res.output
    assert "classify" in res.output and "FAIL" not in res.output


def test_parity_fails_on_a_doctored_entry(llama_path, kv_home, tmp_path):
    manifest, prompts = _setup(tmp_path, kv_home, llama_path)
    _doctor(kv_home, "classify")
    verify = cli("verify", "--home", kv_home)
    assert verify.exit_code == 0, verify.output  # the checksum cannot see it ...
    res = _parity(kv_home, manifest, prompts)
    assert res.exit_code != 0  # ... the gate does
    assert "parity failed for 1 of 2 prompts" in res.output
    assert "classify (line 1)" in res.output
    assert "synthesize (line" not in res.output.split("parity failed")[1]
    assert "diverge at generated token" in res.output or "logits differ by" in res.output


def test_parity_fails_when_nothing_is_stored(llama_path, kv_home, tmp_path):
    manifest, prompts = _setup(tmp_path, kv_home, llama_path)
    res = _parity(tmp_path / "empty", manifest, prompts)
    assert res.exit_code != 0
    assert "no stored entry serves this prompt" in res.output


def test_bad_prompts_file_is_one_line_error(llama_path, kv_home, tmp_path):
    manifest, prompts = _setup(tmp_path, kv_home, llama_path)
    prompts.write_text('{"stage": "x"}\n')
    res = _parity(kv_home, manifest, prompts)
    assert res.exit_code == 1
    assert f'{prompts}:1: needs a "messages" list' in res.output


def test_compare_finds_the_first_divergence():
    from kvstore.client.parity import compare

    logits = [mx.array([[0.0, 1.0]]), mx.array([[2.0, 0.0]]), mx.array([[0.0, 5.0]])]
    near = [x + 0.001 for x in logits]
    other = [logits[0], mx.array([[0.0, 2.5]]), mx.array([[9.0, 0.0]])]
    same = compare(([1, 0, 1], logits), ([1, 0, 1], near))
    assert same.divergence is None and abs(same.max_logit_diff - 0.001) < 1e-6
    # logits after the divergence are ignored: their histories differ
    flip = compare(([1, 0, 1], logits), ([1, 1, 0], other))
    assert flip.divergence == 1 and flip.worst_step == 1 and flip.max_logit_diff == 2.5
    assert compare(([1, 0], logits[:2]), ([1], logits[:1])).divergence == 1
