"""kvstore.reasons: every prefilled token gets a reason, in order along the prompt; the ledger
keeps them (older records still read); `kvstore explain` aggregates them from the ledger."""

from __future__ import annotations

import json
import time

import msgpack
from click.testing import CliRunner

from kvstore.cli.main import main
from kvstore.home.ledger import LEDGER_NAME, Ledger, validate
from kvstore.reasons import SHARED_TOKENS, Known, Tombstone, attribute, by_reason, identity_diff
from kvstore.tokens import pack

SYS = list(range(1000, 1400))


def test_first_ever_request_is_cold():
    assert attribute(list(range(30)), 0, Known()) == [
        {"reason": "cold", "tokens": 29}, {"reason": "suffix", "tokens": 1}]  # fmt: skip


def test_diverged_names_entry_position_and_text_then_suffix():
    prompt = SYS[:14] + [7] + SYS[15:] + [1, 2, 3]
    spans = attribute(prompt, 14, Known(pins={tuple(SYS): "sys"}), decode=lambda t: "".join(
        chr(65 + x % 26) for x in t))  # fmt: skip
    d, s = spans
    assert (d["reason"], d["entry"], d["position"], d["tokens"]) == ("diverged", "sys", 14, 386)
    assert d["stored_text"] != d["request_text"]
    assert s == {"reason": "suffix", "tokens": 3}
    assert sum(by_reason(spans).values()) == len(prompt) - 14


def test_served_pin_leaves_only_suffix():
    prompt = SYS + [1, 2, 3]
    assert attribute(prompt, 400, Known(pins={tuple(SYS): "sys"})) == [
        {"reason": "suffix", "tokens": 3}
    ]


def test_seen_once_is_not_learned_yet_or_write_budget():
    prompt = SYS + [5, 6]
    seen = [pack(SYS + [9])]
    assert attribute(prompt, 0, Known(seen=seen))[0] == {"reason": "not_learned_yet", "tokens": 400}
    assert attribute(prompt, 0, Known(seen=seen, write_budget=True))[0]["reason"] == "write_budget"


def test_evicted_tombstone_says_by_what():
    t = Tombstone.of(SYS, "kvstore evict", 123.0, "sys")
    (e, s) = attribute(SYS + [1], 0, Known(tombstones=[t]))
    assert (e["reason"], e["by"], e["tokens"], s["reason"]) == ("evicted", "kvstore evict", 400,
                                                                "suffix")  # fmt: skip


def test_unavailable_and_model_changed():
    assert attribute(SYS, 0, Known(unavailable=True)) == [
        {"reason": "unavailable", "tokens": 399}, {"reason": "suffix", "tokens": 1}]  # fmt: skip
    stored = {"kv_bits": None, "model_config": {"a": 1}}
    running = {"kv_bits": 4, "model_config": {"a": 1}}
    what = identity_diff(stored, running)
    assert what == "KV quantization"
    assert attribute(SYS, 0, Known(model_changed=what))[0]["differs"] == "KV quantization"


def test_a_request_leaving_a_learned_prefix_inside_it_is_diverged_naming_it():
    learned = sorted([pack(SYS), pack(SYS + [5] * 300)])
    prompt = SYS[:14] + [7] + SYS[15:] + [1, 2, 3]
    (d, s) = attribute(prompt, 14, Known(learned=learned))
    assert (d["reason"], d["entry"], d["position"], d["tokens"]) == (
        "diverged", "learned chain of 400 tokens", 14, 386)  # fmt: skip
    assert s == {"reason": "suffix", "tokens": 3}


def test_a_learned_prefix_cut_short_in_memory_still_names_its_stored_length():
    key = pack(SYS[:100])
    prompt = SYS[:14] + [7] + SYS[15:]
    d, _ = attribute(prompt, 0, Known(learned=[key], learned_ends={key: 400}))
    assert (d["entry"], d["tokens"]) == ("learned chain of 400 tokens", 399)  # then the last


def test_leaving_where_a_learned_prefix_ends_is_the_request_own_content_not_cold():
    # the learned prefix ends at 400 (where the requests that taught it differed); a
    # conversation went on from it: a new user turn is suffix, not diverged nor cold
    learned = sorted([pack(SYS), pack(SYS + [5] * 300)])
    prompt = SYS + [6] * 20
    assert attribute(prompt, 400, Known(learned=learned)) == [{"reason": "suffix", "tokens": 20}]
    # held whole but not served (this process does not restore): learned, not not_learned_yet
    spans = attribute(prompt, 0, Known(learned=learned, seen=[pack(SYS + [9])]))
    assert spans == [{"reason": "suffix", "tokens": 420}]


def test_an_evicted_prefix_held_whole_comes_before_a_divergence_inside_it():
    # the request is the evicted pin's (it agrees all through it), not the learned prefix's
    # that leaves it at 40: no divergence is told for it
    prompt = SYS[:46] + [1, 2, 3]
    learned = [pack(SYS[:40] + [9] * 200)]
    t = Tombstone.of(SYS[:46], "kvstore evict", 123.0, "router")
    spans = attribute(prompt, 0, Known(learned=learned, tombstones=[t]))
    assert [(s["reason"], s["tokens"]) for s in spans] == [("evicted", 46), ("suffix", 3)]


def test_attribution_among_many_candidates_names_the_divergence():
    """64 recent prompts, 8 pins, 512 learned prefixes and 64 tombstones; a 2,050-token prompt
    that diverges inside the longest pin. What it costs a call is `python -m bench.reasons`'s to
    report (a wall-clock bound here fails on a shared machine)."""
    import random

    rng = random.Random(0)
    prompt = SYS[:14] + [7] + SYS[15:] * 5
    seen = sorted(pack(range(5000 + i, 7000)) for i in range(64))
    pins = [(pack(SYS * 5), "sys")] + [
        (pack([rng.randrange(9000) for _ in range(1500)]), f"p{i}") for i in range(7)
    ]
    learned = sorted(pack([rng.randrange(9000) for _ in range(rng.randrange(300, 4096))])
                     for _ in range(512))  # fmt: skip
    tombs = [Tombstone.of([rng.randrange(9000)] * (i + 20), "byte budget", 1.0) for i in range(64)]
    known = Known(pin_keys=pins, seen=seen, learned=learned, tombstones=tombs)
    (d, *_) = attribute(prompt, 14, known)
    assert (d["reason"], d["entry"], d["position"]) == ("diverged", "sys", 14)


def _rec(i, reasons=None, ts=None):
    r = {"model": "m", "label": "serve", "prompt_tokens": 500, "cached_tokens": 14,
         "prefilled_tokens": 486, "prefill_s": 0.1, "decode_s": 0.1}  # fmt: skip
    r["ts"] = ts or time.time()
    if reasons is not None:
        r["reasons"] = reasons
    return r


DIV = {"reason": "diverged", "tokens": 386, "entry": "sys", "position": 14,
       "stored_text": "system\nToday is 2026-11-30. You are the router.\nClassify",
       "request_text": "system\nToday is 2026-12-01. You are the router.\nClassify"}  # fmt: skip


def test_ledger_keeps_reasons_and_old_records_still_read(tmp_path):
    good = validate([_rec(0, [DIV, {"reason": "suffix", "tokens": 100}])])
    assert good[0]["reasons"][0]["entry"] == "sys"
    assert "reasons" not in validate([_rec(0, [{"reason": "made_up", "tokens": 1}])])[0]
    led = Ledger(tmp_path)
    led.append(validate([_rec(0)]) + good)
    assert Ledger(tmp_path).records == 2  # after a restart


def test_explain_json_aggregates_divergences(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    Ledger(home).append(validate([_rec(i, [DIV, {"reason": "suffix", "tokens": 100}])
                                  for i in range(3)] + [_rec(9)]))  # fmt: skip
    Ledger(home).append(validate([_rec(0, [DIV], ts=time.time() - 7200)]))
    out = CliRunner().invoke(main, ["explain", "--json", "--since", "1h", "--home", str(home)])
    assert out.exit_code == 0, out.output
    (stage,) = json.loads(out.output)["stages"]
    assert stage["requests"] == 4
    assert stage["prefilled"] == {"diverged": 3 * 386, "suffix": 300, "unrecorded": 486}
    (d,) = stage["divergences"]
    assert {k: d[k] for k in ("entry", "position", "requests", "tokens")} == {
        "entry": "sys",
        "position": 14,
        "requests": 3,
        "tokens": 3 * 386,
    }
    assert "2026-11-30" in d["stored_text"] and "2026-12-01" in d["request_text"]
    # a dynamic block inside static content: static-first, as kvstore analyze reorders
    assert d["dynamic"] == {"stored": "2026-11-30", "request": "2026-12-01"}
    assert "static-first" in d["suggestion"]
    assert "'Today is 2026-12-01. You are the router.' into a trailing user turn" in (
        d["suggestion"])  # fmt: skip
    text = CliRunner().invoke(main, ["explain", "--home", str(home)]).output
    assert "diverged from sys at token 14" in text and "4 requests" not in text.split("\n")[0][:0]


def test_explain_suggests_a_fixed_order_where_the_request_goes_on_differently():
    from kvstore.explain import suggestion

    d = {"entry": "shop", "position": 40, "stored_text": '[{"name": "search_products", "de',
         "request_text": '[{"name": "get_order", "parameters": {'}  # fmt: skip
    assert "one fixed order" in suggestion(d) and "static-first" not in suggestion(d)


def test_explain_reads_a_busy_day_whole(tmp_path):
    """A day of a busy server: 200k requests (about 2.3 a second), each with reasons."""
    home = tmp_path / "home"
    home.mkdir()
    now = time.time()
    recs = [_rec(i, [dict(DIV, position=14 + i % 5), {"reason": "suffix", "tokens": 100}],
                 ts=now - i * 0.43) for i in range(200_000)]  # fmt: skip
    with open(home / LEDGER_NAME, "wb") as f:
        f.write(b"".join(msgpack.packb(r) for r in recs))
    out = CliRunner().invoke(main, ["explain", "--json", "--since", "1d", "--home", str(home)])
    assert out.exit_code == 0
    assert json.loads(out.output)["stages"][0]["requests"] == 200_000
    # how fast: bench.reasons (`kvstore explain --since 1d --json` over 200,000 records)


def test_every_reason_has_a_rule_and_a_docs_row():
    """Adding a reason is a member, a rule in RULES and a row in docs/reasons.md."""
    import inspect
    from pathlib import Path

    from kvstore.reasons import RULES, Reason

    told = {r for rule in RULES for r in Reason if f"Reason.{r.name}" in inspect.getsource(rule)}
    assert told == set(Reason)
    doc = (Path(__file__).parents[2] / "docs" / "reasons.md").read_text()
    rows = [line.split("|")[1].strip() for line in doc.splitlines() if line.startswith("| `")]
    assert rows == [f"`{r.value}`" for r in Reason]


def test_explain_names_what_changed_for_model_changed(tmp_path):
    """`explain --json` said only {"model_changed": 295}; serve's line named what changed."""
    home = tmp_path / "home"
    home.mkdir()
    changed = {"reason": "model_changed", "tokens": 295, "differs": "weights"}
    recs = [_rec(0, [changed, {"reason": "suffix", "tokens": 191}]),
            _rec(1, [dict(changed, differs="config")])]  # fmt: skip
    (home / LEDGER_NAME).write_bytes(b"".join(msgpack.packb(r) for r in recs))
    out = CliRunner().invoke(main, ["explain", "--json", "--home", str(home)])
    assert out.exit_code == 0, out.output
    (stage,) = json.loads(out.output)["stages"]
    assert stage["prefilled"]["model_changed"] == 590
    assert stage["model_changed"] == {"weights": 295, "config": 295}
    text = CliRunner().invoke(main, ["explain", "--home", str(home)]).output
    assert "  model_changed    590 (config; weights)" in text, text


# a chatml-like template: a message is [START, role, NL] + content + [END, NL]
START, END, NL, SYSTEM, USER, ASSISTANT = 900, 901, 902, 903, 904, 905
HEADS = dict(first_headers=[(START, SYSTEM, NL), (START, USER, NL)],
             headers=[(START, USER, NL), (START, ASSISTANT, NL)])  # fmt: skip


def msg(role: int, content: list[int]) -> list[int]:
    return [START, role, NL, *content, END, NL]


PIN = msg(SYSTEM, SYS[:40]) + [START, USER, NL]


def test_a_pin_sharing_only_the_template_header_is_not_diverged_but_cold():
    other = msg(SYSTEM, list(range(2000, 2030))) + msg(USER, [5, 6, 7])
    user_only = msg(USER, [5, 6, 7, 8])
    for prompt in (other, user_only):
        spans = attribute(prompt, 0, Known(pins={tuple(PIN): "router"}, **HEADS))
        assert spans == [{"reason": "cold", "tokens": len(prompt) - 1},
                         {"reason": "suffix", "tokens": 1}], spans  # fmt: skip
    # served the header from memory (a trimmable cache's common prefix): still nothing stored
    spans = attribute(other, 3, Known(pins={tuple(PIN): "router"}, seen=[pack(PIN)], **HEADS))
    assert [s["reason"] for s in spans] == ["cold", "suffix"], spans


def test_a_pin_whose_content_the_request_changes_is_still_diverged():
    prompt = msg(SYSTEM, SYS[:14] + [7] + SYS[15:40]) + msg(USER, [5, 6])
    d, s = attribute(prompt, 0, Known(pins={tuple(PIN): "router"}, **HEADS))
    assert (d["reason"], d["entry"], d["position"]) == ("diverged", "router", 3 + 14)
    assert s["reason"] == "suffix"


def test_a_new_user_turn_after_a_learned_chain_is_not_learned_yet_not_diverged():
    chain = msg(SYSTEM, SYS[:40]) + msg(USER, [11] * 30) + msg(ASSISTANT, [12] * 20)
    prompt = msg(SYSTEM, SYS[:40]) + msg(USER, [13] * 8)
    spans = attribute(prompt, 0, Known(learned=[pack(chain)], **HEADS))
    assert "diverged" not in by_reason(spans), spans
    assert spans[0] == {"reason": "not_learned_yet", "tokens": 48}, spans
    assert sum(by_reason(spans).values()) == len(prompt)
    # the same chain left inside a message's content: diverged
    changed = msg(SYSTEM, SYS[:14] + [7] + SYS[15:40]) + msg(USER, [13] * 8)
    assert attribute(changed, 0, Known(learned=[pack(chain)], **HEADS))[0]["reason"] == "diverged"


def test_the_last_token_every_request_prefills_is_always_suffix():
    # a prompt stored whole (a pin of exactly it), seen before, or nothing known at all: the last
    # token is prefilled for its logits, and it is `suffix` each time
    assert attribute(PIN, len(PIN) - 1, Known(seen=[pack(PIN)])) == [
        {"reason": "suffix", "tokens": 1}]  # fmt: skip
    assert attribute(PIN, len(PIN) - 1, Known(pins={tuple(PIN): "router"})) == [
        {"reason": "suffix", "tokens": 1}]  # fmt: skip
    assert attribute(SYS, 0, Known())[-1] == {"reason": "suffix", "tokens": 1}
    assert attribute(SYS, 0, Known(unavailable=True))[-1] == {"reason": "suffix", "tokens": 1}


def test_a_stopped_daemon_over_a_readable_store_tells_what_it_read():
    known = Known(unavailable=True, other_model=[(SYS[:300], "weights")])
    spans = attribute(SYS, 0, known)
    assert [(s["reason"], s["tokens"]) for s in spans] == [("model_changed", 300), ("suffix", 100)]
    assert attribute(SYS, 0, Known(unavailable=True))[0] == {"reason": "unavailable", "tokens": 399}


def test_a_pin_sharing_an_opening_word_of_its_content_is_cold_not_diverged():
    # issue 43 item 9: "You " is no shared part of the pin's content; SHARED_TOKENS of it are
    opening = msg(SYSTEM, SYS[:1] + list(range(2000, 2030))) + msg(USER, [5, 6, 7])
    spans = attribute(opening, 0, Known(pins={tuple(PIN): "router"}, **HEADS))
    assert spans == [{"reason": "cold", "tokens": len(opening) - 1},
                     {"reason": "suffix", "tokens": 1}], spans  # fmt: skip
    # served the header and that word from memory: still cold
    assert [s["reason"] for s in attribute(opening, 4, Known(pins={tuple(PIN): "router"},
            **HEADS))] == ["cold", "suffix"]  # fmt: skip
    # and a recent prompt that shares only it is not `not_learned_yet` either
    assert [s["reason"] for s in attribute(opening, 0, Known(seen=[pack(PIN)], **HEADS))] == [
        "cold", "suffix"]  # fmt: skip
    shared = msg(SYSTEM, SYS[:SHARED_TOKENS] + list(range(2000, 2030))) + msg(USER, [5, 6, 7])
    d = attribute(shared, 0, Known(pins={tuple(PIN): "router"}, **HEADS))[0]
    assert (d["reason"], d["position"]) == ("diverged", 3 + SHARED_TOKENS)
