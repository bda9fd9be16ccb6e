"""A model is named by its resolved folder everywhere (issue 43 item 7): an app's pins, learned
records and ledger records are stored under it whichever way the app named the model (`./llama`),
as a manifest's pins are; `ls`, `evict` and `explain --model` read their filter as it (a path from
the current directory, or the name `ls` shows); entries an older version stored under the path as
the app gave it list, filter and evict under their folder."""

from __future__ import annotations

import json
from dataclasses import replace

from helpers import OLD, TWO_PINS, chat, cli, manifest_for, system, wait_for

from kvstore.client import PersistentPromptCache, generate
from kvstore.home.ledger import Ledger, validate
from kvstore.store.store import Store


def test_an_app_naming_the_model_relatively_stores_under_its_folder(
    daemon, llama, llama_path, tmp_path, monkeypatch
):
    model, tokenizer = llama
    home, folder = daemon.home, str(llama_path.resolve())
    cli("warm", "--manifest", manifest_for(tmp_path, llama_path, TWO_PINS), "--home", home, code=0)
    monkeypatch.chdir(llama_path.parent)
    relative = f"./{llama_path.name}"
    router = [{"role": "system", "content": system(OLD)}]
    with PersistentPromptCache.open(model, tokenizer, relative, home=home, verbose=False) as cache:
        cache.pin("router", messages=router)
        generate(cache, model, tokenizer, chat(tokenizer, system(OLD), "Hi"), label="route")
        assert cache.flush()
    listed = json.loads(cli("ls", "--json", "--home", home, code=0).output)
    assert sorted(e["label"] for e in listed) == ["classify", "router", "synthesize"]
    assert {e["model"] for e in listed} == {folder}
    # the filter matches what `ls` shows, and a path read from here, whichever way it is given
    assert f'{folder}: "' in cli("ls", "--home", home, code=0).output
    for given in (folder, llama_path.name, relative):
        assert "3 entries" in cli("ls", "--model", given, "--home", home, code=0).output, given

    def explained(given: str) -> str:
        return cli("explain", "--model", given, "--home", home, code=0).output

    wait_for(lambda: "route: 1 requests" in explained(folder), what=lambda: explained(folder))
    assert f"{folder} route: 1 requests" in explained(relative)
    # evicting by the name `ls` shows takes the app's pin and the manifest's alike
    assert "evicted 3 entries" in cli("evict", "--model", relative, "--home", home, code=0).output


def test_entries_and_ledger_records_of_a_relative_path_read_under_the_folder(
    llama_path, kv_home, tmp_path, monkeypatch
):
    """What an older version stored for an app that passed `./llama`: the entry's `model` as
    given, beside the folder its put recorded; a ledger record of the path as given."""
    cli("warm", "--manifest", manifest_for(tmp_path, llama_path, TWO_PINS), code=0)
    folder, relative = str(llama_path.resolve()), f"./{llama_path.name}"
    with Store(kv_home) as store:
        (old,) = [m for m in store.metas() if m.label == "classify"]
        assert old.model_dir == folder
        assert store.edit_meta({old.key: lambda m: replace(m, model=relative)}) == 1
    times = {"ts": 1.0, "prefill_s": 0.1, "decode_s": 0.1}
    record = {"model": relative, "label": "route", "prompt_tokens": 10, "cached_tokens": 0,
              "prefilled_tokens": 10, **times}  # fmt: skip
    Ledger(kv_home).append(validate([record]))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    listed = json.loads(cli("ls", "--json", code=0).output)
    assert {e["model"] for e in listed} == {folder}
    assert "2 entries" in cli("ls", "--model", folder, code=0).output
    assert "0 entries" in cli("ls", "--model", relative, code=0).output  # no ./llama here
    monkeypatch.chdir(llama_path.parent)
    assert "route: 1 requests" in cli("explain", "--model", relative, code=0).output
    assert "evicted 2 entries" in cli("evict", "--model", relative, code=0).output
    with Store(kv_home) as store:
        assert store.metas() == []


def test_learned_records_of_a_relative_path_are_stored_under_its_folder(llama_path, monkeypatch):
    """What a learn request and its records carry (kvstore serve's and the library's target)."""
    from kvstore.client.learn import LearnTarget

    monkeypatch.chdir(llama_path.parent)
    target = LearnTarget(b"\0" * 16, f"./{llama_path.name}", model_obj=None, extra={})
    assert target.model == str(llama_path.resolve())
