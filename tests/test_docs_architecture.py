"""docs/architecture.md's map cannot drift from the tree: every module of src/phantomclip is listed exactly once under
its package, nothing is listed that is gone, and each package's "may import" is the line its __init__ docstring
states (the line tests/test_layers.py enforces). And every import path the docs and examples show works, while a path
of 0.1's flat layout fails with one line naming its new home."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_layers import PACKAGE, plan

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "architecture.md"
ENTRY = re.compile(r"^(?P<indent> *)(?P<name>[A-Za-z_0-9]+(?:\.py|/))(?: +(?P<text>.*))?$")


def map_block() -> list[str]:
    """The lines of the map: the first fenced block, from its 'src/phantomclip/' line on."""
    text = MAP.read_text()
    block = text.split("```", 2)[1].splitlines()
    start = next(i for i, line in enumerate(block) if line.startswith("src/phantomclip/"))
    return block[start + 1:]


def listed(lines: list[str]) -> tuple[list[str], dict[str, str]]:
    """(every module path the map lists, in order, relative to src/phantomclip; package -> the text of its line and
    the continuation lines under it). Depth comes from the indentation: two spaces a level."""
    stack: list[str] = []
    paths, packages = [], {}
    current = None
    for line in lines:
        m = ENTRY.match(line)
        if not m or len(m["indent"]) % 2:
            if current is not None and line.strip() and not m:  # a package line's continuation
                packages[current] += " " + line.strip()
            continue
        depth = len(m["indent"]) // 2 - 1
        stack = stack[:depth]
        name = m["name"]
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
            current = "/".join(stack)
            packages[current] = m["text"] or ""
        else:
            paths.append("/".join([*stack, name]))
            current = None
    return paths, packages


def tree() -> list[str]:
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                  if p.name != "__init__.py" or p.parent == PACKAGE)


def test_the_map_lists_every_module_once_and_nothing_else():
    paths, _ = listed(map_block())
    twice = sorted({p for p in paths if paths.count(p) > 1})
    assert not twice, f"listed twice in docs/architecture.md: {twice}"
    assert sorted(paths) == tree(), (f"missing from the map: {sorted(set(tree()) - set(paths))}; "
                                     f"listed but not in the tree: {sorted(set(paths) - set(tree()))}")


def test_the_map_says_what_each_package_may_import():
    _, packages = listed(map_block())
    for package, allowed in plan().items():
        line = packages.get(package)
        assert line is not None, f"package {package}/ is not in the map"
        said = re.search(r"may import (.+?)(?: \(|$)", line)
        assert said, f"{package}/: its map line does not say what it may import: {line!r}"
        words = said[1].replace("\n", " ")
        if allowed is None:
            assert words.startswith("every package"), (package, words)
        elif not allowed:
            assert words.startswith("nothing"), (package, words)
        else:
            named = {w.strip(" ,") for w in re.split(r",\s*", words) if w.strip()}
            assert named == allowed, f"{package}/: the map says {sorted(named)}, its __init__ {sorted(allowed)}"


def test_the_map_reader_sees_what_it_should():
    lines = ["  __init__.py   root", "  base/   leaf: may import nothing", "    errors.py   e",
             "  engines/   x: may import base,", "             precision", "    local.py   l", "    sub/   s",
             "      deep.py   d", "    vllm.py   v"]
    paths, packages = listed(lines)
    assert paths == ["__init__.py", "base/errors.py", "engines/local.py", "engines/sub/deep.py", "engines/vllm.py"]
    assert packages["engines"] == "x: may import base, precision" and packages["base"] == "leaf: may import nothing"


DOCUMENTED = re.compile(r"^\s*from (phantomclip(?:\.\w+)*) import ([\w, ]+)", re.M)


def documented_imports() -> list[tuple[str, str, str]]:
    """(file, module, name) for every `from phantomclip... import ...` line in README.md, docs/ and examples/."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.py"))]:
        for m in DOCUMENTED.finditer(path.read_text()):
            for name in m[2].split(","):
                found.append((str(path.relative_to(ROOT)), m[1], name.strip()))
    return found


def test_every_documented_import_path_works():
    found = documented_imports()
    assert len({f for f, _, _ in found}) >= 3, "the docs and examples show imports; the reader found too few"
    broken = []
    for where, module, name in found:
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            broken.append(f"{where}: from {module} import {name}: {e}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("code,says", [
    ("import phantomclip.recipes", "phantomclip.recipes moved to phantomclip.precision.recipes: import from there"),
    ("from phantomclip.integrations.trl_async_ratio import RATIOS",
     "phantomclip.integrations.trl_async_ratio moved to phantomclip.integrations.trl_async.ratio"),
    ("from phantomclip.models import load_model",
     "phantomclip.models.load_model moved to phantomclip.models.load.load_model"),
    ("from phantomclip.runs import RunDir", "phantomclip.runs.RunDir moved to phantomclip.runs.rundir.RunDir"),
    ("from phantomclip.cli.main import main; main(['--version'])", None),  # the entry point the install names
])
def test_an_old_path_fails_in_one_line_naming_the_new_one(code, says):
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if says is None:
        assert run.returncode == 0, run.stderr
        return
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1 and last.split(": ", 1)[1].startswith(says), last


def test_a_missing_name_of_a_package_stays_an_attribute_error():
    # hasattr and `from pkg import submodule` rely on AttributeError for names no module of the package defines
    import phantomclip.models

    assert not hasattr(phantomclip.models, "no_such_name")
    from phantomclip.models import prompts  # a submodule not imported yet: found, not reported as moved

    assert prompts.__name__ == "phantomclip.models.prompts"
