"""Whose an entry is: the model as it is run (`ModelIdentity`: path, adapter, KV quantization,
overrides), its fingerprint (weights, effective config, adapter, KV settings, the mlx-lm code that
computes the KV) and the template hash."""
