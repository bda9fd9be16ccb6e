"""Clock-bound pins across midnight, on the daemon's own upkeep with a clock the test moves; and
the rule everywhere a pin is warmed: one bad pin fails alone, template arguments reach the pin."""

from __future__ import annotations

import datetime as dt
import json
import threading
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import cli, manifest_for
from mlx_lm.utils import load_tokenizer

from kvstore.daemon.daywatch import DayWatch
from kvstore.daemon.upkeep import Upkeep
from kvstore.home.settings import load_settings
from kvstore.pins.clock import clock_at
from kvstore.pins.ownership import APP, owners
from kvstore.store.store import Store
from kvstore.tiny import make_tiny_model

# Llama 3.2's shape: the system header prints today's date from strftime_now.
DAY_TEMPLATE = (
    "<|im_start|>system\nToday Date: {{ strftime_now('%d %b %Y') }}\n\n"
    "{{ messages[0]['content'] }}<|im_end|>\n"
    "{% for m in messages[1:] %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SYSTEM = "You are a careful assistant. Classify the request and return JSON with the fields."
PINS = f"""
[[model.prefix]]
name = "dated"
messages = [{{ role = "system", content = "{SYSTEM}" }}]
"""


@pytest.fixture(scope="module")
def dated_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("dated") / "m", chat_template=DAY_TEMPLATE)


class Clock:
    def __init__(self, now: dt.datetime):
        self.now = now

    def __call__(self) -> dt.datetime:
        return self.now


def run_now(name: str, fn) -> Future:
    """The writer's submit, run at once on this thread (the daemon runs jobs on its main one)."""
    fut: Future = Future()
    fut.set_result(fn())
    return fut


def served(store: Store, tokenizer, now: dt.datetime) -> int:
    """Tokens of a request made at `now` that the longest stored entry prefixing it holds."""
    turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is 7 prime?"}]
    with clock_at(now):
        ids = list(tokenizer.apply_chat_template(turns, add_generation_prompt=True))
    best = 0
    for m in store.metas():
        t = m.token_ids()
        if ids[: len(t)] == t:
            best = max(best, len(t))
    return best


def test_a_clock_bound_pin_is_rewarmed_across_midnight_with_no_request_missing_it(
    dated_model, kv_home, tmp_path
):
    manifest = manifest_for(tmp_path, dated_model, PINS)
    clock = Clock(dt.datetime(2026, 3, 14, 12, 0))
    tokenizer = load_tokenizer(dated_model)
    with Store(kv_home) as store:
        upkeep = Upkeep(store, kv_home, load_settings(kv_home), threading.Event(), clock=clock)
        watch = DayWatch(upkeep, lambda: [manifest], run_now, clock=clock)
        upkeep.reconcile([manifest], cause="boot")
        (meta,) = store.metas()
        assert meta.extra.valid_date == "2026-03-14"
        full = meta.ntokens
        assert watch.tick() is None  # nothing due at noon
        # Walk the clock from 23:30 to 00:30, minute by minute: every request finds its pin.
        clock.now = dt.datetime(2026, 3, 14, 23, 30)
        jobs = []
        while clock.now < dt.datetime(2026, 3, 15, 0, 30):
            if (fut := watch.tick()) is not None:
                jobs.append((clock.now.strftime("%H:%M"), fut.result()[0]))
            assert served(store, tokenizer, clock.now) == full, clock.now
            clock.now += dt.timedelta(minutes=1)
        # Prepared 15 minutes ahead (nothing purged), rolled over just after midnight.
        assert [at for at, _ in jobs] == ["23:45", "00:00"]
        prepared, rolled = (report for _, report in jobs)
        assert [p.status for p in prepared.pins] == ["warmed"] and not prepared.purged
        assert [p.status for p in rolled.pins] == ["present"]
        assert [p.label for p in rolled.purged] == ["dated"]
        (meta,) = store.metas()
        assert meta.extra.valid_date == "2026-03-15"
        assert watch.tick() is None
    # `kvstore ls` shows the date the pin holds for.
    out = cli("ls").output
    assert "valid 2026-03-15" in out


def test_a_daemon_that_was_down_at_midnight_rolls_over_on_its_next_check(
    dated_model, kv_home, tmp_path
):
    manifest = manifest_for(tmp_path, dated_model, PINS)
    clock = Clock(dt.datetime(2026, 3, 14, 12, 0))
    with Store(kv_home) as store:
        upkeep = Upkeep(store, kv_home, load_settings(kv_home), threading.Event(), clock=clock)
        upkeep.reconcile([manifest], cause="boot")
        clock.now = dt.datetime(2026, 3, 16, 8, 0)
        watch = DayWatch(upkeep, lambda: [manifest], run_now, clock=clock)
        assert watch.due(clock.now)[0] == "date changed"
        watch.tick().result()
        assert [m.extra.valid_date for m in store.metas()] == ["2026-03-16"]


BAD = "BROKEN"
# A template that refuses one pin's requests: that pin fails, its sibling is warmed.
REFUSING_TEMPLATE = (
    "{% if 'BROKEN' in messages[0]['content'] %}"
    "{{ raise_exception('this system prompt is not supported') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_one_bad_pin_fails_alone_and_the_command_names_it(kv_home, tmp_path):
    model = make_tiny_model(tmp_path / "m", chat_template=REFUSING_TEMPLATE)
    pins = f"""
[[model.prefix]]
name = "good"
messages = [{{ role = "system", content = "{SYSTEM}" }}]

[[model.prefix]]
name = "bad"
messages = [{{ role = "system", content = "{BAD} {SYSTEM}" }}]
"""
    manifest = manifest_for(tmp_path, model, pins)
    result = cli("warm", "--manifest", manifest)
    assert result.exit_code != 0
    assert "bad: " in result.output and "this system prompt is not supported" in result.output
    assert "good:" not in result.output.split("Error:")[-1]
    entries = json.loads(cli("ls", "--json").output)
    assert [e["label"] for e in entries] == ["good"]
    # A pin that fails later keeps what it had stored (a template error is no reason to drop it).
    manifest.write_text(manifest.read_text().replace(f"{BAD} ", "Fine. "))
    assert cli("warm", "--manifest", manifest).exit_code == 0
    manifest.write_text(manifest.read_text().replace("Fine. ", f"{BAD} "))
    result = cli("warm", "--manifest", manifest)
    assert result.exit_code != 0 and "purged" not in result.output
    entries = json.loads(cli("ls", "--json").output)
    assert sorted(e["label"] for e in entries) == ["bad", "good"]


KWARG_TEMPLATE = (
    "<|im_start|>system\n{% if terse is defined and terse %}Be terse. {% endif %}"
    "{{ messages[0]['content'] }}<|im_end|>\n"
    "{% for m in messages[1:] %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_template_arguments_reach_the_stored_pin(kv_home, tmp_path):
    model = make_tiny_model(tmp_path / "m", chat_template=KWARG_TEMPLATE)
    pins = f"""
[[model.prefix]]
name = "terse"
messages = [{{ role = "system", content = "{SYSTEM}" }}]

[[model.prefix]]
name = "chatty"
chat_template_kwargs = {{ terse = false }}
messages = [{{ role = "system", content = "{SYSTEM}" }}]
"""
    manifest = manifest_for(tmp_path, model, pins, extra="chat_template_kwargs = { terse = true }")
    cli("warm", "--manifest", manifest, catch_exceptions=False)
    tok = load_tokenizer(model)
    with Store(kv_home, readonly=True) as store:
        metas = {m.label: m for m in store.metas()}
    assert metas["terse"].extra.chat_template_kwargs == {"terse": True}
    assert metas["chatty"].extra.chat_template_kwargs == {"terse": False}
    assert "Be terse." in tok.decode(metas["terse"].token_ids())
    assert "Be terse." not in tok.decode(metas["chatty"].token_ids())


def test_a_runtime_pin_follows_the_same_rule(dated_model, kv_home):
    from mlx_lm import load

    from kvstore.client import PersistentPromptCache

    model, tok = load(str(dated_model))
    messages = [{"role": "system", "content": SYSTEM}]
    with PersistentPromptCache.open(model, tok, dated_model, stats=False) as cache:
        pin = cache.pin("dated", messages=messages)
        terse = cache.pin("terse", messages=messages, chat_template_kwargs={"x": 1})
    assert pin.valid_date == dt.date.today().isoformat() and pin.warning is None
    assert terse.tokens == pin.tokens  # this template reads no x: same tokens, one entry
    turns = messages + [{"role": "user", "content": "Is 7 prime?"}]
    ids = list(tok.apply_chat_template(turns, add_generation_prompt=True))
    assert ids[: len(pin.tokens)] == list(pin.tokens) and SYSTEM in tok.decode(list(pin.tokens))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('"yes"', "must be a table"),
        ("{ tools = [] }", "'tools' is set by kvstore"),
        ("{ add_generation_prompt = false }", "'add_generation_prompt' is set by kvstore"),
    ],
)
def test_bad_template_arguments_name_the_field(tmp_path, value, message):
    from kvstore.errors import ManifestError
    from kvstore.pins.manifest import load_manifest

    pins = f"""
[[model.prefix]]
name = "p"
chat_template_kwargs = {value}
messages = [{{ role = "system", content = "hi" }}]
"""
    path = manifest_for(tmp_path, tmp_path, pins)
    with pytest.raises(
        ManifestError, match=rf"prefix 'p': field 'chat_template_kwargs': {message}"
    ):
        load_manifest(path)


def test_an_adopted_app_pin_that_is_clock_bound_is_rewarmed_at_midnight(kv_home, tmp_path):
    """The midnight watch used to count only entries a manifest stored itself (source
    "manifest"): a clock-bound pin an app stored first and the manifest adopted was never
    prepared for the next day, nor rolled over, so the first request after midnight missed it."""
    model = make_tiny_model(tmp_path / "m", chat_template=DAY_TEMPLATE)
    manifest = manifest_for(tmp_path, model, PINS)
    clock = Clock(dt.datetime(2026, 3, 14, 12, 0))
    me = f"manifest:{manifest}"
    with Store(kv_home) as store:
        upkeep = Upkeep(store, kv_home, load_settings(kv_home), threading.Event(), clock=clock)
        upkeep.reconcile([manifest], cause="boot")
        (meta,) = store.metas()
        assert owners(meta) == [me]

        def as_adopted(m):  # what an app's pin() then the manifest's adoption leave
            extra = m.extra.updated(source="pin", manifest=None, owners=[APP, me])
            return replace(m, extra=extra)

        store.edit_meta({meta.key: as_adopted})
        watch = DayWatch(upkeep, lambda: [manifest], run_now, clock=clock)
        assert watch.tick() is None
        clock.now = dt.datetime(2026, 3, 14, 23, 50)
        fut = watch.tick()
        assert fut is not None and watch.due(clock.now) is None  # tomorrow's is prepared
        assert sorted(m.extra.valid_date for m in store.metas()) == ["2026-03-14", "2026-03-15"]
        clock.now = dt.datetime(2026, 3, 15, 0, 1)
        assert watch.tick() is not None  # rolled over: the manifest lets go of yesterday's
        by_date = {m.extra.valid_date: owners(m) for m in store.metas()}
        assert by_date == {"2026-03-14": [APP], "2026-03-15": [me]}
        assert watch.tick() is None
