"""`diagnose --rollouts DIR` over records of several steps: a post-mortem of a run, step by step.

A run's β grows as it trains, and a user needs to know whether their engine or the learning did it
(docs/rollouts.md, "Engine or learning"). Given the rollouts a run recorded at several steps, the post-mortem first
finds which weights sampled each step's records (which_weights: every candidate checkpoint scores a sample of each
step; the best match is named with its margin), then diagnoses each step's records (diagnose.run_diagnose, unchanged)
against the weights that sampled them, so each row is β alone. A step whose records no candidate sampled is measured
against its nearest earlier checkpoint and said to hold α too: it is left out of the status, never called the
engine's gap. One row per step says how β, the share outside the trust region and, where the records carry
advantages, the share phantom-clipped at α = 0 moved; the result is the last step's whole diagnose result with the
rows beside it (`postmortem`, docs/metrics.md), and the answer judges the whole run (answer.decide.run_status).

Phases (`run_rollouts` reads top to bottom): `scan_steps` (one pass over the records) -> `find_checkpoints` and
`expected_checkpoint` (refusals first) -> `which_weights.match_steps` -> `diagnose_step` for each -> the result.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..answer.decide import judged_status
from ..base.files import printable
from ..models.load import LoadedModel, load_model
from ..rollouts.readers import read_rollouts
from ..rollouts.record import RecordError, write_records
from .canary import canary_rows
from .config import DiagnoseConfig
from .job import run_diagnose
from .recorded import record_step
from .which_weights import Match, match_row, match_steps

if TYPE_CHECKING:
    from rich.console import Console

CHECKPOINT_NAME = re.compile(r"(?:checkpoint|global_step|step|iter)[-_]?(\d+)")
"""a checkpoint directory's name and its step: checkpoint-N (TRL, HF Trainer), global_step_N (verl), step-N, step_N,
iter_N."""
CHECKPOINT_LIKE = re.compile(r"(?:checkpoint|global_step|step|iter)[-_].*")
"""a name that starts as a checkpoint's does: one that is not CHECKPOINT_NAME (checkpoint--1, step-best) is refused,
not passed over, so a step the user meant is never silently missing."""
MAX_STEP_DIGITS = 12
"""a step number longer than this is refused (no run takes 10^12 optimizer steps; a 20-digit name is a typo)."""
ARCHITECTURE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")
"""config.json fields every checkpoint of one run shares."""
SPLIT_RECORDS = 4096
"""records `split_by_step` holds before writing them to their steps' files: at most about 30 MB of records of 64-token
completions (60-110 bytes a completion token: 60 where the ids are Python's shared small ints, as tiny-random:0's),
whatever the run's length; records arrive in step order in the files recorders write, so a flush writes one or two
steps' files."""
ROW_KEYS = ("beta_mean", "beta_abs_mean", "beta_abs_p99", "outside_trust_region", "phantom_share_at_alpha0")
"""the user's recipe's figures each step's row keeps (docs/metrics.md)."""


def run_rollouts(cfg: DiagnoseConfig, console: Console | None = None) -> dict:
    """diagnose on recorded rollouts: one measurement for a file of one step without --checkpoints; otherwise a
    post-mortem (the last step's result with a row per step, each step measured against the weights that sampled
    it)."""
    if not cfg.rollouts:
        return run_diagnose(cfg, console)
    steps = scan_steps(cfg.rollouts)
    if cfg.rollouts_step is not None:
        if cfg.rollouts_step not in steps:
            raise RecordError(f"--rollouts-step {cfg.rollouts_step}: {printable(cfg.rollouts)} holds no record of that "
                              f"step; its steps: {', '.join(map(str, steps[:20])) or 'none (no step recorded)'}")
        steps = [cfg.rollouts_step]
    if len(steps) < 2 and not cfg.checkpoints:
        return run_diagnose(cfg, console)
    checkpoints = find_checkpoints(cfg.checkpoints) if cfg.checkpoints else {}
    candidates = candidate_models(steps, checkpoints, cfg.model)
    expected = {s: expected_checkpoint(s, candidates) for s in steps}
    say = console.print if console is not None else (lambda *a, **k: None)
    say(f"post-mortem: which weights sampled each of {len(steps)} steps ({len(candidates)} candidates)", markup=False)
    matches = match_steps(cfg, steps, candidates, expected)
    probe = canary_rows(cfg, steps, candidates) or {}  # the fixed probe's reading at each sync, where recorded
    rows, last = {}, {}
    held = HeldModel()
    order = sorted(steps, key=lambda s: (str(matches[s].sampled_by), s))  # one load per checkpoint measured against
    with tempfile.TemporaryDirectory(prefix="phantomclip-steps-") as parts:
        files, tokens = split_by_step(cfg.rollouts, steps, Path(parts))  # the input read once, not once a step
        for i, step in enumerate(order):
            say(f"post-mortem: step {step} ({i + 1} of {len(steps)})", markup=False)
            started = time.perf_counter()
            result = diagnose_step(dataclasses.replace(cfg, rollouts_part=files[step]), step, matches[step],
                                   candidates, console, held)
            if i == 0 and len(order) > 1:
                say(estimate_line(step, time.perf_counter() - started, tokens[step],
                                  [tokens[s] for s in order[1:]]), markup=False)
            rows[step] = {**step_row(step, matches[step], candidates, result), "canary": probe.get(step)}
            last = result if step == steps[-1] else last
            del result  # the row is what the run keeps of a step: its per-token arrays go before the next step runs
    last["postmortem"] = {"steps": [rows[s] for s in steps], "checkpoints": cfg.checkpoints or None,
                          "recipe": next(iter(cfg.trainer))}
    return last


class HeldModel:
    """The one model the post-mortem holds: the steps measured against one checkpoint, run one after another, load
    it once."""

    def __init__(self):
        self.path, self.lm = None, None

    def get(self, path: str) -> LoadedModel:
        if path != self.path:
            self.lm = None  # the one before is let go first: one model in memory at a time
            self.lm, self.path = load_model(path, progress=lambda *a, **k: None), path
        return self.lm


def split_by_step(path: str, steps: list[int], directory: Path) -> tuple[dict[int, str], dict[int, int]]:
    """The run's records (not the canary's) of each step in a directory of their own under `directory` (rollout files
    with the input's header, read as one stream: readers.read_directory), in one read of the input (each record keeps
    the log-prob kind and sampling its own file gave it); and each step's completion tokens. At most SPLIT_RECORDS
    records are held at a time: the whole run's records would cost 60-110 bytes per completion token of the run, more
    than one step's diagnose in a run of many steps (bench/RESULTS.md section 13)."""
    header, records = read_rollouts(path)
    held: dict[int, list] = {s: [] for s in steps}
    files = {s: directory / f"step-{s}" for s in steps}
    tokens, parts = dict.fromkeys(steps, 0), dict.fromkeys(steps, 0)
    for d in files.values():
        d.mkdir()

    def write_held() -> None:
        for step, kept in held.items():
            if kept:  # parts numbered in the order read_directory reads them back (rollout_files)
                write_records(files[step] / f"part-{parts[step]}.jsonl", header, kept)
                parts[step] += 1
                kept.clear()

    count = 0
    for located in records:
        step = record_step(located.record)
        if not located.record.canary and step in held:
            held[step].append(located.record)
            tokens[step] += len(located.record.completion_ids)
            count += 1
            if count % SPLIT_RECORDS == 0:
                write_held()
    write_held()
    return {s: str(d) for s, d in files.items()}, tokens


def remaining_seconds(first_s: float, first_tokens: int, rest_tokens: list[int]) -> tuple[float, float]:
    """The time the other steps will take, as a range, from the first step's: a step costs between the same as the
    first (a fixed cost per step: the recipes' set-up and one forward each, which dominates small steps) and the
    first's time per completion token times its own tokens (batched scoring, which dominates large ones). Returns
    (low, high) seconds."""
    fixed = first_s * len(rest_tokens)
    per_token = first_s * sum(rest_tokens) / max(first_tokens, 1)
    return min(fixed, per_token), max(fixed, per_token)


def estimate_line(step: int, first_s: float, first_tokens: int, rest_tokens: list[int]) -> str:
    """What the rest of a post-mortem will cost, said after its first step (the only measurement of this machine's
    pace there is before the bulk starts)."""
    low, high = remaining_seconds(first_s, first_tokens, rest_tokens)
    span = f"about {_minutes(low)}" if high < 1.5 * low else f"between {_minutes(low)} and {_minutes(high)}"
    return (f"post-mortem: step {step} took {first_s:.1f} s for {first_tokens} completion tokens; the other "
            f"{len(rest_tokens)} steps ({sum(rest_tokens)} tokens) {span} more at this pace (--rollouts-step N "
            "measures one step)")


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def diagnose_step(cfg: DiagnoseConfig, step: int, match: Match, candidates: dict, console,
                  held: HeldModel | None = None) -> dict:
    """One step's records diagnosed against the weights that sampled them (lag 0), or, where none of the candidates
    did, against the expected one: lag = steps between (None without checkpoints), the figures holding α too."""
    lag = 0 if match.verdict != "missing" else (None if match.expected is None else step - match.expected)
    model = candidates[match.sampled_by]
    return run_diagnose(dataclasses.replace(cfg, model=model, rollouts_step=step, checkpoint_lag=lag), console,
                        held.get(model) if held is not None else None)


def scan_steps(path: str) -> list[int]:
    """The steps the records hold (their step, or their weight version), sorted; refused when some record has
    neither beside records that have one (such a run cannot be split into steps)."""
    _, records = read_rollouts(path)
    steps, missing = set(), None
    for located in records:
        if located.record.canary:  # the probe's steps are the run's syncs, read apart (canary.py)
            continue
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
    """{step: checkpoint directory} of the subdirectories of `directory` named as CHECKPOINT_NAME says; refused in
    one line: a link, two directories for one step, a checkpoint-like name without a step, an absurd step, a
    checkpoint without config.json, checkpoints of different architectures."""
    root = Path(directory)
    if not root.is_dir():
        raise RecordError(f"--checkpoints {printable(directory)}: not a directory of checkpoints")
    found: dict[int, Path] = {}
    for p in sorted(root.iterdir()):
        m, shown = CHECKPOINT_NAME.fullmatch(p.name), printable(str(p))
        if not m:
            if CHECKPOINT_LIKE.fullmatch(p.name) and p.is_dir():
                raise RecordError(f"--checkpoints: {shown} is named like a checkpoint but has no step number "
                                  "(checkpoint-N, global_step_N, step-N or iter_N): rename or move it")
            continue
        if p.is_symlink():
            raise RecordError(f"--checkpoints: {shown} is a link: give the checkpoint directory itself")
        if not p.is_dir():
            continue
        if len(m.group(1)) > MAX_STEP_DIGITS:
            raise RecordError(f"--checkpoints: {shown}: a step of {len(m.group(1))} digits; no run has that "
                              "many steps: rename it")
        step = int(m.group(1))
        if step in found:
            raise RecordError(f"--checkpoints: {printable(str(found[step]))} and {shown} are both step {step}: "
                              "keep one")
        found[step] = p
    if not found:
        raise RecordError(f"--checkpoints {printable(directory)}: no subdirectory named checkpoint-N, global_step_N, "
                          "step-N or iter_N")
    check_architectures(found)
    return found


def check_architectures(found: dict[int, Path]) -> None:
    """Every checkpoint has a config.json, and all share ARCHITECTURE_KEYS (one run's checkpoints)."""
    first = None
    for step, p in sorted(found.items()):
        shown = printable(str(p))
        try:
            config = json.loads((p / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            raise RecordError(f"--checkpoints: {shown} has no readable config.json: not a model checkpoint "
                              "(give the directory the trainer saved)") from None
        arch = {k: config.get(k) for k in ARCHITECTURE_KEYS} if isinstance(config, dict) else {}
        if first is None:
            first = (p, arch, shown)
        elif arch != first[1]:
            diff = ", ".join(f"{k} {first[1].get(k)} vs {arch.get(k)}" for k in ARCHITECTURE_KEYS
                             if first[1].get(k) != arch.get(k))
            raise RecordError(f"--checkpoints: {first[2]} and {shown} are different models ({diff}): "
                              "one run's checkpoints share an architecture")


def candidate_models(steps: list[int], checkpoints: dict[int, Path], model: str) -> dict[int | None, str]:
    """The weights that may have sampled the records: every checkpoint (step -> path), and --model as step 0 where a
    step precedes every checkpoint and none is step 0 (TRL saves no checkpoint-0: the run's initial model is --model);
    without checkpoints, --model alone (key None)."""
    if not checkpoints:
        return {None: model}
    found = {step: str(p) for step, p in sorted(checkpoints.items())}
    if 0 not in found and min(steps) < min(found):
        found = {0: model, **found}
    return found


def expected_checkpoint(step: int, candidates: dict[int | None, str]) -> int | None:
    """The candidate a step is measured against by name: its own checkpoint, else the nearest earlier one (there is
    one: candidate_models gives --model as step 0 where a step precedes every checkpoint); None for --model alone."""
    if None in candidates:
        return None
    return max(s for s in candidates if s <= step)


def step_row(step: int, match: Match, candidates: dict, result: dict) -> dict:
    """One step of the post-mortem: the weights that sampled it and those it was measured against, its tokens, the
    user's recipe's β figures, the kernel part (shadow against the engine), and what the answer says of the step alone
    (status, judged share; None where the figures hold α too)."""
    recipe = next(iter(result["recipes"]))
    figures = result["recipes"][recipe]
    lag = result["config"]["checkpoint_lag"]
    contains_alpha = match.verdict == "missing"
    word, share = (None, None) if contains_alpha else judged_status(result)
    return {"step": step, "checkpoint": candidates[match.sampled_by], "lag": lag, "contains_alpha": contains_alpha,
            "weights": match_row(match), "status": word, "judged_share": share,
            "sequences": result["engine"]["sequences"], "tokens": figures["tokens"], "recipe": recipe,
            **{k: figures.get(k) for k in ROW_KEYS},
            "beta_kernel_abs_mean": result["shadow"]["kernel"]["beta_abs_mean"]}
