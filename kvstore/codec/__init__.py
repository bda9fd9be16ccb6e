"""Cache objects <-> bytes: mlx-lm prompt-cache safetensors, validated before mlx sees a byte.

`codec` encodes and decodes (its `decode` reads top to bottom); the steps of a decode each have
their module: `safetensors` (the byte layout, pure Python), `cache_state` (the cache structure
and class allowlist), `materialize` (the one copy of stored bytes into mlx memory), and
`cache_api` (the installed mlx-lm's cache objects <-> the one stored form, 0.31 or 0.32).
"""

# The byte layout's version: every entry records it and every fingerprint folds it in. Here, not
# in codec.py, so the fingerprint and the store read it without importing mlx.
CODEC_VERSION: int = 1
