"""The command-line reference, docs/cli.md, rendered from each command's `--help`.

`python -m kvstore.cli.reference > docs/cli.md` (or `make docs`) regenerates it; a test fails
when the file and the commands' help drift apart. Commands registered through the
`kvstore.commands` entry points (daemon, service, serve, ...) and group subcommands are included.
"""

from __future__ import annotations

import click

WIDTH = 100  # a fixed terminal width, so the output does not depend on who runs it

HEADER = """\
# Command-line reference

Generated from each command's `--help` by `make docs` (`python -m kvstore.cli.reference >
docs/cli.md`); do not edit by hand. A test fails when this page and the commands drift apart.
Every command takes `--home` (default `$KVSTORE_HOME`, else the per-user data directory: see
[README](../README.md#where-the-store-lives)) and `-h`/`--help`. Keys can be given as any unique
hex prefix of the full key or of its prefix-hash half (the short form `ls` shows). User errors
exit 1 with one line naming the file, key or setting at fault.
"""


def _context(command: click.Command, name: str, parent: click.Context | None) -> click.Context:
    # the command's own settings (e.g. the group's `-h`), as `make_context` would apply them
    settings = {**command.context_settings, "terminal_width": WIDTH, "max_content_width": WIDTH}
    return click.Context(command, info_name=name, parent=parent, **settings)


def _walk(command: click.Command, name: str, parent: click.Context | None):
    """(command path, help text) of `command` and, for a group, of every subcommand, in order."""
    ctx = _context(command, name, parent)
    yield ctx.command_path, command.get_help(ctx)
    if isinstance(command, click.Group):
        for sub_name in command.list_commands(ctx):
            sub = command.get_command(ctx, sub_name)
            if sub is not None and not sub.hidden:
                yield from _walk(sub, sub_name, ctx)


def render() -> str:
    """The markdown of docs/cli.md: one section per command, its `--help` verbatim."""
    from kvstore.cli.main import main as group

    sections = list(_walk(group, "kvstore", None))
    out = [HEADER, "## Commands\n"]
    out += [f"- [`{path}`](#{_anchor(path)})" for path, _ in sections]
    out.append("")
    for path, text in sections:
        out += [f"## `{path}`", "", "```text", text.rstrip(), "```", ""]
    return "\n".join(out)


def _anchor(path: str) -> str:
    """The anchor GitHub gives the heading `## \\`path\\``: lower case, spaces as hyphens."""
    return path.lower().replace(" ", "-")


def main() -> None:
    click.echo(render(), nl=False)


if __name__ == "__main__":
    main()
