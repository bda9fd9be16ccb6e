"""The README's start works for a newcomer: the install section leads with what works (a checkout
installed into the user's own environment) and says the index name is reserved; the quick start
is exactly two commands."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    body = README.split(f"\n## {title}\n", 1)[1]
    return body.split("\n## ", 1)[0]


def _commands(block: str) -> list[str]:
    return [ln.split("#")[0].strip() for ln in block.splitlines() if ln.split("#")[0].strip()]


def _blocks(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, re.S)


def test_the_install_section_leads_with_a_checkout_install():
    install = _section("Install into your own project")
    first = _commands(_blocks(install)[0])
    pips = [c for c in first if "pip install" in c]
    assert pips and all("/path/to/kvstore" in c for c in pips), first  # a checkout, not the index
    assert first.index(pips[0]) > 0 and "venv" in first[first.index(pips[0]) - 1]  # own env
    prose = " ".join(install.split())
    assert (
        "reserved for the release" in prose and "`pip install mlx-kvstore` finds nothing" in prose
    )
    for block in _blocks(README):  # nowhere a command that fails today
        assert not any(re.match(r"pip install '?mlx-kvstore", c) for c in _commands(block))


def test_the_quick_start_is_two_commands():
    (block,) = _blocks(_section("Quick start (this repository)"))
    assert _commands(block) == ["make demo", "make test"]
