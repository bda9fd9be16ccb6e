"""docs/cli.md is the commands' `--help`, rendered by kvstore.cli.reference: it cannot drift."""

from pathlib import Path

from kvstore.cli.reference import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_docs_cli_md_matches_every_commands_help():
    text = render()
    # plugin commands and group subcommands are part of the reference
    for path in (
        "kvstore warm",
        "kvstore serve",
        "kvstore service install",
        "kvstore remote status",
    ):
        assert f"## `{path}`" in text, path
    assert DOC.read_text() == text, (
        "docs/cli.md is out of date with the commands' --help: run `make docs`"
    )
