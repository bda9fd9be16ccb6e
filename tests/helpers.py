"""Small test helpers shared by several test files (not fixtures)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx


def manifest_for(
    tmp: Path, model: Path, prefixes: str, *, extra: str = "", name: str = "manifest.toml"
) -> Path:
    path = tmp / name
    path.write_text(f'[[model]]\npath = "{model}"\n{extra}\n{prefixes}')
    return path


CLASSIFY = (
    "You are the router. Classify the request into one of billing, outage, account or other, "
    "and answer with JSON only. Quote the words that decided it, keep the reason under twenty "
    "words, and when the request mentions several topics pick the one the user asks you to act "
    "on first."
)
SYNTHESIZE = (
    "You are the writer. Turn the approved plan into a short, friendly reply with the next step "
    "first. Use plain words and short sentences, one idea each, no jargon, and sign as the support "
    "team; never promise refunds or credits without a human."
)
TWO_PINS = f"""
[[model.prefix]]
name = "classify"
messages = [{{ role = "system", content = "{CLASSIFY}" }}]

[[model.prefix]]
name = "synthesize"
messages = [{{ role = "system", content = "{SYNTHESIZE}" }}]
"""


def states(cache: list) -> list:
    """Every array in a prompt cache's state, flattened (None and scalars skipped)."""
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten([c.state for c in cache]) if isinstance(v, mx.array)]


def live_states(cache: list) -> list:
    """The live part of each layer's state: keys/values sliced to the offset, other arrays as is."""
    out = []
    for c in cache:
        name = type(c).__name__
        if name in ("KVCache",) and c.keys is not None:
            out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
        elif name == "QuantizedKVCache" and c.keys is not None:
            out += [x[..., : c.offset, :] for x in (*c.keys, *c.values)]
        else:
            out += states([c])
    return out


def assert_same_kv(a: list, b: list) -> None:
    assert [type(c).__name__ for c in a] == [type(c).__name__ for c in b]
    la, lb = live_states(a), live_states(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert mx.array_equal(x, y).item(), "hydrated KV differs from a fresh prefill"
