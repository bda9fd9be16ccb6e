"""Issue 10 item 3: the upgrade canary.

"The new mlx computes other KV for the same fingerprint" is simulated by filing, under the pin's
key, the KV of the same tokens computed with a RoPE base override: what the store holds then
differs from what the code installed here computes, as it would after such an upgrade.
"""

from __future__ import annotations

import json
import logging

import mlx.core as mx
from helpers import TWO_PINS, Proc, assert_same_kv, cli, manifest_for, serving, wait_for
from mlx_lm import load

from kvstore.codec import codec
from kvstore.daemon.canary import check_at_boot
from kvstore.home import tombstones
from kvstore.identity.codehash import installed_versions, runtime_versions
from kvstore.kvcheck.kvdiff import kv_difference
from kvstore.kvcheck.prefill import prefill
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store
from kvstore.warm.canary import RUNTIME_NAME, stored_versions

TOKENS = list(range(3, 40))


def file_other_kv(store, llama_path, label: str) -> bytes:
    """Replace one stored pin's KV by the same tokens' KV under another RoPE base."""
    meta = next(m for m in store.metas() if m.label == label)
    other, _ = load(str(llama_path), model_config={"rope_theta": 1e6})
    cache = prefill(other, meta.token_ids())
    fields = dict(tokens=meta.tokens, label=meta.label, pinned=True, model=meta.model,
                  template_hash=meta.template_hash, classes=codec.cache_classes(cache),
                  extra=meta.extra)  # fmt: skip
    store.put(meta.key, codec.encode(cache, {"model": meta.model}), **fields)
    return meta.key


def test_float_noise_passes_and_a_changed_computation_does_not(llama_path):
    model, _ = load(str(llama_path))
    other, _ = load(str(llama_path), model_config={"rope_theta": 1e6})
    base = prefill(model, TOKENS)
    same, tol = kv_difference(prefill(model, TOKENS, step=5), base)  # chunked: other sum order
    assert same <= tol and tol == 8 * 2.0**-23  # float32 KV
    changed, _ = kv_difference(prefill(other, TOKENS), base)
    assert changed > 100 * tol
    model.set_dtype(mx.bfloat16)
    _, bf16_tol = kv_difference(prefill(model, TOKENS), prefill(model, TOKENS))
    assert bf16_tol == 8 * 2.0**-7


def test_verify_deep_finds_and_repairs_kv_the_code_no_longer_computes(
    llama_path, kv_home, tmp_path
):
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS)
    cli("warm", "--manifest", manifest, code=0)
    result = cli("verify", "--deep", "--manifest", manifest, code=0)
    assert "ok    " in result.output and "matches its stored KV" in result.output

    with Store(kv_home) as store:
        file_other_kv(store, llama_path, "classify")
    assert cli("verify").exit_code == 0  # every entry is intact: only --deep sees it
    result = cli("verify", "--deep", "--manifest", manifest)
    assert result.exit_code == 1 and "DIFFERS from its stored KV" in result.output
    assert "1 model computed other KV than stored" in result.output

    result = cli("verify", "--deep", "--repair", "--manifest", manifest)
    assert result.exit_code == 1 and "re-warmed" in result.output
    cli("verify", "--deep", "--manifest", manifest, code=0)
    model, _ = load(str(llama_path))
    with Store(kv_home) as store:
        for meta in store.metas():
            assert_same_kv(store.load(meta.key)[1], prefill(model, meta.token_ids()))


def test_the_daemon_checks_at_boot_after_an_upgrade_and_drops_what_differs(
    llama_path, kv_home, tmp_path, caplog
):
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS)
    with Store(kv_home) as store:
        warm(load_manifest(manifest), store, home=kv_home)
        # same versions as last time: nothing to check
        (kv_home / RUNTIME_NAME).write_text(json.dumps(runtime_versions()))
        assert check_at_boot(store, kv_home, [manifest]) == []

        # an upgrade that left the KV alone: checked, nothing dropped
        (kv_home / RUNTIME_NAME).write_text(json.dumps({"mlx": "0.1.0", "mlx_lm": "0.1.0"}))
        (result,) = check_at_boot(store, kv_home, [manifest])
        assert result.ok and result.label == "classify"  # the shortest pin
        assert len(store.metas()) == 2
        assert stored_versions(kv_home) == runtime_versions()

        # an upgrade that changed it: the model's entries go, the boot warm re-warms them
        file_other_kv(store, llama_path, "classify")
        (kv_home / RUNTIME_NAME).write_text(json.dumps({"mlx": "0.1.0", "mlx_lm": "0.1.0"}))
        models = {m.model for m in store.metas()}
        caplog.set_level(logging.INFO, "kvstore.daemon")
        (result,) = check_at_boot(store, kv_home, [manifest])
        assert not result.ok and result.difference > 0.5
        assert store.metas() == []
        # evicted as every eviction is: a later miss on them reads `evicted`, not `cold`
        gone = tombstones.load(kv_home, models)
        assert sorted(t.entry for t in gone) == ["classify", "synthesize"]
        assert {t.by for t in gone} == {"upgrade canary"}
        assert "evicted " in caplog.text and "its model's KV is not what mlx" in caplog.text
        assert "re-warmed with mlx" in caplog.text and "DIFFERS" in caplog.text
        assert warm(load_manifest(manifest), store, home=kv_home).warmed == 2


# A daemon whose installed versions are read from a file the test rewrites: an "upgrade" under it.
DAEMON_WITH_FAKE_METADATA = """
import json, sys
from pathlib import Path
from unittest import mock
import kvstore.identity.codehash as ch
f = Path(sys.argv[sys.argv.index("--versions") + 1])
argv = sys.argv[1:sys.argv.index("--versions")]
with mock.patch.object(ch, "installed_versions", lambda: json.loads(f.read_text())):
    from kvstore.daemon.cli import daemon_cmd
    daemon_cmd.main(argv, prog_name="kvstore daemon")
"""


def test_an_upgrade_under_the_running_daemon_restarts_it_into_the_new_code(
    llama_path, kv_home, tmp_path
):
    kv_home.mkdir(parents=True)
    (kv_home / "settings.toml").write_text("version_check_interval = 0.2\n")
    versions = tmp_path / "versions.json"
    versions.write_text(json.dumps(installed_versions()))
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS)
    d = Proc(kv_home, "--manifest", str(manifest), "--versions", str(versions),
             log=tmp_path / "daemon.log", code=DAEMON_WITH_FAKE_METADATA)  # fmt: skip
    with serving(d) as d:
        pid = d.request("ping")["pid"]
        assert pid == d.pid
        versions.write_text(json.dumps({**installed_versions(), "mlx_lm": "99.0.0"}))
        d.wait_log("restarting into the new code")
        d.wait_log("re-executing")
        wait_for(lambda: "serving" in d.text().split("re-executing", 1)[1], what=d.text)
        d.wait_ready()
        assert d.request("ping")["pid"] == pid  # the same process, now running the new code
        assert f"mlx_lm {installed_versions()['mlx_lm']} -> 99.0.0 installed" in d.text()
