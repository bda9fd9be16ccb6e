"""The `llm` plugin (kvstore.client.llm_plugin) as users meet it: the real `llm` CLI with the real
llm-mlx plugin, each call a new process, on the tiny llama registered in llm-mlx's models file of
a temporary llm user dir, with the test's own kvstore home (no daemon running at first: the
plugin's first call starts one, stopped after the test)."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from unittest import mock

import pytest

pytest.importorskip("llm", reason="llm (the llm extra) is not installed")
pytest.importorskip("llm_mlx", reason="llm-mlx (the llm extra) is not installed")

from bench.llm_calls import ALIAS, cached_tokens, llm_env, logged, run_llm, stop_daemon  # noqa: E402
from kvstore.wire.daemon_client import lock_holder  # noqa: E402

# Long enough that a served prefix is most of the prompt (about 330 of the tiny llama's tokens).
SYSTEM = " ".join(["You are the support desk's assistant; answer briefly and kindly."] * 24)
GREEDY = ("-o", "temperature", "0", "-o", "max_tokens", "16")


def ask(env: dict, *args: str):
    c = run_llm(env, *args, *GREEDY)
    assert c.returncode == 0, c.stderr
    return c


@pytest.fixture
def plugin(tmp_path, llama_path, kv_home):
    """The environment of an `llm` with the plugin on; the daemon its calls start is stopped."""
    env = llm_env(tmp_path / "llm", kv_home, llama_path)
    yield env
    stop_daemon(kv_home)


@pytest.fixture
def plain(tmp_path, llama_path, kv_home):
    """llm-mlx alone (KVSTORE_LLM=0), with its own llm user dir and logs."""
    return llm_env(tmp_path / "llm-plain", kv_home, llama_path, plugin=False)


def test_llm_lists_each_mlx_model_once_as_kvstore_backed(plugin, llama_path):
    c = run_llm(plugin, "models")
    mine = [line for line in c.stdout.splitlines() if f"(aliases: {ALIAS})" in line]
    assert mine == [f"KVStoreMlxModel: {llama_path} (aliases: {ALIAS})"], c.stdout


def test_second_and_third_calls_are_served_the_system_prompt_from_the_store(
    plugin, kv_home, llama_path
):
    from mlx_lm import load

    calls = [
        ask(plugin, "-m", ALIAS, "-s", SYSTEM, f"Question {i}: is it down?") for i in (1, 2, 3)
    ]
    first, second, third = logged(plugin, 3)
    system_tokens = len(load(str(llama_path))[1].encode(SYSTEM, add_special_tokens=False))
    assert system_tokens > first["input_tokens"] * 0.9
    assert cached_tokens(first) == 0
    for later in (second, third):  # each a new process: served from the store
        assert cached_tokens(later) >= system_tokens, later
        assert later["input_tokens"] == first["input_tokens"]
    assert lock_holder(kv_home), "the first call started the home's daemon"
    assert [c.stderr for c in calls[1:]] == ["", ""]  # nothing said when all is well


def test_a_follow_up_carries_the_first_turn_and_is_served(plugin, plain):
    ask(plugin, "-m", ALIAS, "-s", SYSTEM, "My invoice is wrong.")
    ask(plugin, "-c", "It was charged twice.")
    first, follow = logged(plugin, 2)
    assert follow["conversation_id"] == first["conversation_id"]
    turn = first["input_tokens"] + first["output_tokens"]
    assert follow["input_tokens"] > turn  # the whole first turn, then the new message
    assert cached_tokens(follow) >= turn - 1  # its transcript, from the store
    # llm-mlx alone rebuilds from conversation.responses, empty in a new process: the new
    # message alone
    ask(plain, "-m", ALIAS, "-s", SYSTEM, "My invoice is wrong.")
    ask(plain, "-c", "It was charged twice.")
    assert logged(plain, 1)[0]["input_tokens"] < first["input_tokens"]


def test_same_text_as_llm_mlx_alone_at_temperature_0(plugin, plain):
    for question in ("Is the outage over?", "Why was I charged twice?"):
        alone = ask(plain, "-m", ALIAS, "-s", SYSTEM, question).stdout
        served = ask(plugin, "-m", ALIAS, "-s", SYSTEM, question).stdout
        assert served == alone, question
    assert cached_tokens(logged(plugin, 1)[0]) > 0  # the second one came from the store


def test_KVSTORE_LLM_0_leaves_llm_mlx_as_it_is(plain, kv_home):
    assert "MlxModel: " in run_llm(plain, "models").stdout
    assert "KVStoreMlxModel" not in run_llm(plain, "models").stdout
    c = ask(plain, "-m", ALIAS, "-s", SYSTEM, "hello")
    assert c.stderr == ""
    assert logged(plain, 1)[0]["token_details"] is None
    assert lock_holder(kv_home) is None and not (kv_home / "store").exists()


def test_an_unusable_home_is_one_warning_and_the_same_answer(plugin, plain, tmp_path):
    not_a_dir = tmp_path / "home-file"
    not_a_dir.write_text("not a directory")
    alone = ask(plain, "-m", ALIAS, "-s", SYSTEM, "hello").stdout
    c = ask({**plugin, "KVSTORE_HOME": str(not_a_dir)}, "-m", ALIAS, "-s", SYSTEM, "hello")
    assert c.stdout == alone
    lines = c.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstore: ") and "home-file" in lines[0], lines


def test_a_stopped_daemon_is_one_warning_the_same_answer_and_nothing_lost(plugin, plain, kv_home):
    ask(plugin, "-m", ALIAS, "-s", SYSTEM, "first")  # starts the daemon, stores the transcript
    pid = lock_holder(kv_home)
    assert pid
    os.kill(pid, signal.SIGSTOP)
    try:
        alone = ask(plain, "-m", ALIAS, "-s", SYSTEM, "second").stdout
        c = ask(plugin, "-m", ALIAS, "-s", SYSTEM, "second")
        assert c.stdout == alone
        lines = c.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvstore: no daemon answers"), lines
        assert c.exit_wait_s < 5.0  # one ping timeout, not one per queued write
        assert cached_tokens(logged(plugin, 1)[0]) > 0  # hydrated without the daemon
    finally:
        os.kill(pid, signal.SIGCONT)
    ask(plugin, "-m", ALIAS, "-s", SYSTEM, "third")
    assert cached_tokens(logged(plugin, 1)[0]) > 0  # the store still serves


def test_a_damaged_entry_is_one_warning_and_the_same_answer(plugin, plain, kv_home):
    from helpers import corrupt_a_blob

    ask(plugin, "-m", ALIAS, "-s", SYSTEM, "first")  # stores its transcript
    stop_daemon(kv_home)  # nothing writes beside the flipped byte
    corrupt_a_blob(kv_home, "chain")
    alone = ask(plain, "-m", ALIAS, "-s", SYSTEM, "second").stdout
    c = ask(plugin, "-m", ALIAS, "-s", SYSTEM, "second")
    assert c.stdout == alone
    lines = c.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstore: skipped 1 unreadable entry"), lines
    assert cached_tokens(logged(plugin, 1)[0]) == 0  # prefilled as without kvstore


def test_only_the_newest_transcripts_of_a_model_are_kept(daemon, llama, llama_path, monkeypatch):
    """Each call's transcript is stored and every call hydrates them all: older ones go."""
    from kvstore.client import PersistentPromptCache, generate, llm_plugin
    from kvstore.store.store import Store
    from kvstore.wire.daemon_client import DaemonClient

    model, tokenizer = llama
    with PersistentPromptCache.open(
        model, tokenizer, llama_path, home=daemon.home, verbose=False, persist_chains=True
    ) as c:
        for i in range(3):
            generate(c, model, tokenizer, f"call {i} " * 8, max_tokens=2)
            assert c.flush()
            time.sleep(0.01)  # distinct last_used
        fingerprint = c.fingerprint
    monkeypatch.setattr(llm_plugin, "KEEP_CHAINS", 1)
    with DaemonClient(daemon.home) as client:
        assert llm_plugin.evict_older_chains(client, daemon.home, fingerprint) == 2
        assert llm_plugin.evict_older_chains(client, daemon.home, fingerprint) == 0
    with Store(daemon.home, readonly=True) as store:
        (kept,) = store.metas(fingerprint)
    assert tokenizer.decode(kept.token_ids()).startswith("call 2")


# -- registration, in this process -------------------------------------------------------------


def _registered(user_dir: Path, monkeypatch) -> list:
    import llm

    monkeypatch.setenv("LLM_USER_PATH", str(user_dir))
    return llm.get_models_with_aliases()


def test_the_plugin_registers_under_llm_mlx_s_id_and_aliases(plugin, llama_path, monkeypatch):
    from kvstore.client.llm_plugin import KVStoreMlxModel

    monkeypatch.setenv("KVSTORE_LLM", "1")
    models = _registered(Path(plugin["LLM_USER_PATH"]), monkeypatch)
    mine = [m for m in models if m.model.model_id == str(llama_path)]
    assert len(mine) == 1 and type(mine[0].model) is KVStoreMlxModel
    assert mine[0].aliases == [ALIAS]


def test_another_llm_mlx_version_is_refused_in_one_line(plugin, monkeypatch, caplog):
    import llm_mlx

    from kvstore.client import llm_plugin

    real = llm_plugin.metadata.version
    monkeypatch.setenv("KVSTORE_LLM", "1")
    monkeypatch.setattr(llm_plugin, "_said", set())
    with (
        mock.patch.object(
            llm_plugin.metadata, "version", lambda d: "0.5" if d == "llm-mlx" else real(d)
        ),
        caplog.at_level(logging.WARNING, logger="kvstore.client"),
    ):
        models = _registered(Path(plugin["LLM_USER_PATH"]), monkeypatch)
        _registered(Path(plugin["LLM_USER_PATH"]), monkeypatch)
    mine = [m for m in models if ALIAS in m.aliases]
    assert len(mine) == 1 and type(mine[0].model) is llm_mlx.MlxModel  # llm-mlx's, untouched
    said = [r.getMessage() for r in caplog.records if r.name == "kvstore.client"]
    assert len(said) == 1 and "llm-mlx 0.4" in said[0] and "llm-mlx 0.5" in said[0], said
