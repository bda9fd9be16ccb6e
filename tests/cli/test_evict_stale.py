"""`kvstore evict --stale` through a daemon whose environment differs from the app's (issue 10
item 8): cwd `/` as under launchd, another HF_HUB_CACHE. Entries are judged by the absolute model
directory recorded at put time; what the daemon cannot judge is kept and reported, never deleted.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import Proc, cli, serving
from mlx_lm import load

from kvstore.codec import codec
from kvstore.identity.fingerprint import model_fingerprint
from kvstore.kvcheck.prefill import prefill
from kvstore.ops import put as put_ops
from kvstore.store.entry import entry_key, pack_tokens
from kvstore.store.store import Store
from kvstore.wire.daemon_client import DaemonClient

REVISION = "0123456789abcdef0123456789abcdef01234567"

# The daemon as launchd runs it: cwd "/", and a hub cache of its own (empty).
_ELSEWHERE = """
import os, sys
os.chdir("/")
os.environ["HF_HUB_CACHE"] = sys.argv[-1]
from kvstore.cli.main import main
main(["daemon", *sys.argv[1:-1]])
"""


def _hub_cache(root: Path, repo: str, model: Path) -> Path:
    """A local hub cache holding `repo` at one revision, laid out as huggingface_hub does."""
    folder = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(model, folder / "snapshots" / REVISION)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(REVISION)
    return root


def _entry(model, model_arg: str, tokens: list[int], label: str):
    """(key, blob, fields) of an app pin as PersistentPromptCache sends it."""
    fp = model_fingerprint(model_arg).digest
    blob = codec.encode(prefill(model, tokens), {"model": model_arg, "tokenizer_config": "{}"})
    fields = dict(
        tokens=pack_tokens(tokens),
        label=label,
        pinned=True,
        model=model_arg,
        classes=["KVCache"] * len(model.layers),
        extra={"source": "pin"},
    )
    return entry_key(fp, tokens), blob, fields


@pytest.fixture
def app_side(tmp_path, llama_path, monkeypatch):
    """The app's environment: cwd holding ./tiny, and a hub cache holding kvtest/tiny."""
    work = tmp_path / "app"
    shutil.copytree(llama_path, work / "tiny")
    monkeypatch.chdir(work)
    monkeypatch.setenv(
        "HF_HUB_CACHE", str(_hub_cache(tmp_path / "hf-app", "kvtest/tiny", llama_path))
    )
    return work


def test_evict_stale_through_a_daemon_elsewhere_keeps_valid_pins(
    app_side, tmp_path, llama_path, kv_home
):
    model, _ = load(str(llama_path))
    changed, doomed = tmp_path / "changed", tmp_path / "doomed"
    shutil.copytree(llama_path, changed)
    shutil.copytree(llama_path, doomed)
    relative = _entry(model, "tiny", [1, 2, 3], "relative")
    hub = _entry(model, "kvtest/tiny", [4, 5, 6], "hub")
    will_change = _entry(model, str(changed), [7, 8, 9], "changed")
    will_go = _entry(model, str(doomed), [10, 11, 12], "gone")
    # Stored before model directories were recorded: nothing says where "tiny" was.
    legacy = _entry(model, "tiny", [13, 14, 15], "legacy")
    with Store(kv_home) as store:
        store.put(legacy[0], legacy[1], **legacy[2])

    (tmp_path / "hf-daemon").mkdir()
    d = Proc(kv_home, str(tmp_path / "hf-daemon"), log=tmp_path / "daemon.log", code=_ELSEWHERE)
    with serving(d, warm=False):
        with DaemonClient(kv_home) as c:  # app pins, as PersistentPromptCache sends them
            for key, blob, fields in (relative, hub, will_change, will_go):
                put_ops.send(c, key, blob, fields)
        config = changed / "config.json"
        config.write_text(config.read_text().replace("1e-05", "3e-05"))  # another model now
        shutil.rmtree(doomed)

        r = cli("evict", "--stale", "--home", kv_home)
        assert r.exit_code == 0, r.output
        assert "evicted 2 entries" in r.output, r.output
        assert "kept 1 entry whose staleness is unknown" in r.output, r.output
        assert "legacy" in r.output and "relative or a hub id" in r.output
        left = {e["label"]: e for e in d.request("ls")}
        assert set(left) == {"relative", "hub", "legacy"}, d.text()
        assert left["relative"]["model_dir"] == str((app_side / "tiny").resolve())
        hub_dir = tmp_path / "hf-app" / "models--kvtest--tiny" / "snapshots" / REVISION
        assert left["hub"]["model_dir"] == str(hub_dir)
        d.wait_log("evict --stale kept")


def test_a_model_on_a_missing_volume_is_unknown_not_stale(tmp_path, llama_path, kv_home):
    """A model directory whose parent is missing too (an unplugged drive) may come back: kept.
    Without a daemon the CLI judges and reports the same way."""
    model, _ = load(str(llama_path))
    volume = tmp_path / "volume"
    shutil.copytree(llama_path, volume / "models" / "tiny")
    key, blob, fields = _entry(model, str(volume / "models" / "tiny"), [1, 2], "on-volume")
    with Store(kv_home) as store:
        store.put(key, blob, **fields)
    shutil.rmtree(volume)  # "unmounted": neither the model nor its parent is there
    r = cli("evict", "--stale", "--home", kv_home)
    assert r.exit_code == 0 and "evicted 0 entries" in r.output, r.output
    assert "unmounted volume" in r.output
    with Store(kv_home) as store:
        assert [m.label for m in store.metas()] == ["on-volume"]


def test_a_pin_kept_under_its_model_s_new_folder_is_not_stale(tmp_path, llama_path, kv_home):
    """A model moved to another folder (the old one gone) and the manifest pointed there: the
    warm keeps its pin under the new name, and records where that name resolves, so `evict
    --stale` judges the pin by the folder it names now, not the one it was stored from."""
    import json

    from helpers import manifest_for

    old, new = tmp_path / "models" / "old", tmp_path / "models" / "new"
    shutil.copytree(llama_path, old)
    pins = '[[model.prefix]]\nname = "p"\ntext = "a pinned prompt"\n'
    cli("warm", "--manifest", manifest_for(tmp_path, old, pins), "--home", kv_home, code=0)
    shutil.move(old, new)
    out = cli("warm", "--manifest", manifest_for(tmp_path, new, pins), "--home", kv_home, code=0)
    assert "purged" not in out.output, out.output  # kept, not stored again
    r = cli("evict", "--stale", "--home", kv_home)
    assert r.exit_code == 0 and "evicted 0 entries" in r.output, r.output
    (entry,) = json.loads(cli("ls", "--json", "--home", kv_home, code=0).output)
    assert entry["model"] == str(new.resolve()) and entry["label"] == "p"
    with Store(kv_home) as store:
        (meta,) = store.metas()
        assert meta.model_dir == str(new.resolve())
