"""Checking KV against a model: prefill its tokens (`prefill.py`), compare per layer
(`kvdiff.py`) and decide (`verdict.py`, the one driver the upgrade canary, `kvstore import` and
the fleet check call)."""
