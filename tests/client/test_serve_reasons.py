"""Why tokens were prefilled, through a real `kvstore serve` process: the per-request log line
names the reasons (a diverged pin by label and position) and GET /metrics counts them, with
`suffix`, so that they sum to the prefilled tokens."""

from __future__ import annotations

import re
import urllib.request

import pytest
from helpers import manifest_for, wait_for
from test_reasons_library import NEW, OLD, system
from test_serve import Server

from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store
from kvstore.warm.warm import warm

pytestmark = pytest.mark.slow


def _prefilled(server: Server) -> dict[str, float]:
    with urllib.request.urlopen(server.url("/metrics"), timeout=10) as r:
        text = r.read().decode()
    pattern = r'kvstore_prefilled_tokens_total\{reason="(\w+)"\} (\S+)'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text)}


def test_serve_names_cold_then_diverged_date(llama_path, kv_home, tmp_path):
    log = tmp_path / "server.log"
    messages = [{"role": "system", "content": system(NEW)},
                {"role": "user", "content": "My invoice 2291 was charged twice."}]  # fmt: skip
    server = Server(tmp_path / "empty-home", llama_path, log)
    try:
        server.wait_ready()
        reply = server.chat(messages)
        wait_for(lambda: _prefilled(server).get("cold", 0) > 0, 30, log.read_text)
        by = _prefilled(server)
        assert by["cold"] == reply["usage"]["prompt_tokens"] == sum(by.values())
    finally:
        server.stop()

    prefixes = f"""
[[model.prefix]]
name = "router"
messages = [{{ role = "system", content = "{system(OLD)}" }}]
"""
    with Store(kv_home) as store:
        warm(load_manifest(manifest_for(tmp_path, llama_path, prefixes)), store, home=kv_home)
    server = Server(kv_home, llama_path, log)
    try:
        server.wait_ready()
        reply = server.chat(messages)
        wait_for(lambda: _prefilled(server).get("diverged", 0) > 0, 30, log.read_text)
        by = _prefilled(server)
        prompt, cached = reply["usage"]["prompt_tokens"], reply["usage"]["prompt_tokens_details"][
            "cached_tokens"]  # fmt: skip
        assert sum(by.values()) == prompt - cached
        wait_for(lambda: re.search(r"diverged \d+ \(router at \d+\)", log.read_text()), 30,
                 log.read_text)  # fmt: skip
    finally:
        server.stop()
