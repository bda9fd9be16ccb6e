"""`kvstore explain`: from the prefill ledger, why prompt tokens were prefilled, per model and
stage, and the divergences that cost the most (kvstore.reasons' `diverged` spans, as records)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack

from kvstore import staticfirst
from kvstore.degrade import UNREADABLE
from kvstore.errors import counted
from kvstore.home.ledger import LEDGER_NAME
from kvstore.identity.model import model_name
from kvstore.reasons import Reason

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
TOP = 10  # divergences per stage


def parse_since(text: str) -> float:
    """'90s', '30m', '1h', '1d', '2w' -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text or "")
    if not m:
        raise ValueError(f"--since {text!r}: a number and one of s, m, h, d, w (e.g. 1h, 1d)")
    return float(m.group(1)) * UNITS[m.group(2)]


def records(home: Path) -> Iterator[dict[str, Any]]:
    path = home / LEDGER_NAME
    if not path.is_file():
        return
    unpacker = msgpack.Unpacker(raw=False)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            unpacker.feed(chunk)
            try:
                for rec in unpacker:
                    if isinstance(rec, dict):
                        yield rec
            except UNREADABLE:  # a torn tail: what parsed
                return


def explain(
    home: Path,
    *,
    since: float | None = None,
    label: str | None = None,
    model: str | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The ledger's requests per (model, stage), `model` (a path read from the current directory,
    or a hub id) matching the records of that model's one name (`model_name`) and older ones that
    recorded the path as the app gave it."""
    cutoff = (now or time.time()) - since if since is not None else None
    models = None if model is None else {model, model_name(model)}
    stages: dict[tuple[str, str], dict[str, Any]] = {}
    divs: dict[tuple[str, str], dict[tuple, dict[str, Any]]] = {}
    for rec in records(home):
        try:
            m, lab = rec["model"], rec["label"]
            if (models is not None and m not in models) or (label is not None and lab != label):
                continue
            if cutoff is not None and rec.get("ts", 0) < cutoff:
                continue
            key = (m, lab)
            s = stages.get(key)
            if s is None:
                s = stages[key] = {"model": m, "label": lab, "prefilled": {}}
                s.update(dict.fromkeys(("requests", "prompt_tokens", "served_tokens",
                                        "fleet_tokens", "prefilled_tokens"), 0))  # fmt: skip
                divs[key] = {}
            s["requests"] += 1
            s["prompt_tokens"] += rec["prompt_tokens"]
            s["served_tokens"] += rec["cached_tokens"]
            s["fleet_tokens"] += rec.get("fleet_tokens", 0)
            s["prefilled_tokens"] += rec["prefilled_tokens"]
            spans = rec.get("reasons")
            pre = s["prefilled"]
            if not spans:  # an older record: no reasons kept
                pre["unrecorded"] = pre.get("unrecorded", 0) + rec["prefilled_tokens"]
                continue
            for sp in spans:
                r = sp["reason"]
                pre[r] = pre.get(r, 0) + sp["tokens"]
                if r == Reason.MODEL_CHANGED and sp.get("differs"):  # what changed, as serve says
                    changed = s.setdefault("model_changed", {})
                    changed[sp["differs"]] = changed.get(sp["differs"], 0) + sp["tokens"]
                if r == Reason.DIVERGED:
                    dk = (sp.get("entry"), sp.get("position"), sp.get("stored_text", ""),
                          sp.get("request_text", ""))  # fmt: skip
                    d = divs[key].get(dk)
                    if d is None:
                        d = divs[key][dk] = {
                            "entry": dk[0], "position": dk[1], "stored_length":
                            sp.get("stored_length"), "stored_text": dk[2], "request_text": dk[3],
                            "requests": 0, "tokens": 0,
                        }  # fmt: skip
                    d["requests"] += 1
                    d["tokens"] += sp["tokens"]
        except (KeyError, TypeError):
            continue
    out = []
    for key, s in sorted(stages.items()):
        top = sorted(divs[key].values(), key=lambda d: -d["tokens"])[:TOP]
        for d in top:
            block = staticfirst.dynamic_block(str(d["stored_text"]), str(d["request_text"]))
            d["dynamic"] = None if block is None else {"stored": block[0], "request": block[1]}
            d["suggestion"] = suggestion(d)
        out.append({**s, "divergences": top})
    return {"stages": out}


def suggestion(d: dict[str, Any]) -> str:
    """Static-first (kvstore.staticfirst) where what differs at `position` is a dynamic block
    inside content the app keeps static; else keep that part fixed."""
    return staticfirst.suggestion(
        str(d.get("stored_text") or ""), str(d.get("request_text") or ""), str(d["entry"]),
        int(d["position"] or 0),
    )  # fmt: skip


def render(result: dict[str, Any]) -> str:
    lines = []
    for s in result["stages"]:
        p = s["prompt_tokens"]
        lines.append(
            f"{s['model']} {s['label']}: {s['requests']} requests, {p} prompt tokens, "
            f"{s['served_tokens']} served ({100 * s['served_tokens'] / p if p else 0:.0f}%"
            f"{'; ' + str(s['fleet_tokens']) + ' from the fleet' if s['fleet_tokens'] else ''}), "
            f"{s['prefilled_tokens']} prefilled"
        )
        for r, n in sorted(s["prefilled"].items(), key=lambda kv: -kv[1]):
            changed = s.get("model_changed", {}) if r == Reason.MODEL_CHANGED else {}
            what = f" ({'; '.join(sorted(changed))})" if changed else ""
            lines.append(f"  {r:16} {n}{what}")
        for d in s["divergences"]:
            lines.append(
                f"  diverged from {d['entry']} at token {d['position']}: "
                f"{counted(d['requests'], 'request')}, {d['tokens']} tokens"
            )
            lines.append(f"    stored:  {d['stored_text']!r}")
            lines.append(f"    request: {d['request_text']!r}")
            lines.append(f"    {d['suggestion']}")
    return "\n".join(lines) or "no requests in the ledger"
