"""A manual page for one of our click commands, from its own help texts.

    python -B manpage.py NAME MODULE:ATTR SECTION VERSION DATE SUMMARY > NAME.SECTION

build-deb.sh runs it with the staged virtualenv's interpreter, so the page
always says what `NAME --help` and `NAME VERB --help` say in that build. Not
installed: a build step only.
"""
from __future__ import annotations

import importlib
import sys

import click

WIDTH = 76


def roff(text: str) -> str:
    """Plain text as roff lines for a no-fill block: backslashes and hyphens
    escaped, a line that starts with a control character kept as text."""
    out = []
    for line in text.rstrip("\n").splitlines():
        line = line.replace("\\", "\\e").replace("-", "\\-")
        if line.startswith((".", "'")):
            line = "\\&" + line
        out.append(line)
    return "\n".join(out)


def walk(command: click.Command, path: list[str], parent: click.Context | None):
    """(path, help text) of the command and every subcommand below it."""
    ctx = click.Context(command, info_name=path[-1], parent=parent, terminal_width=WIDTH,
                        max_content_width=WIDTH)
    yield path, command.get_help(ctx)
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from walk(sub, [*path, name], ctx)


def page(name: str, command: click.Command, section: str, version: str, date: str,
         summary: str) -> str:
    lines = [f'.TH {name.upper()} {section} "{date}" "slurm-recovery {version}" '
             f'"slurm-recovery"',
             ".SH NAME", f"{roff(name)} \\- {roff(summary)}",
             ".SH DESCRIPTION",
             f"The text below is what \\fB{roff(name)} \\-\\-help\\fR prints"
             + (", then each command's own \\fB\\-\\-help\\fR." if
                isinstance(command, click.Group) else "."),
             "The guides are in /opt/slurm\\-recovery/share/doc/slurm\\-recovery/docs/.",
             ".PP", ".nf"]
    sections = list(walk(command, [name], None))
    lines.append(roff(sections[0][1]))
    lines.append(".fi")
    if len(sections) > 1:
        lines.append(".SH COMMANDS")
        for path, text in sections[1:]:
            lines += [f".SS {roff(' '.join(path[1:]))}", ".nf", roff(text), ".fi"]
    lines += [".SH SEE ALSO", "\\fBrecovery\\-ctl\\fR(1), \\fBrecovery\\-agent\\fR(8),"
              " \\fBsbatch\\fR(1), \\fBslurm.conf\\fR(5)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    name, target, section, version, date, summary = argv
    module, _, attr = target.partition(":")
    command = getattr(importlib.import_module(module), attr)
    sys.stdout.write(page(name, command, section, version, date, summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
