"""Fingerprint of a multi-gigabyte model directory, cold (no hash cache: reads every byte once) and
warm (hashes cached by file identity: a few stat calls). The weights are sparse files with valid
safetensors headers, so the cold number is a page-cache/zero-page read, a lower bound: a real
first run reads the weights from disk at the disk's speed (and mlx_lm.load reads them anyway)."""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

from bench.timing import Stats, interleave, once
from kvstore.identity.fingerprint import FileHashCache, model_fingerprint

GB = 2**30
# Qwen3.5-9B's text config: the cache layout is derived from it when no loaded model is passed
CONFIG = dict(
    model_type="qwen3_5",
    text_config=dict(
        model_type="qwen3_5_text",
        hidden_size=4096,
        num_hidden_layers=32,
        intermediate_size=12288,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=248320,
        linear_num_value_heads=32,
        linear_num_key_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        tie_word_embeddings=False,
    ),
)


def make_model_dir(root: Path, total_bytes: int, shards: int = 4) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(CONFIG))
    per = total_bytes // shards
    for i in range(shards):
        data = per - 4096
        header = json.dumps({"w": {"dtype": "U8", "shape": [data], "data_offsets": [0, data]}})
        header = header.encode().ljust(4096 - 8)
        path = root / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            f.truncate(per)  # sparse: no disk blocks, reads return zeros
    return root


def run(quick: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvbench-fp-") as tmp:
        root = Path(tmp)
        model = make_model_dir(root / "model", 8 * GB)
        cache_file = root / "filehash.msgpack"

        def cold():
            cache_file.unlink(missing_ok=True)
            return model_fingerprint(model, hash_cache=FileHashCache(cache_file))

        cold_s = [once(cold) for _ in range(1 if quick else 3)]
        layout = model_fingerprint(model, hash_cache=FileHashCache(cache_file)).layout

        def warm_config():  # layout derived from config.json (no loaded model)
            return model_fingerprint(model, hash_cache=FileHashCache(cache_file))

        def warm_model():  # layout given, as kvstore.client.hydrate(model=...) passes it
            return model_fingerprint(model, layout=layout, hash_cache=FileHashCache(cache_file))

        warm = interleave(
            {"warm, layout from config": warm_config, "warm, layout from loaded model": warm_model},
            reps=7,
        )
    out = {"model_bytes": 8 * GB, "cold": Stats.of(cold_s).to_json()}
    out["cold"]["gbps"] = 8 * GB / out["cold"]["median"] / 1e9
    out.update({k: v.to_json() for k, v in warm.items()})
    for k, v in out.items():
        if isinstance(v, dict):
            print(f"  fingerprint 8 GiB {k:32}: {v['median']:.4f} s")
    return out
