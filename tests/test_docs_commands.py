"""Every ``gpufleet ...`` command the README and the docs show is one the CLI has (issue 36: the
docs said ``gpufleet status``, which does not exist, ``gpufleet join <site>`` where the site is
``--site``, and "``gpufleet accounts`` lists it" where ``gpufleet accounts`` prints its help).

Read from the Markdown as a reader copies it: each shell line of a fenced code block and each
inline code span that starts with ``gpufleet``, or runs it in a pod (``kubectl exec ... --
gpufleet ...``: the production install runs the commands that need Temporal inside the control
plane's pod), in the docs and in every deploy/ README. Its sub-command path must exist in the
typer app and end at a command (a bare group only prints its help); every option it names must
be one that command takes, and it may give no more arguments than the command has. No server:
the app's click tree is walked."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import typer

from cli.main import app

ROOT = Path(__file__).resolve().parents[1]
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: Fences whose lines are shell (an unnamed fence too); a Python or YAML block is not read.
SHELL_FENCES = {"", "bash", "sh", "shell", "console", "text", "shell-session", "zsh"}
#: Where, in a shell line, a command starts: the line's start, or after one of these.
SEPARATORS = re.compile(r"&&|\|\||[;|]|\$\(")
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
PROGRAM = re.compile(r"^(?:\S*/)?gpufleet$")
KUBECTL = re.compile(r"^(?:\S*/)?kubectl$")
#: Words that stand for something the reader fills in or a family of commands.
PLACEHOLDER = re.compile(r"^(\.\.\.|…|<.*|\{.*|\[.*)$")


def pages() -> list[Path]:
    """The README, every docs page, the files the pages include (``--8<-- "path"``) and every
    README under deploy/ (the install steps beside the manifests and the chart)."""
    included = {ROOT / m for page in DOC_PAGES for m in re.findall(r'^--8<-- "([^"]+)"', page.read_text(), re.M)}
    return DOC_PAGES + sorted(included | set((ROOT / "deploy").rglob("README.md")))


@dataclass(frozen=True)
class Shown:
    page: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def command_words(segment: str) -> list[str] | None:
    """The words after ``gpufleet`` when ``segment`` runs it (after a prompt and variables, or
    in a pod: after ``kubectl ... exec ... --``)."""
    segment = segment.strip().removeprefix("$ ").strip()
    try:
        words = shlex.split(segment, comments=True)
    except ValueError:  # an unclosed quote: read it word by word
        words = segment.split("#")[0].split()
    while words and ENV_ASSIGNMENT.match(words[0]):
        words.pop(0)
    if words and KUBECTL.match(words[0]) and "exec" in words and "--" in words:
        words = words[words.index("--") + 1:]  # what the pod runs
    if not words or not PROGRAM.match(words[0]):
        return None
    return words[1:]


def page_lines(page: Path) -> Iterator[tuple[int, str, bool]]:
    """The lines of a Markdown page as (number, text, whether in a shell fence): a shell line
    continued with a backslash comes whole, numbered by its last line; other fences' lines are left out."""
    fence: str | None = None  # the open fence's language, or None outside one
    pending = ""  # a shell line continued with a backslash
    for number, line in enumerate(page.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped.strip("`").strip().split(" ")[0].lower()
        elif fence is None:
            yield number, line, False
        elif fence in SHELL_FENCES:
            text = pending + stripped
            pending = text[:-1] + " " if text.endswith("\\") else ""
            if not pending:
                yield number, text, True


def shown_commands(page: Path) -> list[tuple[Shown, list[str]]]:
    """Every gpufleet command line on the page, with its words after ``gpufleet``."""
    found: list[tuple[Shown, list[str]]] = []
    name = str(page.relative_to(ROOT))

    def add(number: int, text: str) -> None:
        for segment in SEPARATORS.split(text):
            words = command_words(segment)
            if words is not None:
                found.append((Shown(name, number, segment.strip()), words))

    for number, line, shell in page_lines(page):
        if shell:
            add(number, line)
            continue
        if line.strip().startswith("#"):
            continue  # a heading names a command or a group (the reference's "## `gpufleet sim`")
        for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", line):
            # A span that is only the program's name names it; "\|" is a pipe inside a table.
            if span.startswith("gpufleet "):
                add(number, span.replace("\\|", "|").removesuffix("\\"))
    return found


def _is_group(command: Any) -> bool:
    # By shape: typer carries a click of its own, whose classes are not the click package's.
    return hasattr(command, "commands")


def _passes_through(command: Any) -> bool:
    """A command that hands its words to a parser of its own (``gpufleet node-gateway``'s argparse)."""
    return bool((getattr(command, "context_settings", None) or {}).get("ignore_unknown_options"))


def _is_option(word: str) -> bool:
    return word.startswith("-") and word != "-" and not re.match(r"^-\d", word)


def problems_of(words: list[str], root: Any) -> list[str]:
    """What is wrong with ``gpufleet <words>``: an unknown sub-command, a group run bare, an
    option its command does not take, an argument too many. ``...``, ``<placeholder>`` and
    ``[OPTIONS]`` stand for what the reader fills in."""
    command, path, rest = root, ["gpufleet"], list(words)
    while _is_group(command) and rest and not _is_option(rest[0]):
        if PLACEHOLDER.match(rest[0]):
            return []  # "gpufleet sim <knob> ...": a family of commands, not one
        sub = command.commands.get(rest[0])
        if sub is None:
            return [f"`{' '.join(path)}` has no command {rest[0]!r} (it has: {', '.join(sorted(command.commands))})"]
        command, path = sub, [*path, rest.pop(0)]
    if _is_group(command):
        if rest[:1] == ["--help"] or command.invoke_without_command:
            return []
        return [f"`{' '.join(path)}` is a group: alone it prints its help "
                f"(name one of: {', '.join(sorted(command.commands))})"]
    if _passes_through(command):
        return []
    options = [p for p in command.params if p.param_type_name == "option"]
    names = {"--help"} | {o for p in options for o in (*p.opts, *p.secondary_opts)}
    takes_value = {o for p in options if not p.is_flag and not p.count for o in (*p.opts, *p.secondary_opts)}
    found, positional, value_next = [], [], False
    for word in rest:
        if value_next:
            value_next = False
        elif _is_option(word):
            option = word.split("=", 1)[0]
            if option not in names:
                found.append(f"`{' '.join(path)}` takes no option {option} "
                             f"(it takes: {', '.join(sorted(o for o in names if o.startswith('--')))})")
            value_next = "=" not in word and option in takes_value
        elif PLACEHOLDER.match(word) and not word.startswith("<"):
            return found  # "[OPTIONS]", "...": the rest is elided
        else:
            positional.append(word)
    arguments = [p for p in command.params if p.param_type_name == "argument"]
    if not any(a.nargs == -1 for a in arguments) and len(positional) > sum(a.nargs for a in arguments):
        found.append(f"`{' '.join(path)}` takes {sum(a.nargs for a in arguments)} argument(s), "
                     f"not {len(positional)} ({' '.join(positional)})")
    return found


@pytest.fixture(scope="module")
def root() -> Any:
    return typer.main.get_command(app)


def test_the_docs_show_commands_at_all() -> None:
    """The reader above finds the commands (a broken reader would pass the next test vacuously)."""
    shown = [s for page in pages() for s, _ in shown_commands(page)]
    assert len(shown) > 100, len(shown)
    assert {"README.md", "docs/getting-started.md", "docs/production/joining.md",
            "deploy/temporal/README.md", "deploy/kubernetes/README.md",
            "deploy/helm/gpufleet/README.md"} <= {s.page for s in shown}
    in_the_pod = [s for s in shown if s.text.startswith("kubectl")]
    assert {"docs/production/index.md", "deploy/temporal/README.md", "deploy/helm/gpufleet/README.md"} <= {
        s.page for s in in_the_pod}, in_the_pod


def test_every_command_in_the_readme_and_the_docs_exists(root: Any) -> None:
    wrong = [f"{shown}\n    {problem}" for page in pages() for shown, words in shown_commands(page)
             for problem in problems_of(words, root)]
    assert not wrong, "commands the CLI does not have:\n" + "\n".join(wrong)


@pytest.mark.parametrize("line, problem", [
    ("gpufleet status", "has no command 'status'"),
    ("gpufleet join <site>", "`gpufleet join` takes 0 argument(s), not 1"),  # the site is --site
    ("gpufleet accounts", "`gpufleet accounts` is a group"),
    ("gpufleet capacity --gpu H100 --region eu", "takes no option --region"),
    ("gpufleet sim revoke a b", "takes 1 argument(s), not 2"),
    # run in the control plane's pod: the same CLI
    ("kubectl -n gpufleet exec deploy/gpufleet-control-plane -c worker -- gpufleet schedule apply",
     "has no command 'schedule'"),
    ("kubectl -n gpufleet exec deploy/gpufleet-control-plane -- gpufleet search-attributes --adress x:7233",
     "takes no option --adress"),
])
def test_the_old_mistakes_are_caught(root: Any, line: str, problem: str) -> None:
    assert any(problem in p for p in problems_of(command_words(line), root)), (line, problems_of(command_words(line), root))


@pytest.mark.parametrize("line", [
    "gpufleet join --site lambda-us-east --wait", "gpufleet accounts list", "gpufleet sim revoke nebius-main --restore",
    "gpufleet capacity --gpu H100 --geo eu", "gpufleet sites -o json", "gpufleet sim <knob> ...", "gpufleet --help",
    "gpufleet sim fault <node> --gpu 3 --xid 79", "GPUFLEET_CONFIG=x.yaml gpufleet nodes",
    "gpufleet advisor [OPTIONS]", "gpufleet node-gateway --dev",
    "kubectl -n gpufleet exec deploy/gpufleet-control-plane -c worker -- gpufleet schedules apply",
])
def test_the_right_commands_pass(root: Any, line: str) -> None:
    assert problems_of(command_words(line), root) == []


def test_the_python_it_needs_is_stated_and_an_older_one_is_told_so(monkeypatch, capsys) -> None:
    """README and Getting started say Python 3.11 or newer, as pyproject.toml requires; bootstrap.py,
    run by an older Python, says so in one line and exits 2 instead of failing with a traceback."""
    import runpy
    import sys
    import tomllib

    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"] == ">=3.11"
    for page in ("README.md", "docs/getting-started.md"):
        setup = (ROOT / page).read_text().split("## Set up", 1)[1].split("\n## ", 1)[0]
        assert "Python 3.11 or newer" in setup, page
    monkeypatch.setattr(sys, "version_info", (3, 10, 13, "final", 0))
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(ROOT / "bootstrap.py"), run_name="__main__")
    assert exited.value.code == 2
    said = capsys.readouterr()
    assert said.out == ""
    assert said.err.count("\n") == 1 and "needs Python 3.11 or newer; this is Python 3.10" in said.err, said.err
