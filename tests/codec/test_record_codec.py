"""Record blobs: a cache assembled from records equals a fresh prefill, array for array."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.utils import load_model

from kvstore.errors import CodecError
from kvstore.learned.blockstore import BlockStore
from kvstore.learned.chain import cuts
from kvstore.learned.records import assemble, inspect, slice_record, sliceable
from kvstore.store.store import Store
from tests.helpers import assert_same_kv, mlx_lm_prefill

FP = bytes(range(16))
QUANT = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}  # head_dim 32


@pytest.fixture(scope="module")
def llama(llama_path: Path):
    return load_model(llama_path)[0]


@pytest.mark.parametrize("quant", [None, QUANT], ids=["kv", "quantized"])
def test_assembled_from_records_equals_prefill(llama, tmp_path, quant):
    tokens = [(7 * i + 3) % 200 + 1 for i in range(600)]
    full = mlx_lm_prefill(llama, tokens, quant)
    assert sliceable(full)
    with Store(tmp_path) as store:
        blocks = BlockStore(store)
        records = [(s, e, slice_record(full, s, e)) for s, e in cuts(0, 600)]
        assert blocks.put_records(FP, tokens, records, label="t") == sum(
            len(b) for *_, b in records
        )
        # a request that diverges inside the last record is served up to the divergence
        request = tokens[:550] + [9999, 9998]
        chain = blocks.lookup(FP, request)
        assert [(m.start, m.end) for m in chain] == cuts(0, 600)
        served = blocks.served(chain, request)
        assert served == 550
        cache = assemble(blocks.read_blobs(chain), chain, served, make_prompt_cache(llama))
    assert_same_kv(cache, mlx_lm_prefill(llama, tokens[:550], quant))
    # and it continues like the original
    nxt = mx.array([[5, 6, 7]])
    ref = mlx_lm_prefill(llama, tokens[:550], quant)
    assert mx.allclose(llama(nxt, cache=cache), llama(nxt, cache=ref)).item()


def test_inspect_refuses_what_is_not_a_record():
    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 2, 10, 4)), mx.zeros((1, 2, 10, 4)))
    blob = slice_record([c], 0, 10)
    assert inspect(blob, 10) == ["KVCache"]
    with pytest.raises(CodecError, match="holds 10 positions"):
        inspect(blob, 9)
    with pytest.raises(CodecError):
        inspect(blob[:-3], 10)


def test_a_put_of_a_state_only_snapshot_must_name_empty_kv_layers():
    """kvstore.ops.put.check_kv: a state-only snapshot (extra.kv_layers) is checked on its other
    layers; a kv_layers that names a layer holding KV is refused (it would be dropped unseen)."""
    import mlx.core as mx
    import pytest
    from mlx_lm.models.cache import ArraysCache, KVCache

    from kvstore.codec import codec
    from kvstore.learned.records import state_part
    from kvstore.ops.put import check_kv
    from kvstore.wire.messages import PutRequest

    kv = KVCache()
    kv.update_and_fetch(mx.ones((1, 2, 5, 8)), mx.ones((1, 2, 5, 8)))
    state = ArraysCache(size=2)
    state[0], state[1] = mx.ones((1, 3, 8)), mx.ones((1, 2, 4, 4))
    tokens = bytes(4 * 5)

    def req(blob: bytes, layers: list) -> PutRequest:
        return PutRequest(key=b"k", fields={"tokens": tokens, "extra": {"kv_layers": layers}})

    ok = codec.encode(state_part([kv, state], [0]))
    check_kv(req(ok, [0]), ok)
    whole = codec.encode([kv, state])
    with pytest.raises(ValueError, match="kv_layers"):
        check_kv(req(whole, [0]), whole)
    with pytest.raises(ValueError, match="holds 0 tokens|disagree"):
        check_kv(req(ok, []), ok)  # without kv_layers, an empty KV layer is a short entry
