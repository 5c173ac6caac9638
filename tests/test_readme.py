"""The README keeps telling the truth: every `dynamo-ppd ...` command it shows parses with the
CLI's own parser, every `uv run just ...` names a recipe of the justfile, every relative link (of
the README and of the docs pages it links) is a file, and the facts it quotes from code (the
table's request-rate levels) are the code's. Also: `just --list` shows each recipe's whole doc."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from dynamo_ppd.cli import build_parser
from dynamo_ppd.policy.grid import default_grid

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
JUSTFILE = REPO / "justfile"


def code_block_lines(text: str) -> list[str]:
    """The command lines of the ```bash blocks: continuations joined, comments dropped."""
    lines, inside, pending = [], False, ""
    for line in text.splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash"
            continue
        if not inside:
            continue
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        try:
            command = shlex.split(line, comments=True)
        except ValueError:  # a quoted argument (a JSON body) goes on over the next lines
            pending = line + " "
            continue
        pending = ""
        if command:
            lines.append(shlex.join(command))
    return lines


def inline_commands(text: str) -> list[str]:
    """`uv run ...`, `dynamo-ppd ...` and `python -m dynamo_ppd...` commands written inline in the
    prose (a command split over two lines is joined)."""
    text = re.sub(r"\s*\n\s*", " ", text)
    return re.findall(r"`((?:uv run |dynamo-ppd |python3? -m dynamo_ppd)[^`]*)`", text)


def recipes() -> set[str]:
    return set(re.findall(r"^([a-z][a-z0-9-]*)(?:\s[^:\n]*)?:(?!=)", JUSTFILE.read_text(), re.MULTILINE))


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def check_dynamo_ppd(argv: list[str]) -> None:
    """Parse ``argv`` (after `dynamo-ppd`) as the CLI would. With --help, or named alone in the
    prose (`dynamo-ppd sim compare`: command words only), the command must exist."""
    parser = build_parser()
    if "--help" in argv or "-h" in argv:
        for word in [a for a in argv if a not in ("--help", "-h")]:
            choices = _subparsers(parser)
            assert word in choices, f"dynamo-ppd {' '.join(argv)}: no command {word!r}"
            parser = choices[word]
        return
    command, words = parser, list(argv)
    while words and words[0] in _subparsers(command):
        command = _subparsers(command)[words.pop(0)]
    if argv and not words:  # names only: the command exists, its arguments are elsewhere
        return
    try:
        parser.parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"dynamo-ppd {' '.join(argv)} does not parse (exit {exc.code})") from None


def check_command(command: str) -> None:
    words = shlex.split(command)
    if words[:2] == ["uv", "run"]:
        words = words[2:]
    if words[0] == "dynamo-ppd":
        check_dynamo_ppd(words[1:])
    elif words[0] == "just":
        assert words[1] == "--list" or words[1] in recipes(), f"{command}: no recipe {words[1]!r}"
    elif words[0] in ("python", "python3") and words[1].endswith(".py"):
        assert (REPO / words[1]).is_file(), f"{command}: no {words[1]}"
    elif words[0] in ("python", "python3") and words[1] == "-m" and words[2].startswith("dynamo_ppd"):
        path = REPO / words[2].replace(".", "/")
        assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), \
            f"{command}: no module {words[2]} to run"


def test_every_command_in_the_readme_parses(capsys):
    text = README.read_text()
    commands = code_block_lines(text) + inline_commands(text)
    checked = [c for c in commands if re.match(r"(uv run )?(dynamo-ppd|just|python) ", c)]
    assert len(checked) >= 8, checked  # the quick start, the demo, sim, bench, advise at least
    for command in checked:
        check_command(command)
    # `just` is reached through `uv run` only (it is a dev dependency of the environment).
    assert not re.search(r"(?<!uv run )`just ", text)
    assert not re.search(r"^just ", text, re.MULTILINE)


DOCS = REPO / "docs"


def test_every_command_in_the_docs_parses():
    """The same check over every page of docs/ (reports write the command that made them in their
    first lines: a renamed flag or a moved module shows up here)."""
    checked, wrong = 0, []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for command in code_block_lines(text) + inline_commands(text):
            if not re.match(r"(uv run )?(dynamo-ppd|just|python3? (-m dynamo_ppd|\S+\.py))\b", command):
                continue
            if "$" in command:
                continue  # a line of a shell loop: its variables are set by the loop
            try:
                shlex.split(command)
            except ValueError:
                continue  # an inline command quoted in part only
            try:
                check_command(command)
            except AssertionError as exc:
                wrong.append(f"{page.relative_to(REPO)}: {exc}")
            checked += 1
    assert wrong == [], "\n".join(wrong)
    assert checked > 50


def test_a_command_that_does_not_parse_is_caught():
    with pytest.raises(AssertionError, match="does not parse"):
        check_command("uv run dynamo-ppd sim run --router nope")
    with pytest.raises(AssertionError, match="no recipe"):
        check_command("uv run just nope")
    with pytest.raises(AssertionError, match="no command"):
        check_command("uv run dynamo-ppd nope --help")
    with pytest.raises(AssertionError, match="no module"):
        check_command("python -m dynamo_ppd.bench.nope --rate 2")


def links(path: Path) -> list[str]:
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text())
            if not re.match(r"[a-z]+:", target) and not target.startswith("#")]


def test_the_docs_index_names_every_page():
    """docs/README.md has a line for every page of docs/ (a group of docs/bench/ by its name)."""
    index = (DOCS / "README.md").read_text()
    for page in sorted(DOCS.glob("*.md")):
        assert page.name == "README.md" or page.name in index, f"docs/README.md does not name {page.name}"
    for page in sorted((DOCS / "bench").glob("*.md")):
        stem = re.sub(r"-(local|ppd|c20)$", "", page.stem)
        assert f"bench/{stem}" in index, f"docs/README.md does not name bench/{page.name}"


def test_every_relative_link_is_a_file():
    pages = [README]
    for target in links(README):
        path = (README.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"README.md links {target}, which does not exist"
    pages += sorted(DOCS.rglob("*.md"))  # every page of docs/, linked from the README or not
    assert len(pages) > 5
    for page in pages[1:]:
        for target in links(page):
            assert (page.parent / target.split("#")[0]).exists(), f"{page.name} links {target}"


def test_the_readme_quotes_the_tables_request_rate_levels():
    levels = ", ".join(f"{q:g}" for q in default_grid().qps_levels)
    assert f"nearest of {levels.rsplit(', ', 1)[0]}, {levels.rsplit(', ', 1)[1]} requests/s" in \
        " ".join(README.read_text().split())


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) < 250


def test_just_list_shows_each_recipes_whole_doc():
    """`just --list` shows only the last line of a recipe's comment block: one line each, longer
    notes in a block of their own, separated by a blank line."""
    lines = JUSTFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"^([a-z][a-z0-9-]*)(?:\s[^:]*)?:(?!=)", line)
        if not match:
            continue
        j = i - 1
        while j >= 0 and lines[j].startswith("["):  # attributes sit between the doc and the recipe
            j -= 1
        block = 0
        while j >= 0 and lines[j].startswith("#"):
            block, j = block + 1, j - 1
        assert block == 1, f"recipe {match.group(1)}: {block} comment lines above it (want one)"
