"""Cache objects <-> bytes: mlx-lm prompt-cache safetensors, validated before mlx sees a byte."""

# The byte layout's version: every entry records it and every fingerprint folds it in. Here, not
# in codec.py, so the fingerprint and the store read it without importing mlx.
CODEC_VERSION: int = 1
