"""`kvstore ls --learned` and `kvstore export` of a learned record: the chain up to it, assembled
from its blocks into one file mlx-lm loads, with the KV of a fresh prefill of its tokens."""

from __future__ import annotations

import json

import mlx.core as mx
from helpers import assert_same_kv, cli, mlx_lm_prefill
from mlx_lm import load
from mlx_lm.models.cache import load_prompt_cache

from kvstore.learned.blockstore import BlockStore
from kvstore.learned.chain import cuts
from kvstore.learned.records import slice_record
from kvstore.store.store import Store

FP = bytes(range(16))


def learn(home, model_path, tokens: list[int], start: int = 0) -> None:
    """Records [start, len(tokens)) of a real prefill, put as the daemon puts them."""
    model, _ = load(str(model_path))
    cache = mlx_lm_prefill(model, tokens)
    rows = [(s, e, slice_record(cache, s, e)) for s, e in cuts(start, len(tokens))]
    with Store(home) as store:
        BlockStore(store).put_records(FP, tokens, rows, label="learned",
                                      extra={"model": str(model_path)})  # fmt: skip


def test_export_of_a_learned_record_loads_in_mlx_lm(llama_path, kv_home, tmp_path):
    tokens = [(7 * i) % 500 + 3 for i in range(600)]
    turn = tokens[:300]  # an earlier turn's records, then the next turn adds its own
    learn(kv_home, llama_path, turn)
    learn(kv_home, llama_path, tokens, start=300)
    listed = json.loads(cli("ls", "--learned", "--json", code=0).output)
    assert {r["kind"] for r in listed} == {"learned"}
    assert sorted((r["start"], r["end"]) for r in listed) == [
        (0, 256), (256, 300), (300, 512), (512, 600)
    ]  # fmt: skip
    ends = [r for r in listed if r["chain_end"]]
    assert [(r["end"], r["model"]) for r in ends] == [(600, str(llama_path))]
    table = cli("ls", "--learned", code=0).output
    assert "4 learned records" in table and ends[0]["key"][32:44] in table
    assert "0 entries" in cli("ls", code=0).output  # plain ls: entries only, unchanged

    model, _ = load(str(llama_path))
    for end, want in ((600, tokens), (300, turn)):  # the chain's end, and a record inside it
        (rec,) = [r for r in listed if r["end"] == end]
        out = tmp_path / f"learned{end}.safetensors"
        said = cli("export", rec["key"][32:44], out, code=0).output  # the short form ls shows
        assert f"{end} tokens" in said and "learned records" in said
        cache, meta = load_prompt_cache(str(out), return_metadata=True)
        assert meta["model"] == str(llama_path)
        assert json.loads(meta["token_ids"]) == want  # `kvstore import FILE` needs no --tokens
        assert cache[0].offset == end
        assert_same_kv(cache, mlx_lm_prefill(model, want))
        mx.clear_cache()


def test_export_of_a_learned_record_says_what_is_missing(llama_path, kv_home, tmp_path):
    tokens = [(5 * i) % 500 + 3 for i in range(400)]
    learn(kv_home, llama_path, tokens)
    with Store(kv_home) as store:
        blocks = BlockStore(store)
        first, last = sorted(blocks.records(), key=lambda r: r.end)
        blocks.delete([first.key])
    out = tmp_path / "x.safetensors"
    said = cli("export", last.key.hex(), out, code=1).output
    assert "record before it is missing" in said and not out.exists()
    said = cli("export", "ffff" * 8, out, code=1).output
    assert "matches no entry" in said
