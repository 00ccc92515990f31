"""Reading a run directory's files back: its JSONL rows (a torn last line skipped with a warning, damage anywhere
else one line naming file and line), its JSON objects and config.json, the run id, and how two configs differ;
the steps and checkpoint checked against them before a resume. What a run writes, and how it resumes, is
runs/rundir.py's.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from .. import SCHEMA_VERSION
from ..base.errors import PhantomclipError, PhantomclipWarning
from ..base.files import (
    JSON_ERRORS,
    InputError,
    json_reason,
    json_safe,
    printable,
    read_input,
)
from ..base.owned import (
    read_owned,
)

CHECKPOINT_CONFIG = "config"
"""the checkpoint's copy of its run's configuration (inputs' content hashes included)."""


class RunError(PhantomclipError):
    """A run directory that cannot be created or resumed as asked."""


def read_jsonl(path: Path, root: Path | None = None) -> list[dict]:
    """Every JSON object line of `path` (`root`: the run directory it lies in, reached without following a link,
    owned.read_owned). A torn last line (a writer killed mid-line) is skipped with a warning; a bad line anywhere
    else is damage and raises RunError naming the file and line (nothing after it is dropped)."""
    if not os.path.lexists(path):
        return []
    try:
        lines = (read_input(path) if root is None else read_owned(root, path)).splitlines()
    except InputError as e:
        raise RunError(str(e)) from None
    while lines and not lines[-1].strip():
        lines.pop()
    rows = []
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):  # only a line cut short is what a killed writer leaves
                warnings.warn(f"{path}: the last line ({i}) is incomplete, as a killed run leaves it: skipped",
                              PhantomclipWarning, stacklevel=2)
                break
            row = None
        except RecursionError:
            raise RunError(f"{path}: a line is nested too deep to read (line {i}): repair or remove that line; "
                           "nothing was read past it") from None
        except ValueError as e:  # not the decoder's: int()'s digit limit
            raise RunError(f"{path}: a line is not valid JSON (line {i} {json_reason(e)}): repair or remove that "
                           "line; nothing was read past it") from None
        step = row.get("step", 0) if isinstance(row, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise RunError(f"{path}, line {i}: not a JSON object with a whole-number step (the file was edited or "
                           "damaged): repair or remove that line; nothing was read past it")
        rows.append(row)
    return rows


def nan_for_null(row: dict) -> dict:
    """A metrics row with null (how strict JSON writes NaN) read back as NaN, so arithmetic sees the same values the
    run computed; older files with bare NaN read the same."""
    return {k: float("nan") if v is None else v for k, v in row.items()}


def read_json_object(path: Path, what: str, root: Path | None = None) -> dict:
    """A JSON file that must hold an object (config.json, experiment.json): one line naming the file otherwise.
    `root`: the directory it lies in, reached without following a link (owned.read_owned)."""
    try:
        doc = json.loads(read_input(path) if root is None else read_owned(root, path))
    except InputError as e:
        raise RunError(f"{e}: the {what} cannot be read; restore it or start a new --out") from None
    except JSON_ERRORS as e:
        raise RunError(f"{printable(str(path))} is not readable JSON ({json_reason(e)}): the {what} is damaged; "
                       "restore it or start a new --out") from None
    if not isinstance(doc, dict):
        raise RunError(f"{path} holds a JSON {type(doc).__name__}, not an object: the {what} is damaged; restore it "
                       "or start a new --out")
    schema = doc.get("schema", SCHEMA_VERSION)
    if not isinstance(schema, int) or isinstance(schema, bool) or schema > SCHEMA_VERSION:
        raise RunError(f"{path} has schema {schema!r}, not one this phantomclip reads (<= {SCHEMA_VERSION}): "
                       "upgrade phantomclip")
    return doc


def is_run_config(doc: dict) -> bool:
    """Whether a config.json is a phantomclip run's: every run's records the phantomclip that made it
    (trainer.run_config's versions.phantomclip, there since the first run); a model's folder also has a config.json."""
    versions = doc.get("versions")
    return isinstance(versions, dict) and "phantomclip" in versions


def read_run_config(run: Path) -> dict:
    """RUN/config.json, read beneath RUN, checked to be a phantomclip run's; RunError, one line, otherwise (a model's
    folder given as a run: its config.json holds the model's architecture)."""
    saved = read_json_object(run / "config.json", "run's config", run)
    if not is_run_config(saved):
        raise RunError(f"{run} holds a config.json that is not a phantomclip run's (no versions.phantomclip: a model's "
                       "folder?): give a run directory, or another --out")
    return saved


def run_id(config: dict) -> int:
    """The id of the run whose config.json holds `config`: the first 52 bits of the SHA-256 of the configuration as
    config.json holds it (keys sorted), a whole number JSON and JavaScript read exactly (below 2^53). config.json is
    written once, so the id holds for the run's life; a row carrying another id was copied from another run."""
    import hashlib

    text = json.dumps(plain_config(config), sort_keys=True).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:7], "big") >> 4


def config_diff(old: dict, new: dict, ignore: tuple[str, ...] = ()) -> list[str]:
    """Keys whose values differ between two configs, as 'key: old -> new'."""
    keys = sorted((set(old) | set(new)) - set(ignore))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def check_steps(path: Path, rows: list[dict], done: int, every_step: bool) -> None:
    """A run file's rows up to the checkpoint's step `done` must be steps 1, 2, ... in order, one each (all `done` of
    them when `every_step`: metrics and samples; tokens.jsonl logs only the first steps), and every later row is past
    `done` (it is dropped and recomputed). RunError naming the file and line otherwise: a duplicated, missing or
    reordered row would turn into a hybrid or a gap for good."""
    expected = 1
    for line, row in enumerate(rows, 1):
        step = row["step"]
        if step == expected and step <= done:
            expected += 1
        elif step <= done or (every_step and expected <= done):
            want = f"step {expected}" if expected <= done else f"a step after {done} (the checkpoint's)"
            raise RunError(f"{path}, line {line}: step {step} where {want} belongs (a duplicated, missing or "
                           "reordered row): repair the file or start over with a new --out; nothing was rewritten")
    if every_step and expected <= done:
        raise RunError(f"{path}: steps {expected} to {done} are missing before the checkpoint at step {done}: restore "
                       "them or start over with a new --out; nothing was rewritten")


def check_checkpoint_config(path: Path, ckpt: dict, config: dict, ignore: tuple[str, ...] = ()) -> None:
    """Refuse a checkpoint written by another run (another model, seed, prompts file...: a checkpoint.pt replaced or
    linked to another run's), naming the keys that differ, before anything is rewritten: continuing from it would log
    rows that belong to neither run. A checkpoint written before checkpoints carried their configuration passes."""
    saved = ckpt.get(CHECKPOINT_CONFIG)
    if saved is None:
        return
    if not isinstance(saved, dict):
        raise RunError(f"{path} is not a checkpoint this tool wrote (its configuration is a {type(saved).__name__}): "
                       "restore this run's checkpoint, or remove it to restart the run from step 0")
    diff = config_diff(_flat(saved, ignore), _flat(plain_config(config), ignore))
    if diff:
        raise RunError(f"{path} was written by another run ({'; '.join(diff[:4])}{'; ...' if len(diff) > 4 else ''}): "
                       "restore this run's checkpoint, or remove it to restart the run from step 0; nothing was "
                       "rewritten")


def plain_config(config: dict) -> dict:
    """`config` as config.json holds it (lists, strings, numbers): what a weights-only torch.load reads back (a
    TorchVersion is not), and what compares equal after the round trip."""
    return json.loads(json.dumps(json_safe(config), default=str))


def _flat(config: dict, ignore: tuple[str, ...]) -> dict:
    """A config's values by dotted key, one level into nested mappings ('inputs.prompts', 'plan.engine_recipe'), less
    the keys a resume may change."""
    flat = {}
    for key, value in config.items():
        if key in ignore:
            continue
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat
