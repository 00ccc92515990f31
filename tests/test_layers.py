"""The house plan, enforced: every import between phantomclip modules goes down the layers, none forms a cycle,
and none reaches for another module's private name.

Layers, bottom to top (docs: /work/shared/DESIGN.md section 3):
  leaf      numerics, recipes, models, prompts, metrics, loss, tasks, runs, errors, interventions, frameworks, knobs,
            files, console, devices
  core      scoring, engine, engines (engines/__init__, engines/vllm), producer, decode, depth, train_config, routing,
            diagnose_config
  jobs      diagnose, trainer, trace, experiments, growth, compare (the `phantomclip engines` command)
  surfaces  report, integrations, cli, diagnose_text, answer, job_text, config_flags, routing_text
The package root (phantomclip/__init__.py: version constants) is below them all: anyone may import it, it imports
nothing of the package.

Within a layer: leaf, core and surface modules may import each other as long as no cycle forms (the engine needs
scoring's log-softmax, the producer the engine's Rollout, cli dispatches to report and integrations). Jobs are
independent drivers: a job never imports another job, except experiments -> trainer (an experiment is a matrix
of training runs) and postmortem -> diagnose (a post-mortem is a diagnose per recorded step). Helpers two jobs need
belong in the layer below them.

Imports are read with `ast`, at module level and inside functions alike (the package imports lazily a lot), so
the check is about the code's dependencies, not about what happens to run first.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import phantomclip

PACKAGE = Path(phantomclip.__file__).parent
ROOT = ""
"""module name of phantomclip/__init__.py (displayed as 'phantomclip')."""

LAYERS: dict[str, tuple[str, ...]] = {
    "leaf": ("numerics", "recipes", "models", "prompts", "metrics", "loss", "tasks", "runs", "errors", "interventions",
             "frameworks", "knobs", "files", "owned", "locks", "console", "devices", "fp8", "fp8_vllm", "run_checks",
             "setups"),
    "core": ("scoring", "engine", "engines", "producer", "decode", "depth", "train_config", "routing", "routing_train",
             "routing_depth", "diagnose_config", "diagnose_fp8", "diagnose_records", "rollouts", "rollout_readers",
             "rollout_batches", "recorded"),
    "jobs": ("diagnose", "trainer", "trace", "experiments", "compare", "growth", "postmortem"),
    "surfaces": ("report", "integrations", "cli", "diagnose_text", "answer", "answer_changes", "exposure",
                 "verdict_text", "job_text", "config_flags", "config_sources", "fp8_text", "routing_text",
                 "postmortem_text"),
}
RANK = {"root": -1, **{layer: i for i, layer in enumerate(LAYERS)}}
SIDEWAYS_OK = {"leaf", "core", "surfaces"}
"""layers whose modules may import each other (acyclically); jobs may not."""
JOB_TO_JOB_OK = {("experiments", "trainer"), ("postmortem", "diagnose")}


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


def layer_of(module: str) -> str:
    """The layer of a module: its own entry, else its package's (engines.vllm -> engines -> core)."""
    if module == ROOT:
        return "root"
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        for layer, members in LAYERS.items():
            if ".".join(parts[:n]) in members:
                return layer
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_layers.py")


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


def violations(edges: list[Import]) -> list[str]:
    """'kind: src -> dst (names)' for every import against the plan, one line per module pair and kind."""
    bad: dict[tuple[str, str, str], set[str]] = {}

    def flag(kind: str, e: Import, name: str | None = None) -> None:
        bad.setdefault((kind, e.src, e.dst), set()).add(name or e.name or "module")

    for e in edges:
        src, dst = layer_of(e.src), layer_of(e.dst)
        if RANK[dst] > RANK[src]:
            flag("upward import", e)
        elif src == dst and src not in SIDEWAYS_OK and (e.src, e.dst) not in JOB_TO_JOB_OK:
            flag("job imports a job", e)
        if e.name and is_private(e.name):
            flag("private name", e)
    for cycle in cycles(edges):
        for a, b in zip(cycle, cycle[1:]):
            for e in edges:
                if (e.src, e.dst) == (a, b):
                    flag("cycle " + " -> ".join(map(show, cycle)), e)
    return [f"{kind}: {show(s)} -> {show(d)} ({', '.join(sorted(names))})"
            for (kind, s, d), names in sorted(bad.items())]


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
    bad = violations(import_graph())
    assert not bad, "imports against the layers (tests/test_layers.py docstring):\n" + "\n".join(bad)


def test_every_module_is_in_a_layer():
    for m in modules():
        layer_of(m)  # raises naming the module


def test_the_checker_sees_what_it_should(tmp_path):
    # A core module importing a job's private helper lazily inside a function, a leaf importing a core module, a job
    # importing a job, and a two-module cycle: each must be reported, with relative imports resolved from inside a
    # subpackage.
    edges = imports_of("engines.vllm", _write(tmp_path, "def f():\n    from ..trace import _x\n"), {"trace"})
    assert edges == [Import("engines.vllm", "trace", "_x", 2)]
    edges += [Import("compare", "trace", "run_trace", 1)]
    edges += [Import("metrics", "scoring", "score", 1), Import("loss", "tasks", None, 1),
              Import("tasks", "loss", "clip_range", 1), Import("trainer", "", "SCHEMA_VERSION", 1)]
    assert violations(edges) == [
        "cycle loss -> tasks -> loss: loss -> tasks (module)",
        "cycle loss -> tasks -> loss: tasks -> loss (clip_range)",
        "job imports a job: compare -> trace (run_trace)",
        "private name: engines.vllm -> trace (_x)",
        "upward import: engines.vllm -> trace (_x)",
        "upward import: metrics -> scoring (score)",
    ]
    aliased = imports_of("trace", _write(tmp_path, "from . import recipes\nrecipes._final_norm(m)\n"), {"recipes"})
    assert Import("trace", "recipes", "_final_norm", 2) in aliased


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

SIZE_DEBT: dict[str, int] = {}
"""modules allowed over MAX_MODULE_LINES until they are split, each with a ceiling (none now)."""
LONG_FUNCTIONS_OK = {("metrics.py", "mismatch_stats"): "one dict literal that lists every diagnose figure in the "
                                                        "order docs/metrics.md defines them"}
POSITIONAL_OK = {("job_text.py", "table.add_row"): "a rich table row: one positional cell per column",
                 ("integrations/trl_async_forward.py", "ChunkedLogProbFunction.apply"):
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
    lines = {mod: len((PACKAGE / mod).read_text().splitlines()) for mod in trees}
    found = size_findings(trees, lines)
    assert not found, "\n".join(found)


def test_one_public_name_means_one_thing():
    twice = {n: mods for n, mods in public_names(_sources()).items() if len(mods) > 1 and n not in SAME_NAME_OK}
    assert not twice, f"public names defined in several modules (rename, or allow in SAME_NAME_OK with why): {twice}"


def test_the_size_checks_see_what_they_should():
    tree = ast.parse("def f():\n" + "    x = 1\n" * 70 + "g(1, 2, 3, 4, 5, 6, 7)\nh(*a, 1, k=2)\nFIGURES = 1\n")
    found = size_findings({"m.py": tree}, {"m.py": 501, "trainer.py": 1})
    assert found == ["m.py: 501 lines (limit 500)", "m.py: function f has 71 lines (limit 60)",
                     "m.py:72: g(...) with 7 positional arguments (limit 6: name them)"], found
    other = ast.parse("FIGURES = 2\n")
    assert public_names({"a.py": tree, "b.py": other})["FIGURES"] == ["a.py", "b.py"]
