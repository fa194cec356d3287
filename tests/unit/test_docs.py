"""The documents stay true to the checkout: every relative link in README.md, CONTRIBUTING.md and
docs/*.md names a file that exists, and every ``stepline …`` command line shown in their fenced
code blocks is one the CLI parses (its ``--help`` answers, and its options and arguments are
accepted) — in process, through the CLI's own click command."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from app.cli import cli

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_COMMAND = re.compile(r"(?:^|(?<=[\s;&|(])|(?<=bin/))stepline\s+(\S.*)")
"""``stepline …`` as a command: at the line's start, after a blank or a shell operator, or as
``….venv/bin/stepline`` (not a path's last part, as in ``/var/lib/stepline``)."""


@dataclass(frozen=True)
class Shown:
    document: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.document}:{self.line}: {self.text}"


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def relative_links(path: Path) -> list[Shown]:
    """Links of ``path`` that are neither URLs (``scheme:``) nor anchors in the page itself."""
    text = path.read_text()
    return [Shown(_name(path), text.count("\n", 0, m.start()) + 1, m.group(1))
            for m in _LINK.finditer(text)
            if not re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", m.group(1))
            and not m.group(1).startswith("#")]


def broken_links(path: Path) -> list[str]:
    return [str(link) for link in relative_links(path)
            if not (path.parent / link.text.split("#", 1)[0]).exists()]


def shown_commands(path: Path) -> list[Shown]:
    """Each ``stepline`` command line in a fenced block of ``path``: continuation lines joined,
    a trailing comment and what follows ``;``, ``&&`` or ``|`` cut off."""
    text = path.read_text()
    found = []
    for block in _FENCE.finditer(text):
        first = text.count("\n", 0, block.start()) + 2
        lines = block.group(1).split("\n")
        joined: list[tuple[int, str]] = []
        for i, line in enumerate(lines):
            if joined and joined[-1][1].endswith("\\"):
                joined[-1] = (joined[-1][0], joined[-1][1][:-1] + " " + line.strip())
            else:
                joined.append((first + i, line))
        for number, line in joined:
            for part in re.split(r";|&&|\|", line):
                if match := _COMMAND.search(part.split(" #", 1)[0]):
                    found.append(Shown(_name(path), number, " ".join(match.group(1).split())))
    return found


def command_problem(args: list[str]) -> str | None:
    """Why the CLI would refuse ``stepline <args>`` before running it, or None."""
    command: Any = typer.main.get_command(cli)
    path: list[str] = []
    rest = list(args)
    while rest and rest[0] in (getattr(command, "commands", None) or {}):
        path.append(rest.pop(0))
        command = command.commands[path[-1]]
    if not path:
        return f"no subcommand in {args}"
    shown = CliRunner().invoke(cli, [*path, "--help"])
    if shown.exit_code != 0:
        return f"stepline {' '.join(path)} --help exited {shown.exit_code}: {shown.output}"
    try:
        command.make_context(" ".join(["stepline", *path]), rest, resilient_parsing=False)
    except typer.Exit:
        return None
    except typer.TyperException as exc:  # the CLI's click errors: a bad option, a bad value
        format_message = getattr(exc, "format_message", None)
        message = format_message() if callable(format_message) else str(exc)
        return f"stepline {' '.join(args)}: {message}"
    return None


@pytest.mark.parametrize("path", DOCUMENTS, ids=_name)
def test_every_relative_link_of_a_document_names_a_file_that_exists(path: Path) -> None:
    assert broken_links(path) == []


def test_the_documents_show_stepline_commands() -> None:
    # the parse check below would pass vacuously on a document layout it no longer reads
    assert len([c for p in DOCUMENTS for c in shown_commands(p)]) >= 10


@pytest.mark.parametrize("path", DOCUMENTS, ids=_name)
def test_every_stepline_command_a_document_shows_is_one_the_cli_parses(path: Path) -> None:
    problems = [f"{shown}: {problem}" for shown in shown_commands(path)
                if (problem := command_problem(shlex.split(shown.text))) is not None]
    assert problems == []


def test_the_checks_catch_a_broken_link_and_an_unknown_option(tmp_path: Path) -> None:
    # given a document with a link to a missing file and a command with an unknown option
    doc = tmp_path / "doc.md"
    (tmp_path / "here.md").write_text("")
    doc.write_text("[ok](here.md#part) [gone](missing.md) [web](https://example.org)\n\n"
                   "```bash\nstepline submit --kind simulated \\\n  --no-such-option 1\n"
                   "stepline jobs  # a table\n"
                   "export STEPLINE_RUN_DIR=/var/lib/stepline  # a path, not a command\n```\n")
    # when the checks read it
    links = [link.text for link in relative_links(doc)]
    commands = [c.text for c in shown_commands(doc)]
    # then the missing file and the unknown option are reported, the rest passes
    assert links == ["here.md#part", "missing.md"]
    assert [link.split(": ", 1)[1] for link in broken_links(doc)] == ["missing.md"]
    assert commands == ["submit --kind simulated --no-such-option 1", "jobs"]
    assert "no-such-option" in str(command_problem(shlex.split(commands[0])))
    assert command_problem(shlex.split(commands[1])) is None
