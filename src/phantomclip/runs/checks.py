"""The one check of a run's files before anything uses them: resume, an experiment's rerun, the report and
`trace --run` all read a run through these functions, so a damaged file is one line naming it and what is wrong,
never a KeyError, TypeError, IndexError or a hang deep inside the job that trusted it.

What a run file must hold (what the trainer writes, runs.RunDir and trainer.CHECKPOINT_KEYS):
- metrics.jsonl: rows of steps 1, 2, ... (runs.check_steps says the order), each holding the figures every reader
  uses (METRIC_KEYS), every value a number, a bool or null (NaN written strictly).
- checkpoint.pt: a step >= 0; fp32 master weights (tensors; the optimizer's copy every other one is cast from); the
  weight versions the next `staleness` batches sample with (step - staleness .. step - 1, none below 0), each a
  mapping of the master's tensors with their shapes, in fp32.
- snapshots/step-N.safetensors (`trace --run`): every tensor of the model (a tied weight stored once), each of the
  model's shape, in fp32.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..base.errors import PhantomclipError
from ..base.files import printable

METRIC_KEYS = ("step", "completion/length_mean", "reward/mean", "time/step_s", "clip/rate", "clip/phantom_rate",
               "mismatch/tokens", "mismatch/beta_abs_mean")
"""figures every metrics row holds: what summarize_run, run_phantom_summary and the report read from each row by key
(a null value, a figure a step could not measure, is allowed; a missing key is damage)."""


class RunFileError(PhantomclipError):
    """A run file that is not what the trainer writes: the file, the line or key, what to do."""


def _number(value) -> bool:
    return value is None or isinstance(value, (bool, int, float))


def check_metrics_rows(path: Path, rows: list[dict]) -> list[dict]:
    """`rows` (read from `path` by runs.read_jsonl) if each holds METRIC_KEYS and only numbers, bools and nulls;
    RunFileError naming the line and key otherwise. Returns `rows`. About 0.1 s for 10,000 rows of 47 keys."""
    required = METRIC_KEYS
    for line, row in enumerate(rows, 1):
        missing = [k for k in required if k not in row]
        if missing:
            raise RunFileError(f"{printable(str(path))}, line {line}: no \"{missing[0]}\""
                               f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}: the row was cut or "
                               "edited; restore the file, or remove the run's rows from this line to recompute them")
        step = row["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise RunFileError(f"{printable(str(path))}, line {line}: step {repr(step)[:20]} is not a whole number "
                               ">= 1: the file was edited; restore it")
        for key, value in row.items():
            if not _number(value):
                raise RunFileError(f"{printable(str(path))}, line {line}: {key} is {str(value)[:30]!r}, not a number "
                                   "(the file was edited); restore it, or remove the run's rows from this line")
    return rows


def check_run_ids(path: Path, rows: list[dict], run_id: int) -> None:
    """Every row of a run file that carries a run id (runs.RUN_ID) carries this run's: a row with another was
    copied from another run (another intervention, seed or model: same steps, other numbers), and continuing from
    it, or summarising it, would file that run's history under this one. RunFileError naming the line otherwise.
    Rows without an id (written before rows carried one) are not judged."""
    for line, row in enumerate(rows, 1):
        found = row.get("run/id", run_id)
        if found != run_id:
            raise RunFileError(f"{printable(str(path))}, line {line}: a row of another run (run/id {str(found)[:20]}; "
                               f"this run's config.json makes {run_id}): the file was copied from another run; "
                               "restore this run's, or start a new --out")


def _tensors(x) -> bool:
    return isinstance(x, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in x.items())


def check_checkpoint(path: Path, ckpt: dict, staleness: int) -> None:
    """A checkpoint's contents as the trainer writes them (module docstring); RunFileError naming what is wrong
    otherwise. Its step, keys and configuration are runs.RunDir.load_checkpoint's and check_checkpoint_config's."""
    where = printable(str(path))
    fix = "remove it to restart the run from step 0 (its rows are recomputed), or restore it"
    master = ckpt.get("master")
    if not _tensors(master):
        raise RunFileError(f"{where}: master is not a mapping of weight tensors: {fix}")
    not_fp32 = next((k for k, v in master.items() if v.dtype != torch.float32), None)
    if not_fp32 is not None:
        raise RunFileError(f"{where}: master weight {not_fp32} is {master[not_fp32].dtype}, not the fp32 master "
                           f"weights the trainer keeps: {fix}")
    snapshots, step = ckpt.get("snapshots"), ckpt["step"]
    if not isinstance(snapshots, dict):
        raise RunFileError(f"{where}: snapshots is a {type(snapshots).__name__}, not the mapping of weight versions "
                           f"the trainer writes: {fix}")
    expected = set(range(max(0, step - staleness), step))
    if set(snapshots) != expected:
        shown = sorted(snapshots, key=str)[:6]
        raise RunFileError(f"{where}: holds weight versions {shown}, where step {step} at staleness {staleness} needs "
                           f"{sorted(expected)}: {fix}")
    shapes = {k: v.shape for k, v in master.items()}
    for version, weights in snapshots.items():
        if not _tensors(weights) or {k: v.shape for k, v in weights.items()} != shapes or any(
                v.dtype != torch.float32 for v in weights.values()):
            raise RunFileError(f"{where}: weight version {version} is not the master's fp32 tensors: {fix}")


def check_snapshot(path: Path, weights: dict[str, torch.Tensor], model: torch.nn.Module, model_name: str) -> None:
    """A weights snapshot (`trace --run`) holds every tensor of `model` (a tied weight once), each of its shape, in
    fp32, and nothing else; RunFileError naming the first difference otherwise."""
    own = model.state_dict()
    where = printable(str(path))
    foreign = [k for k, v in weights.items() if k not in own or own[k].shape != v.shape]
    if foreign:
        raise RunFileError(f"{where} holds weights of another model than {model_name} ({foreign[0]}): analyse a run "
                           "with the model it was trained with")
    stored = {own[k].data_ptr() for k in weights}
    missing = [k for k, v in own.items() if k not in weights and v.data_ptr() not in stored]  # tied: stored once
    if missing:
        raise RunFileError(f"{where} holds {len(weights)} of the model's {len(weights) + len(missing)} tensors (no "
                           f"{missing[0]}): the file was cut or edited; restore it or remove it")
    wrong = next((k for k, v in weights.items() if v.dtype != torch.float32), None)
    if wrong is not None:
        raise RunFileError(f"{where}: {wrong} is {weights[wrong].dtype}, not the fp32 weights train writes: restore "
                           "the snapshot or remove it")
