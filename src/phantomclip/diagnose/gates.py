"""diagnose's CI gate: `--fail-if 'KEY OP NUMBER'` read, its keys checked against what the result holds before any
work, and each gate judged on the result (a dotted path into the JSON; recipes' figures without the `recipes.`
prefix). docs/metrics.md, section "The CI gate", documents the keys.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass

from ..base.errors import PhantomclipError, ascii_digits
from ..maths.frameworks import OPS

EXIT_GATE = 1
"""`diagnose --fail-if`: a gate failed (the run itself succeeded)."""

class GateError(PhantomclipError):
    """A --fail-if expression that cannot be read, or that names no figure of the summary."""


@dataclass(frozen=True)
class Gate:
    """A bad condition: the gate fails when `summary[key] op bound` is true."""

    key: str
    op: str
    bound: float

    def __str__(self) -> str:
        return f"{self.key}{self.op}{self.bound:g}"


_GATE = re.compile(r"\s*([^<>=!\s]+)\s*(>=|<=|>|<)\s*([^<>=!\s]+)\s*")
_GATE_FORM = "expected KEY OP NUMBER with OP one of > >= < <=, e.g. 'fp32.outside_trust_region>0.01'"


def parse_gate(expr: str) -> Gate:
    """'fp32.outside_trust_region>0.01' -> Gate("fp32.outside_trust_region", ">", 0.01). KEY is a dotted path into
    the summary (no spaces, no empty part), NUMBER a finite float; spaces around OP are allowed."""
    m = _GATE.fullmatch(expr)
    if m is None:
        raise GateError(f"--fail-if {expr!r}: {_GATE_FORM}")
    key, op, number = m.groups()
    if any(part == "" for part in key.split(".")):
        raise GateError(f"--fail-if {expr!r}: the key {key!r} has an empty part between dots")
    try:
        bound = float(number)
    except ValueError:
        raise GateError(f"--fail-if {expr!r}: the bound {number!r} is not a number") from None
    if not math.isfinite(bound):
        raise GateError(f"--fail-if {expr!r}: the bound must be a finite number, got {number!r}")
    return Gate(key=key, op=op, bound=bound)


DIAGNOSE_KEYS: dict[str, str | None] = {
    "schema": None, "config": None, "versions": None, "cpu": None, "device": None, "model": None, "engine": None,
    "trust_region": None, "shadow": None, "recipes": None, "knobs": None, "drift": "drift", "fp8": "engine_quant",
    "routing": "routing", "recorded_trainer": "rollouts", "tokens": None, "answer": None, "verdict": None}
"""the top-level keys of diagnose's result (diagnose.result_dict, answer/decide.py's `answer`, diagnose.text's
`verdict`; docs/metrics.md, 'The CI gate', lists them) -> the DiagnoseConfig field without which the key is absent
(None: always there): `drift` with --drift, `fp8` with --engine-quant, `routing` on a mixture-of-experts model unless
--no-routing, `recorded_trainer` with --rollouts whose records carry the trainer's own log-probs. The one table
--fail-if's roots are checked against before any work."""
KEY_NEEDS = {"drift": "--drift K", "engine_quant": "--engine-quant", "routing": "a mixture-of-experts model (and no "
             "--no-routing)", "rollouts": "--rollouts whose records carry the trainer's own log-probs (slime's "
             "--save-debug-train-data)"}


def check_gate_roots(gates: list[Gate], cfg) -> None:
    """Refuse, before any work, a gate whose key cannot start a path in the result: neither one of DIAGNOSE_KEYS nor
    one of the run's --trainer recipes (`cfg.trainer`; a misspelt recipe would be found only after the whole run),
    or a key the run's settings leave out of the result (fp8.* without --engine-quant), or routing figures an engine
    other than the local one cannot give."""
    for g in gates:
        root = g.key.split(".")[0]
        if root == "routing" and cfg.engine != "local":
            from ..routing.routes import no_engine_routes

            raise GateError(no_engine_routes(cfg.engine, f"--fail-if {g.key}"))
        if root not in DIAGNOSE_KEYS and root not in cfg.trainer:
            raise GateError(f"--fail-if {g.key}: no figure starts with {root!r}; a key starts with a recipe of "
                            f"--trainer ({', '.join(cfg.trainer)}) or one of {', '.join(DIAGNOSE_KEYS)}")
        needs = DIAGNOSE_KEYS.get(root)
        if root not in cfg.trainer and needs is not None and not getattr(cfg, needs):
            raise GateError(f"--fail-if {g.key}: the result has {root!r} only with {KEY_NEEDS[needs]}; add it, or "
                            "drop this gate")


_MISSING = object()


def _walk(summary: dict, key: str):
    """The node at dotted path `key` in `summary`, or _MISSING."""
    parts = key.split(".")
    node, i = summary, 0
    while i < len(parts):
        for j in range(len(parts), i, -1):
            part = ".".join(parts[i:j])
            if isinstance(node, dict) and part in node:
                node, i = node[part], j
                break
            if isinstance(node, list) and ascii_digits(part) and int(part) < len(node):
                node, i = node[int(part)], j
                break
        else:
            return _MISSING
    return node


def lookup(summary: dict, key: str, under: tuple[str, ...] = ()) -> float:
    """The number at dotted path `key` in a nested dict (a list is indexed by a whole-number part). A dict key that
    itself holds dots ("eps=0.2") is matched whole, longest first. JSON null reads as NaN. A path absent from the
    top level is tried under each group of `under` in turn (diagnose passes ("recipes",), so that
    'fp32.outside_trust_region' reads recipes.fp32.outside_trust_region); the path as given wins.

    GateError, naming the key and listing the top-level keys (and those of `under`'s groups), when the path is
    absent or does not end on a number."""
    for prefix in ("", *under):
        node = _walk(summary, f"{prefix}.{key}" if prefix else key)
        if node is not _MISSING:
            break
    else:
        groups = "".join(f"; under {g}: {', '.join(map(str, summary[g])) or '(none)'}"
                         for g in under if isinstance(summary.get(g), dict))
        raise GateError(f"--fail-if: no figure {key!r} in the summary; its top-level keys: "
                        f"{', '.join(map(str, summary)) or '(none)'}{groups}")
    if node is None:
        return float("nan")
    if isinstance(node, (int, float)):
        return float(node)
    kind = "a group" if isinstance(node, (dict, list)) else f"a {type(node).__name__}"
    raise GateError(f"--fail-if: {key!r} is {kind}, not a number; name a figure inside it")


def failed_gates(summary: dict, gates: list[Gate], under: tuple[str, ...] = ()) -> list[str]:
    """One line per gate whose bad condition holds: "key = value, bound: op bound" (keys read by `lookup`, with
    `under`). A NaN figure (nothing measured) satisfies no comparison and so fails no gate; gate on a count (e.g.
    'fp32.tokens<1') to require data. ±inf compares as a number: 'x>0.1' fails on +inf."""
    lines = []
    for g in gates:
        value = lookup(summary, g.key, under)
        if OPS[g.op](value, g.bound):
            lines.append(f"{g.key} = {value:g}, bound: {g.op} {g.bound:g}")
    return lines


GATE_UNDER = ("recipes",)
"""where a --fail-if key absent from the result's top level is looked up next: 'fp32.x' reads recipes.fp32.x."""
DRIFT_GATE = "drift.max_abs>0"
"""the gate --drift adds: any movement of a log-prob with unchanged weights is an engine defect. It goes through
--fail-if's machinery (exit 1, one line naming key, value and bound) rather than a separate exit path, so a user
who must tolerate some drift (a GPU engine without batch-invariant kernels) replaces it with a --fail-if of their
own on any drift.* key."""


def check_gates(gates: list[Gate], result: dict) -> int:
    """Evaluate the --fail-if gates on the finished result: one stderr line per failed gate and exit 1, else 0.
    A key the result lacks is a GateError (exit 2); a gate on a NaN figure cannot fail, so it is named in a
    warning line."""
    if not gates:
        return 0
    failed = failed_gates(result, gates, GATE_UNDER)
    for g in gates:
        if math.isnan(lookup(result, g.key, GATE_UNDER)):
            print(f"phantomclip diagnose: warning: --fail-if {g}: the figure is NaN (nothing measured), so this gate "
                  "cannot fail", file=sys.stderr)
    for line in failed:
        print(f"phantomclip diagnose: gate failed: {line}", file=sys.stderr)
    if not failed:
        unjudged = sum(math.isnan(lookup(result, g.key, GATE_UNDER)) for g in gates)
        note = f" ({unjudged} on a NaN figure, which no gate can fail)" if unjudged else ""
        print(f"phantomclip diagnose: all {len(gates)} --fail-if gates hold{note}", file=sys.stderr)
    return EXIT_GATE if failed else 0
