"""A real daemon watching its manifest's files: a prompt-file edit, a chat-template edit and a
weight change each re-warm exactly what they should, with the cause in the log."""

from __future__ import annotations

import os
import shutil

import pytest
from helpers import CLASSIFY, Proc, cli, manifest_for, serving, wait_for

from kvstore.ops import put as put_ops
from kvstore.wire.daemon_client import DaemonClient


@pytest.fixture(scope="module")
def watched(tmp_path_factory, llama_path):
    root = tmp_path_factory.mktemp("watch")
    model = root / "model"
    shutil.copytree(llama_path, model)
    (root / "router.md").write_text(CLASSIFY)
    pins = (
        '[[model.prefix]]\nname = "router"\nfile = "router.md"\n\n'
        '[[model.prefix]]\nname = "writer"\nmessages = [{ role = "system", content = '
        '"You are the writer. Reply in short, kind sentences with the next step first." }]\n'
    )
    manifest = manifest_for(root, model, pins, name="pins.toml")
    home = root / "home"
    home.mkdir(mode=0o700)
    (home / "settings.toml").write_text("debounce = 0.2\npoll_interval = 1.0\n")
    d = Proc(home, "--manifest", str(manifest), log=root / "daemon.log")
    d.root, d.model = root, model
    with serving(d):
        yield d


def entries(d: Proc) -> dict[str, dict]:
    with DaemonClient(d.home) as c:
        return {e["label"]: e for e in c.raw("ls")}


def last_at(d: Proc) -> float:
    return d.request("stats")["daemon"]["last_warm"]["at"]


def test_prompt_file_edit_rewarms_only_its_pin(watched):
    before, at = entries(watched), last_at(watched)
    path = watched.root / "router.md"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(CLASSIFY.replace("JSON only", "one word only"))
    os.replace(tmp, path)  # an editor's atomic save
    w = watched.next_warm(at)
    after = entries(watched)
    assert (w["warmed"], w["purged"]) == (1, 1)
    assert after["router"]["key"] != before["router"]["key"]
    assert after["writer"]["key"] == before["writer"]["key"]
    assert after["writer"]["created"] == before["writer"]["created"]
    watched.wait_log("pin removed, or its rendered tokens changed")


def test_template_edit_rewarms_every_pin_of_the_model(watched):
    before, at = entries(watched), last_at(watched)
    jinja = watched.model / "chat_template.jinja"
    cfg = watched.model / "tokenizer_config.json"
    target = jinja if jinja.is_file() else cfg
    text = target.read_text()
    edited = (
        text + "{# reviewed #}"
        if target is jinja
        else text.replace("{% endif %}", "{% endif %}{# reviewed #}", 1)
    )  # noqa: E501
    assert edited != text
    target.write_text(edited)
    w = watched.next_warm(at)
    after = entries(watched)
    assert (w["warmed"], w["purged"]) == (2, 2)
    for label in ("router", "writer"):  # same tokens, so the same keys, but warmed anew
        assert after[label]["key"] == before[label]["key"]
        assert after[label]["template_hash"] != before[label]["template_hash"]
        assert after[label]["created"] > before[label]["created"]
    watched.wait_log("chat template or tokenizer changed")


def _put_chain(d: Proc, fingerprint: str) -> None:
    """An unpinned entry (what a client persists for a transcript) under `fingerprint`."""
    from mlx_lm import load

    from kvstore.codec import codec
    from kvstore.kvcheck.prefill import prefill
    from kvstore.store.entry import entry_key, pack_tokens

    model, _ = load(str(d.model))
    tokens = [5, 6, 7, 8, 9, 10]
    blob = codec.encode(prefill(model, tokens), {"model": str(d.model)})
    fields = dict(
        tokens=pack_tokens(tokens),
        label="chain",
        pinned=False,
        model=str(d.model),
        classes=["KVCache", "KVCache"],
        extra={"source": "chain"},
    )
    with DaemonClient(d.home) as c:
        put_ops.send(c, entry_key(bytes.fromhex(fingerprint), tokens), blob, fields)


def test_weight_change_replaces_every_entry_of_the_old_fingerprint(watched):
    old_fp = entries(watched)["router"]["fingerprint"]
    _put_chain(watched, old_fp)
    before, at = entries(watched), last_at(watched)
    assert set(before) == {"router", "writer", "chain"}
    weights = watched.model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0x01  # one bit of a weight: same size, same header
    tmp = weights.with_suffix(".tmp")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, weights)
    w = watched.next_warm(at)
    after = entries(watched)
    assert (w["warmed"], w["purged"]) == (2, 3)
    assert set(after) == {"router", "writer"}  # the chain of the old weights is gone too
    assert old_fp not in {e["fingerprint"] for e in after.values()}
    assert all(e["key"] != before[label]["key"] for label, e in after.items())
    watched.wait_log("model changed (weights, config or adapter)")


def test_a_manifest_warmed_later_is_watched_and_no_pending_edit_is_lost(tmp_path, llama_path):
    """Warming a second manifest through the daemon adds its files to the running watcher: an
    edit made just before (not yet checked) is still reported, and the new files are watched."""

    (tmp_path / "router.md").write_text(CLASSIFY)
    router = '[[model.prefix]]\nname = "router"\nfile = "router.md"\n'
    first = manifest_for(tmp_path, llama_path, router, name="pins.toml")
    other = tmp_path / "other"
    other.mkdir()
    (other / "writer.md").write_text("You are the writer. Reply in short, kind sentences.")
    writer = '[[model.prefix]]\nname = "writer"\nfile = "writer.md"\n'
    second = manifest_for(other, llama_path, writer, name="more.toml")
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "settings.toml").write_text("debounce = 1.0\npoll_interval = 1.0\n")
    d = Proc(home, "--manifest", str(first), log=tmp_path / "daemon.log")
    try:
        d.wait_ready()
        d.wait_warm()
        router_key = entries(d)["router"]["key"]
        # An edit the watcher has seen but not yet checked (inside its debounce window) ...
        (tmp_path / "router.md").write_text(CLASSIFY.replace("JSON only", "one word only"))
        # ... then a warm request names a new manifest: the running watcher must keep it.
        r = cli("warm", "--manifest", second, "--home", home)
        assert r.exit_code == 0 and "1 warmed" in r.output, r.output
        # The reconcile purges the old pin before it warms the new one: absent in between.
        wait_for(lambda: entries(d).get("router", {}).get("key") not in (None, router_key),
                 what=d.text)  # fmt: skip
        d.wait_log("router.md): reconciling")
        log = d.text()  # the premise: the edit was still unchecked when the warm request came
        assert log.index("now watching manifest") < log.index("router.md): reconciling"), log
        w = d.request("stats")["daemon"]["last_warm"]
        while not ("router.md" in w["cause"] and w["manifest"] == str(second)):
            w = d.next_warm(w["at"])  # that reconcile ends with the second manifest's warm
        # the newly warmed manifest's own prompt file is watched too
        writer_key, at = entries(d)["writer"]["key"], w["at"]
        (other / "writer.md").write_text("You are the editor. Reply in short, kind sentences.")
        w = d.next_warm(at)
        while w["warmed"] == 0:  # a reconcile warms the first manifest (nothing) then this one
            w = d.next_warm(w["at"])
        assert "writer.md" in w["cause"] and w["manifest"] == str(second)
        assert entries(d)["writer"]["key"] != writer_key
        assert "now watching manifest" in d.text()
    finally:
        rc, _ = d.stop()
    assert rc == 0, d.text()
