"""Whose an entry is: the model fingerprint (weights, effective config, adapter, KV settings,
the mlx-lm code that computes the KV) and the template hash."""
