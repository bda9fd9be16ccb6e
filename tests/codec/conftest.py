"""The codec tests (encoding KV caches to blobs and back, cache file layouts, materializing a
hydrated cache). Fixtures used by one file stay in that file, shared ones are in
tests/conftest.py."""
