"""`diagnose --rollouts DIR` over records of several steps: a post-mortem of a run, step by step.

A run's β grows as it trains (trace --run shows why), so a pre-flight at step 0 understates what the run meets at
step 500. Given the rollouts a run recorded at several steps, each step's records are diagnosed (diagnose.run_diagnose,
unchanged) against that step's checkpoint (--checkpoints DIR; else the nearest earlier one, or --model), and one row
per step says how β, the share of tokens outside the trust region and, where the records carry advantages, the share
phantom-clipped at α = 0 grew. The result is the last step's whole diagnose result (the answer judges what the run
meets at its end) with the rows beside it (`postmortem`, docs/metrics.md).

Phases (`run_rollouts` reads top to bottom): `scan_steps` (one pass over the records) -> `checkpoint_for` each step ->
`diagnose_step` -> `step_row` -> the result.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ..base.files import printable
from ..rollouts.readers import read_rollouts
from ..rollouts.record import RecordError
from .config import DiagnoseConfig
from .job import run_diagnose
from .recorded import record_step

if TYPE_CHECKING:
    from rich.console import Console

CHECKPOINT_NAME = re.compile(r"(?:checkpoint|global_step|step|iter)[-_]?(\d+)")
"""a checkpoint directory's name and its step: checkpoint-N (TRL, HF Trainer), global_step_N (verl), step-N, step_N,
iter_N."""
ROW_KEYS = ("beta_mean", "beta_abs_mean", "beta_abs_p99", "outside_trust_region", "phantom_share_at_alpha0")
"""the user's recipe's figures each step's row keeps (docs/metrics.md)."""


def run_rollouts(cfg: DiagnoseConfig, console: Console | None = None) -> dict:
    """diagnose on recorded rollouts: one measurement for a file or a single step, a post-mortem (the last step's
    result with a row per step) for records of several steps."""
    if not cfg.rollouts or cfg.rollouts_step is not None:
        return run_diagnose(cfg, console)
    steps = scan_steps(cfg.rollouts)
    if len(steps) < 2:
        return run_diagnose(cfg, console)
    checkpoints = find_checkpoints(cfg.checkpoints) if cfg.checkpoints else {}
    plan = [(step, *checkpoint_for(step, checkpoints, cfg.model, cfg.checkpoints)) for step in steps]  # refusals first
    rows, result = [], {}
    for i, (step, model, lag) in enumerate(plan):
        if console is not None:
            console.print(f"post-mortem: step {step} ({i + 1} of {len(steps)})", markup=False)
        result = run_diagnose(dataclasses.replace(cfg, model=model, rollouts_step=step, checkpoint_lag=lag), console)
        rows.append(step_row(step, model, lag, result))
    result["postmortem"] = {"steps": rows, "checkpoints": cfg.checkpoints or None, "recipe": next(iter(cfg.trainer))}
    return result


def scan_steps(path: str) -> list[int]:
    """The steps the records hold (their step, or their weight version), sorted; refused when some record has
    neither beside records that have one (such a run cannot be split into steps)."""
    _, records = read_rollouts(path)
    steps, missing = set(), None
    for located in records:
        step = record_step(located.record)
        if step is None:
            missing = missing or located.where
        else:
            steps.add(step)
    if missing and steps:
        raise RecordError(f"{missing}: has neither step nor weight_version, beside records that have one: a "
                          "post-mortem needs every record's step")
    return sorted(steps)


def find_checkpoints(directory: str) -> dict[int, Path]:
    """{step: checkpoint directory} of the subdirectories of `directory` named as CHECKPOINT_NAME says."""
    root = Path(directory)
    if not root.is_dir():
        raise RecordError(f"--checkpoints {printable(directory)}: not a directory of checkpoints")
    found = {int(m.group(1)): p for p in root.iterdir() if p.is_dir() and (m := CHECKPOINT_NAME.fullmatch(p.name))}
    if not found:
        raise RecordError(f"--checkpoints {printable(directory)}: no subdirectory named checkpoint-N, global_step_N, "
                          "step-N or iter_N")
    return found


def checkpoint_for(step: int, checkpoints: dict[int, Path], model: str, where: str) -> tuple[str, int | None]:
    """(the model that measures `step`'s records, how many steps it lags them): the step's own checkpoint (lag 0),
    else the nearest earlier one; without --checkpoints, --model (lag unknown: None)."""
    if not checkpoints:
        return model, None
    earlier = [s for s in checkpoints if s <= step]
    if not earlier:
        raise RecordError(f"step {step}'s records have no checkpoint at or before step {step} in "
                          f"{printable(where)} (the earliest is step {min(checkpoints)})")
    best = max(earlier)
    return str(checkpoints[best]), step - best


def step_row(step: int, model: str, lag: int | None, result: dict) -> dict:
    """One step of the post-mortem: its checkpoint and lag, its tokens, the user's recipe's β figures and the kernel
    part (shadow against the engine)."""
    recipe = next(iter(result["recipes"]))
    figures = result["recipes"][recipe]
    return {"step": step, "checkpoint": model, "lag": lag, "sequences": result["engine"]["sequences"],
            "tokens": figures["tokens"], "recipe": recipe, **{k: figures.get(k) for k in ROW_KEYS},
            "beta_kernel_abs_mean": result["shadow"]["kernel"]["beta_abs_mean"]}
