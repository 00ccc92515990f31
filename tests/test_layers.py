"""The house plan, enforced on packages: phantomclip is one package per concept, each package's __init__ docstring
says what it may import ("May import: a, b."), and every import between packages follows those lines; the lines
together form no cycle, so they are layers; no module imports another's private name, and no modules form a cycle
inside a package. docs/architecture.md's map is checked against the tree (tests/test_docs_architecture.py).

The plan (docs: /work/shared/DESIGN.md section 3), bottom to top:
  base                                    errors, files, owned paths, locks, console, devices, numerics
  precision, maths, models, runs          recipes and scoring; loss, metrics, frameworks' figures; the model and
                                          prompts; run directories
  engines -> routing -> rollouts          the engines; expert routes; the rollout record
  answer                                  the answer, from a result dict alone
  training, trace, diagnose               the jobs (none imports another)
  report, integrations, cli               the surfaces
The package root (phantomclip/__init__.py: version constants, where the old flat paths went) is below them all:
anyone may import it, it imports nothing of the package.

Imports are read with `ast`, at module level and inside functions alike (the package imports lazily a lot), so
the check is about the code's dependencies, not about what happens to run first.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import phantomclip

PACKAGE = Path(phantomclip.__file__).parent
ROOT = ""
"""module name of phantomclip/__init__.py (displayed as 'phantomclip')."""
EVERY = "every package"
"""what the top surface (cli) writes in its May import line."""


@dataclass(frozen=True)
class Import:
    """One import of a phantomclip module by another: `src` -> `dst`, naming `name` (None for a whole module)."""

    src: str
    dst: str
    name: str | None
    line: int


def module_name(path: Path) -> str:
    """'engines/vllm.py' -> 'engines.vllm', 'engines/__init__.py' -> 'engines', '__init__.py' -> ''."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def show(module: str) -> str:
    return module or "phantomclip"


def package_of(module: str) -> str:
    """The top-level package a module belongs to ('integrations.trl_async.ratio' -> 'integrations'); '' for the
    root."""
    return module.split(".")[0]


def may_import(init: Path) -> set[str] | None:
    """The packages a package's __init__ docstring says it may import ("May import: base, precision." -> {'base',
    'precision'}; "nothing" -> set(); "every package" -> None, meaning any), or an AssertionError naming the file."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    found = re.search(r"^May import: (.+?)\.?$", doc, re.M)
    assert found, f"{init}: its docstring has no 'May import: ...' line (the house plan, tests/test_layers.py)"
    line = found[1].strip()
    if line == EVERY:
        return None
    if line.startswith("nothing"):
        return set()
    return {name.strip() for name in line.split(",")}


def plan() -> dict[str, set[str] | None]:
    """Every top-level package -> what its __init__ says it may import."""
    return {p.name: may_import(p / "__init__.py") for p in sorted(PACKAGE.iterdir())
            if (p / "__init__.py").is_file()}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    """Every import of a phantomclip module in `path` (relative ones resolved), plus private attribute uses
    through a module alias (`from . import recipes; recipes._x`)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found, aliases = [], {}  # aliases: local name -> phantomclip module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "phantomclip" or a.name.startswith("phantomclip."):
                    target = a.name.removeprefix("phantomclip").removeprefix(".")
                    found.append(Import(module, target, None, node.lineno))
                    if a.asname:
                        aliases[a.asname] = target
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from ..x import y` inside package a.b -> a.x
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module == "phantomclip" or (node.module or "").startswith("phantomclip."):
                target = node.module.removeprefix("phantomclip").removeprefix(".")
            else:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}" if target else a.name
                if sub in known:  # `from . import vllm`: the submodule itself
                    found.append(Import(module, sub, None, node.lineno))
                    aliases[a.asname or a.name] = sub
                else:
                    found.append(Import(module, target, a.name, node.lineno))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if is_private(node.attr):
                found.append(Import(module, aliases[node.value.id], node.attr, node.lineno))
    return [i for i in found if i.dst != module]


def import_graph() -> list[Import]:
    mods = modules()
    return [i for m, p in mods.items() for i in imports_of(m, p, set(mods))]


def violations(edges: list[Import], rules: dict[str, set[str] | None]) -> list[str]:
    """'kind: src -> dst (names)' for every import against the plan `rules` (package -> what it may import, None for
    any), one line per module pair and kind: an import between packages that the importer's plan does not name, a
    private name, a cycle of modules."""
    bad: dict[tuple[str, str, str], set[str]] = {}

    def flag(kind: str, e: Import, name: str | None = None) -> None:
        bad.setdefault((kind, e.src, e.dst), set()).add(name or e.name or "module")

    for e in edges:
        src, dst = package_of(e.src), package_of(e.dst)
        allowed = rules.get(src, set())
        if dst != ROOT and dst != src and allowed is not None and dst not in allowed:
            flag(f"{src} may not import {dst}", e)
        if e.name and is_private(e.name):
            flag("private name", e)
    for cycle in cycles(edges):
        for a, b in zip(cycle, cycle[1:]):
            for e in edges:
                if (e.src, e.dst) == (a, b):
                    flag("cycle " + " -> ".join(map(show, cycle)), e)
    return [f"{kind}: {show(s)} -> {show(d)} ({', '.join(sorted(names))})"
            for (kind, s, d), names in sorted(bad.items())]


def plan_cycles(rules: dict[str, set[str] | None]) -> list[list[str]]:
    """Cycles in the plan itself (a package that may import one that may import it back): the plan must be layers."""
    edges = [Import(src, dst, None, 0) for src, allowed in rules.items()
             for dst in (set(rules) - {src} if allowed is None else allowed)]
    return cycles(edges)


def cycles(edges: list[Import]) -> list[list[str]]:
    """One closed path (first node repeated at the end) through each strongly connected group of modules."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.src, set()).add(e.dst)
    found, seen = [], set()
    for start in sorted(graph):
        if start in seen:
            continue
        path = _path_back(graph, start)
        if path:
            seen.update(path)
            found.append(path)
    return found


def _path_back(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The shortest path start -> ... -> start (breadth first), or None."""
    frontier, parent = [start], {start: None}
    while frontier:
        nxt = []
        for node in frontier:
            for dst in sorted(graph.get(node, ())):
                if dst == start:
                    path = [node]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, start]
                if dst not in parent:
                    parent[dst] = node
                    nxt.append(dst)
        frontier = nxt
    return None


# ---------------------------------------------------------------------------------------------- tests


def test_every_import_follows_the_house_plan():
    bad = violations(import_graph(), plan())
    assert not bad, "imports against the packages' plan (their __init__ docstrings):\n" + "\n".join(bad)


def test_the_plan_is_layers():
    rules = plan()
    unknown = {p: sorted(allowed - set(rules)) for p, allowed in rules.items() if allowed and allowed - set(rules)}
    assert not unknown, f"May import lines naming no package: {unknown}"
    assert rules["base"] == set(), "base is the leaf: it imports nothing of the package"
    # cli may import every package, so it is left out: the rest must form layers (no package reachable from itself)
    assert plan_cycles({p: a for p, a in rules.items() if a is not None}) == []


def test_every_module_is_in_a_package():
    flat = [m for m in modules() if m != ROOT and "." not in m and not (PACKAGE / m / "__init__.py").is_file()]
    assert not flat, f"modules outside any package (the tree is packages by concept): {flat}"


def test_the_checker_sees_what_it_should(tmp_path):
    # An engine module importing trace's private helper lazily inside a function (upward and private), maths
    # importing precision (beside it, not named in its plan), a job package importing another job package, a
    # package importing the root (always allowed), and a two-module cycle inside one package: each must be reported,
    # with relative imports resolved from inside a subpackage.
    rules = {"base": set(), "precision": {"base"}, "maths": {"base"}, "engines": {"base", "precision"},
             "trace": {"base", "engines"}, "training": {"base", "engines"}, "cli": None}
    edges = imports_of("engines.vllm", _write(tmp_path, "def f():\n    from ..trace.job import _x\n"),
                       {"trace.job"})
    assert edges == [Import("engines.vllm", "trace.job", "_x", 2)]
    edges += [Import("training.experiments", "trace.job", "run_trace", 1)]
    edges += [Import("maths.metrics", "precision.scoring", "score", 1), Import("maths.loss", "maths.tasks", None, 1),
              Import("maths.tasks", "maths.loss", "clip_range", 1), Import("training.trainer", "", "SCHEMA", 1),
              Import("engines.local", "precision.recipes", "Recipe", 1), Import("cli.main", "trace.job", "run", 1)]
    assert violations(edges, rules) == [
        "cycle maths.loss -> maths.tasks -> maths.loss: maths.loss -> maths.tasks (module)",
        "cycle maths.loss -> maths.tasks -> maths.loss: maths.tasks -> maths.loss (clip_range)",
        "engines may not import trace: engines.vllm -> trace.job (_x)",
        "maths may not import precision: maths.metrics -> precision.scoring (score)",
        "private name: engines.vllm -> trace.job (_x)",
        "training may not import trace: training.experiments -> trace.job (run_trace)",
    ]
    aliased = imports_of("trace.job", _write(tmp_path, "from ..precision import recipes\nrecipes._final_norm(m)\n"),
                         {"precision.recipes"})
    assert Import("trace.job", "precision.recipes", "_final_norm", 2) in aliased
    # a plan in which two packages may import each other is not layers
    assert plan_cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b", "a"]]


def test_the_plan_reads_the_init_docstrings(tmp_path):
    init = tmp_path / "__init__.py"
    init.write_text('"""What it holds.\n\nMay import: base, precision.\n"""\n')
    assert may_import(init) == {"base", "precision"}
    init.write_text('"""Leaf.\n\nMay import: nothing (the package root only).\n"""\n')
    assert may_import(init) == set()
    init.write_text('"""Top.\n\nMay import: every package.\n"""\n')
    assert may_import(init) is None


def _write(tmp_path: Path, text: str) -> Path:
    # imports_of only needs a path whose name is not __init__.py; the module name is given separately.
    path = tmp_path / "m.py"
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------------------- sizes and names

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
MAX_POSITIONAL = 6
"""a module holds one idea, a function one step, a call names what it passes beyond a few arguments."""

MAX_DRIVER_LINES = 45
DRIVERS = {("training/trainer.py", "train"), ("diagnose/job.py", "run_diagnose"), ("diagnose/postmortem.py",
           "run_rollouts"), ("trace/job.py", "run_trace"), ("trace/growth.py", "run_growth"),
           ("training/experiments.py", "run_experiment"), ("engines/compare.py", "run_compare")}
"""each job's driver: it reads top to bottom over named phase functions, so it stays short (DESIGN.md section 3)."""

SIZE_DEBT: dict[str, int] = {}
"""modules allowed over MAX_MODULE_LINES until they are split, each with a ceiling (none now)."""
LONG_FUNCTIONS_OK = {("maths/metrics.py", "mismatch_stats"): "one dict literal that lists every diagnose figure in "
                                                              "the order docs/metrics.md defines them"}
POSITIONAL_OK = {("trace/text.py", "table.add_row"): "a rich table row: one positional cell per column",
                 ("integrations/trl_async/forward.py", "ChunkedLogProbFunction.apply"):
                     "TRL's autograd Function: torch's Function.apply takes positional arguments only"}
SAME_NAME_OK = {
    "KNOB_FIELDS": "each command config's own map of its fields onto loss.KNOBS (the same role for each config)",
    "FLAG": "each config reader's own command-line flag (the same role in each reader)",
}


def _sources() -> dict[str, ast.Module]:
    return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def size_findings(trees: dict[str, ast.Module], lines: dict[str, int]) -> list[str]:
    found = []
    for mod, n in lines.items():
        if n > SIZE_DEBT.get(mod, MAX_MODULE_LINES):
            found.append(f"{mod}: {n} lines (limit {SIZE_DEBT.get(mod, MAX_MODULE_LINES)})")
    for mod, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES and (mod, node.name) not in LONG_FUNCTIONS_OK:
                    found.append(f"{mod}: function {node.name} has {n} lines (limit {MAX_FUNCTION_LINES})")
                elif (mod, node.name) in DRIVERS and n > MAX_DRIVER_LINES:
                    found.append(f"{mod}: the driver {node.name} has {n} lines (limit {MAX_DRIVER_LINES})")
            elif isinstance(node, ast.Call):
                positional = [a for a in node.args if not isinstance(a, ast.Starred)]
                if len(positional) > MAX_POSITIONAL and (mod, ast.unparse(node.func)) not in POSITIONAL_OK:
                    found.append(f"{mod}:{node.lineno}: {ast.unparse(node.func)}(...) with {len(positional)} "
                                 f"positional arguments (limit {MAX_POSITIONAL}: name them)")
    return found


def public_names(trees: dict[str, ast.Module]) -> dict[str, list[str]]:
    """Public top-level names (functions, classes, constants) -> the modules that define them."""
    names: dict[str, list[str]] = {}
    for mod, tree in trees.items():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined = [node.name]
            elif isinstance(node, ast.Assign):
                defined = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                defined = [node.target.id]
            else:
                defined = []
            for name in defined:
                if not name.startswith("_"):
                    names.setdefault(name, []).append(mod)
    return names


def test_modules_functions_and_calls_stay_small():
    trees = _sources()
    missing = {d for d in DRIVERS if d[0] not in trees}
    assert not missing, f"drivers named in DRIVERS whose module is gone: {missing}"
    lines = {mod: len((PACKAGE / mod).read_text().splitlines()) for mod in trees}
    found = size_findings(trees, lines)
    assert not found, "\n".join(found)


def test_one_public_name_means_one_thing():
    twice = {n: mods for n, mods in public_names(_sources()).items() if len(mods) > 1 and n not in SAME_NAME_OK}
    assert not twice, f"public names defined in several modules (rename, or allow in SAME_NAME_OK with why): {twice}"


def test_the_size_checks_see_what_they_should():
    tree = ast.parse("def f():\n" + "    x = 1\n" * 70 + "g(1, 2, 3, 4, 5, 6, 7)\nh(*a, 1, k=2)\nFIGURES = 1\n")
    found = size_findings({"m.py": tree}, {"m.py": 501, "training/trainer.py": 1})
    assert found == ["m.py: 501 lines (limit 500)", "m.py: function f has 71 lines (limit 60)",
                     "m.py:72: g(...) with 7 positional arguments (limit 6: name them)"], found
    driver = ast.parse("def train():\n" + "    x = 1\n" * 45)  # 46 lines: long for a driver, fine for a function
    assert size_findings({"training/trainer.py": driver}, {}) == [
        "training/trainer.py: the driver train has 46 lines (limit 45)"]
    other = ast.parse("FIGURES = 2\n")
    assert public_names({"a.py": tree, "b.py": other})["FIGURES"] == ["a.py", "b.py"]
