"""What a verl run logged, read back: phantomclip's own figures logged from inside verl (`phantomclip/*`, docs/verl.md
"Figures") and verl's mismatch diagnostics (`rollout_corr/*`), step by step. The report draws them in "Your
framework" (report/framework_log.py) and `diagnose --from-verl-log` prints them (diagnose/verl_log.py); both read
them here, so neither imports the other.

verl 0.9.1 hands one dict of metrics per step to every tracker named in `trainer.logger` (verl/utils/tracking.py
`Tracking.log`, called from verl/trainer/ppo/ray_trainer.py `fit`). Two of them write text this module reads:
  file     `FileLogger.log` (verl/utils/tracking.py): one JSON object per step, `{"step": N, "data": {key: value}}`,
           written by orjson (NaN as null), to $VERL_FILE_LOGGER_PATH or <VERL_FILE_LOGGER_ROOT>/<project>/
           <experiment>.jsonl. Every line is verl's: a line that is not that object is an error.
  console  `LocalLogger.log` (verl/utils/logger/aggregate_logger.py `concat_dict_to_str`): one printed line per step,
           "step:N - key:value - key:value", numbers only, each as `pprint.pformat` writes it: its repr, which under
           numpy 2 is `np.float64(0.03)` for the np.mean verl's `reduce_metrics` returns. The trainer runs in a Ray
           actor, so the line usually comes prefixed ("(TaskRunner pid=N) ", coloured on a terminal), among Ray's,
           vLLM's and the progress bar's lines, which are skipped.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

from ..base.errors import PhantomclipError
from ..base.files import read_input


class FrameworkLogError(PhantomclipError):
    """A file given as a framework's log that is not one, or is damaged."""


VERL_LOG_KEEP = ("phantomclip/", "rollout_corr/")
"""the key prefixes read back from a verl log (docs/verl.md "Figures"; verl's rollout_corr/*); the rest is left out."""
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
"""a terminal colour code (Ray colours its "(TaskRunner pid=N)" prefix when its stdout is a terminal)."""
CONSOLE_LINE = re.compile(r"(?:^|\s)step:(\d+)((?: - \S+:.*)?)$")
"""verl's console line: "step:N", alone or followed by " - key:value" items to the end of the line, after whatever
prefix Ray or a shell gave it."""
CONSOLE_NUMBER = re.compile(r"^(?:np\.(?:float|int|uint)\d+\((.+)\)|(.+))$")
"""a value as pprint writes a number: a plain repr ('0.03', '3', 'nan', '-inf', 'True') or numpy 2's scalar repr
('np.float64(0.03)', 'np.int64(3)')."""


def looks_like_verl_log(path: Path) -> bool:
    """True when the first non-blank line of `path` is a JSON object with an integer "step" and a "data" object
    (verl's file log; the report asks this of every .jsonl it finds)."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    return _file_row(json.loads(line)) is not None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return False


def _file_row(row) -> tuple[int, dict] | None:
    """(step, data) of a file-log object, None for anything else."""
    if isinstance(row, dict) and isinstance(row.get("step"), int) and isinstance(row.get("data"), dict):
        return row["step"], row["data"]
    return None


def logged_number(value) -> float | None:
    """A figure of the file log as a float (null, as orjson writes NaN, is NaN); None for what is not a number (a bool,
    a list, a string)."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def console_number(text: str) -> float | None:
    """A value of the console line as a float ('np.float64(0.03)' -> 0.03, 'nan' -> NaN); None for a bool, which
    verl prints too (a bool is a number to `numbers.Number`) but is no figure."""
    m = CONSOLE_NUMBER.match(text.strip())
    inner = m and next(g for g in m.groups() if g is not None)
    if not inner or inner in ("True", "False"):
        return None
    try:
        return float(inner)
    except ValueError:
        return None


def _kept(pairs) -> dict[str, float]:
    """The VERL_LOG_KEEP figures of one step's (key, number or None) pairs."""
    return {k: v for k, v in pairs if k.startswith(VERL_LOG_KEEP) and v is not None}


def _file_steps(path: Path, lines: list[str]) -> list[dict]:
    steps = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = _file_row(json.loads(line))
        except json.JSONDecodeError as e:
            raise FrameworkLogError(f"{path}:{n}: not JSON ({e.msg}): the verl log was cut or edited; pass the file "
                                    "verl's file logger wrote") from None
        if row is None:
            raise FrameworkLogError(f"{path}:{n}: not a verl log line ({{\"step\": N, \"data\": {{...}}}}): pass the "
                                    "file verl's file logger wrote")
        figures = _kept((k, logged_number(v)) for k, v in row[1].items())
        if figures:
            steps.append({"step": row[0], "figures": figures})
    return steps


def _console_steps(lines: list[str]) -> tuple[int, list[dict]]:
    """(verl metric lines found, the steps among them with a kept figure)."""
    found, steps = 0, []
    for line in lines:
        m = CONSOLE_LINE.search(ANSI.sub("", line))
        if m is None:
            continue
        found += 1
        items = (item.rpartition(":") for item in m[2].split(" - ")[1:])
        figures = _kept((k, console_number(v)) for k, _, v in items)
        if figures:
            steps.append({"step": int(m[1]), "figures": figures})
    return found, steps


def read_verl_log(path: str | Path) -> dict:
    """{"_path", "format" ('file' or 'console'), "steps": [{"step": N, "figures": {key: value}}]}: the VERL_LOG_KEEP
    figures of every step that logged one, in the order logged (a step with none is left out; `steps` may be empty).
    A file log with a line that is not verl's object, or a file with no line of verl's metrics in either format, is a
    FrameworkLogError naming the file (and the line); an unreadable one an InputError."""
    path = Path(path)
    lines = read_input(path).splitlines()
    first = next((line for line in lines if line.strip()), "")
    try:
        is_file_log = _file_row(json.loads(first)) is not None
    except json.JSONDecodeError:
        is_file_log = False
    if is_file_log:
        return {"_path": str(path), "format": "file", "steps": _file_steps(path, lines)}
    found, steps = _console_steps(lines)
    if not found:
        raise FrameworkLogError(f"{path}: not a verl log: no line of verl's metrics (\"step:N - key:value - ...\" as "
                                "its console logger prints them, or {\"step\": N, \"data\": {...}} as its file logger "
                                "writes them); give the stdout of a verl run or its file log")
    return {"_path": str(path), "format": "console", "steps": steps}


def figure_series(log: dict) -> dict[str, list[tuple[int, float]]]:
    """Each kept figure -> its (step, value) pairs in the order logged; phantomclip's figures first, then verl's,
    each group by name."""
    keys = sorted({k for s in log["steps"] for k in s["figures"]}, key=lambda k: (not k.startswith("phantomclip/"), k))
    return {k: [(s["step"], s["figures"][k]) for s in log["steps"] if k in s["figures"]] for k in keys}


def finite_median(values: list[float]) -> float:
    """The median of the finite values (a NaN step logged no figure worth counting); NaN when there is none."""
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan
