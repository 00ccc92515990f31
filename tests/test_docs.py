"""The manual cannot rot: every relative link and anchor in README.md and docs/ resolves, every `phantomclip ...`
command in their fenced blocks parses (its subcommand and every flag exist; nothing is run), and no page names the
planning history (issue numbers) instead of what it means."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import phantomclip.cli.main as cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped (hyphens and underscores kept),
    spaces to hyphens."""
    text = re.sub(r"`|\*\*|\*", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers repeated headings
    return found


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def commands(page: Path) -> list[str]:
    """Each `phantomclip ...` command of the page's fenced blocks, continuation lines joined, comments dropped."""
    found = []
    for block in FENCE.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|\|\||;|\|", line.split(" # ")[0]):
                words = part.split()
                while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value prefixes
                    words.pop(0)
                if words[:1] == ["phantomclip"]:
                    found.append(" ".join(words))
    return found


DOC_COMMANDS = [(page.name, c) for page in PAGES for c in commands(page)]


def test_the_docs_show_commands():
    assert len(DOC_COMMANDS) >= 20, DOC_COMMANDS  # the extraction itself works (a regex gone wrong finds none)


@pytest.mark.parametrize("page,command", DOC_COMMANDS)
def test_every_documented_command_parses(page, command, monkeypatch, capsys):
    ran = []
    for name in ("_run_diagnose", "_run_train", "_run_experiment", "_run_trace", "_run_engines", "_run_report"):
        monkeypatch.setattr(cli, name, lambda args, name=name: ran.append(name) or 0)
    argv = shlex.split(command)[1:]
    try:
        code = cli.main(argv)
    except SystemExit as e:  # --help, or argparse refusing a flag
        code = e.code
    err = capsys.readouterr().err
    assert code == 0 and (ran or "--help" in argv), f"{page}: `{command}` does not parse: {err.strip()}"


ISSUE = re.compile(r"\bissues? \d+|\bissue-\d+", re.I)


def test_no_planning_history_in_the_product():
    """Definitions cite their source (a paper, another project's file), not the issue that asked for them."""
    files = [*PAGES, *sorted((ROOT / "src").rglob("*.py")), *sorted((ROOT / "tests").glob("*.py")),
             *sorted((ROOT / "scripts").glob("*")), *sorted((ROOT / "bench").rglob("*.py"))]
    found = [f"{p.relative_to(ROOT)}:{i}" for p in files if p.is_file() and p != Path(__file__)
             for i, line in enumerate(p.read_text().splitlines(), 1) if ISSUE.search(line)]
    assert not found, "issue numbers in code, docs or tests: " + ", ".join(found)
