"""Prompt caches of realistic shapes built directly with mx.random: no model is needed to measure
moving their bytes. Bytes per token are those of the models named, so readers can look up theirs."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

MB = 2**20


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: mx.Dtype
    attn_every: int = 1  # hybrid: one full-attention (KVCache) layer in this many
    # hybrid linear-attention state (Qwen3.5 Gated DeltaNet): conv (1, k-1, conv_dim), recurrent
    # (1, v_heads, v_dim, k_dim) kept in float32 by mlx-lm
    conv_dim: int = 0
    conv_keep: int = 3
    v_heads: int = 0
    k_dim: int = 128
    v_dim: int = 128

    @property
    def kv_layers(self) -> int:
        return self.layers // self.attn_every

    @property
    def bytes_per_token(self) -> int:
        return self.kv_layers * 2 * self.kv_heads * self.head_dim * self.dtype.size

    @property
    def fixed_bytes(self) -> int:
        """State that does not grow with the prefix (linear-attention layers)."""
        linear = self.layers - self.kv_layers
        conv = self.conv_keep * self.conv_dim * self.dtype.size
        return linear * (conv + self.v_heads * self.v_dim * self.k_dim * 4)

    def tokens_for(self, nbytes: int) -> int:
        return max(1, (nbytes - self.fixed_bytes) // self.bytes_per_token)


# 28 layers x 8 KV heads x 128 (Qwen2.5-7B / Llama-3-8B-like), 36 layers bf16 (Qwen3-8B-like),
# and Qwen3.5-9B's hybrid: 32 layers, full attention every 4th (4 KV heads x 256), the rest
# Gated DeltaNet with 32 value heads of 128x128 float32 state and a 3-step conv window.
KV28_F16 = Shape("kv28-f16", 28, 8, 128, mx.float16)
KV36_BF16 = Shape("kv36-bf16", 36, 8, 128, mx.bfloat16)
HYBRID_9B = Shape(
    "qwen3.5-9b-hybrid", 32, 4, 256, mx.bfloat16, attn_every=4, conv_dim=8192, v_heads=32
)
SHAPES = {s.name: s for s in (KV28_F16, KV36_BF16, HYBRID_9B)}


def _values(shape: tuple, dtype: mx.Dtype) -> mx.array:
    # Random bit patterns below the exponent of 1.0 are finite in every float type and ~10x
    # cheaper to make than mx.random.normal at a gigabyte; the content does not matter here.
    bits = {2: (mx.uint16, 0x3C00), 4: (mx.uint32, 0x3F800000)}[dtype.size]
    return mx.random.randint(0, bits[1], shape, dtype=mx.int32).astype(bits[0]).view(dtype)


def make_cache(shape: Shape, tokens: int, *, seed: int = 0) -> list:
    """An evaluated prompt cache of `tokens` positions with `shape`'s per-layer classes."""
    mx.random.seed(seed)
    out = []
    for i in range(shape.layers):
        if (i + 1) % shape.attn_every == 0:
            c = KVCache()
            kv = [_values((1, shape.kv_heads, tokens, shape.head_dim), shape.dtype) for _ in "kv"]
            c.update_and_fetch(*kv)
        else:
            c = ArraysCache(size=2)
            c[0] = _values((1, shape.conv_keep, shape.conv_dim), shape.dtype)
            c[1] = _values((1, shape.v_heads, shape.v_dim, shape.k_dim), mx.float32)
        out.append(c)
        mx.eval([x for x in out[-1].state if isinstance(x, mx.array)])
    return out
