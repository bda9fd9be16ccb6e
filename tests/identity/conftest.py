"""The identity tests (fingerprints, what invalidates an entry): they edit a copy of a model
(`model_copy`, shared with the client tests, in tests/conftest.py) and need no fixture of their
own."""
