"""Run directories that lose nothing: config.json, metrics.jsonl, samples.jsonl, atomic checkpoints, resume.

Layout of a run directory:
    config.json        the exact configuration, versions and seed (written once, atomically)
    metrics.jsonl      one JSON object per step, flushed and fsynced as it is written
    samples.jsonl      a few completions per step
    tokens.jsonl       per-token α, β, advantage and clip flags of the first steps (for the report)
    checkpoint.pt      the latest checkpoint (temp file + fsync + rename: never half-written); tensors and plain
                       containers only, read back with torch.load(weights_only=True): a crafted file cannot run code
    snapshots/         with `train --keep-snapshots N`: step-NNNNNN.safetensors (the fp32 weights after that many
                       steps) and step-NNNNNN.tokens.json (the tokens sampled with those weights)
    .lock              held (an advisory flock) by the one process writing the run; it names that process's pid

A SIGKILL can leave at most a torn last line in the JSONL files; readers skip it with a warning and `resume`
truncates the files back to the checkpoint's step, so the steps after it are recomputed and logged exactly once. A
bad line anywhere else is damage, not a crash artefact: reading stops with an error naming the file and line, and
nothing is rewritten.
"""

from __future__ import annotations

import io
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from ..base.errors import PhantomclipWarning, WriteError, ascii_digits
from ..base.files import (
    InputError,
    check_output_dir,
    content_hash,
    json_safe,
    printable,
    write_error,
)
from ..base.locks import DirLock, experiment_of
from ..base.owned import (
    check_no_links,
    open_owned,
    open_reading,
    remove_stranded_temps,
    write_owned,
    write_owned_bytes,
)
from .checks import check_checkpoint, check_metrics_rows, check_run_ids
from .read import (
    CHECKPOINT_CONFIG,
    RunError,
    check_checkpoint_config,
    check_steps,
    config_diff,
    nan_for_null,
    plain_config,
    read_jsonl,
    read_run_config,
    run_id,
)


def jsonl_line(row: dict) -> str:
    """One strict-JSON line of a run file (NaN and ±inf as null)."""
    return json.dumps(json_safe(row), allow_nan=False) + "\n"


RUN_ID = "run/id"
"""the key every row of a run's metrics.jsonl, samples.jsonl and tokens.jsonl carries: the run's id (run_id)."""


def input_record(files: dict[str, Path]) -> dict[str, dict[str, str]]:
    """config.json's "inputs": each input file (or model directory) with its content hash, so a resume can tell
    that a file under the same path changed."""
    return {what: {"path": str(p), "sha256": content_hash(Path(p))} for what, p in files.items()}


RUN_FILES = ("metrics.jsonl", "samples.jsonl", "tokens.jsonl", "checkpoint.pt")
SNAPSHOT_NAME = re.compile(r"step-[0-9]{6,}(\.safetensors|\.tokens\.json)")
"""the names of the files a run keeps under snapshots/ (RunDir.snapshot_path)."""


class RunDir:
    """One run's directory, locked for the life of this object. Create with `RunDir.create` (new run) or
    `RunDir.resume` (continue one); `close()` releases the lock."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.metrics_path = self.path / "metrics.jsonl"
        self.samples_path = self.path / "samples.jsonl"
        self.tokens_path = self.path / "tokens.jsonl"
        self.checkpoint_path = self.path / "checkpoint.pt"
        self.lock: DirLock | None = None
        self.outer: DirLock | None = None
        """the shared lock of the experiment directory this run belongs to, when it belongs to one."""
        self.config: dict[str, Any] | None = None
        self.id: int | None = None
        """the run's id (run_id of its config.json), written into every row it logs (RUN_ID)."""
        """the configuration this process runs with, written into every checkpoint (check_checkpoint_config)."""

    def _take(self) -> None:
        """Lock the directory (and share the lock of the experiment it belongs to, `experiment_of`), then remove temp
        files a killed writer stranded (only the lock holder may)."""
        experiment = experiment_of(self.path)
        if experiment is not None:
            self.outer = DirLock(experiment, "experiment", shared=True, inside=self.path)
        try:
            self.lock = DirLock(self.path, "run")
            check_no_links(self.path, self.snapshots_path)  # before anything is read or rewritten
        except WriteError as e:
            self.close()
            raise RunError(str(e)) from None
        except BaseException:
            self.close()
            raise
        remove_stranded_temps(self.path, self.path, lambda name: name in (*RUN_FILES, "config.json"))
        remove_stranded_temps(self.path, self.snapshots_path, lambda name: SNAPSHOT_NAME.fullmatch(name) is not None)

    def close(self) -> None:
        for lock in (self.lock, self.outer):
            if lock is not None:
                lock.release()

    @classmethod
    def create(cls, path: str | Path, config: dict[str, Any]) -> RunDir:
        check_output_dir(path)
        run = cls(Path(path))
        taken = f"{run.path} already holds a run: pass --resume to continue it, or choose another --out"
        if os.path.lexists(run.path / "config.json"):
            read_run_config(run.path)  # a model's folder is not a run: said as such
            raise RunError(taken)
        try:
            run.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunError(f"cannot create run directory {run.path} ({e.strerror}): choose a writable --out") from None
        run._take()
        try:
            if (run.path / "config.json").exists():  # another process created it between the check and the lock
                raise RunError(taken)
            orphans = [name for name in RUN_FILES if (run.path / name).exists()]
            if orphans:
                raise RunError(f"{run.path} holds run files ({', '.join(orphans)}) but no config.json, so they belong "
                               "to no run this tool can continue: choose another --out or remove them")
            write_owned_bytes(run.path, run.path / "config.json",
                              json.dumps(config, indent=1, sort_keys=True).encode())
        except BaseException:
            run.close()
            raise
        run.config, run.id = config, run_id(config)
        return run

    @staticmethod
    def check_config(path: str | Path, config: dict[str, Any], ignore: tuple[str, ...] = (),
                     defaults: dict[str, Any] | None = None) -> None:
        """Refuse to continue the run in `path` as `config` when they differ (except `ignore`), naming the keys; an
        input file whose content hash changed is named first. `defaults`: values of config keys added since older
        runs were made; a key the run's config.json lacks counts as its default."""
        path = Path(path)
        saved = read_run_config(path)
        old = {**(defaults or {}), **saved}
        for key, value in (defaults or {}).items():  # a nested block (the plan) gains keys too: one level deep
            if isinstance(value, dict) and isinstance(saved.get(key), dict):
                old[key] = {**value, **saved[key]}
        old_inputs, new_inputs = old.get("inputs") or {}, config.get("inputs") or {}
        # an input the old run did not record (written before hashes were) cannot be checked; a file added or dropped
        # since shows as a changed flag (--prompts, --reward, --model) in the diff below
        changed = [f"{what} {new_inputs[what]['path']}" for what in new_inputs
                   if what in old_inputs and (old_inputs[what] or {}).get("sha256") != new_inputs[what]["sha256"]]
        if changed:
            raise RunError(f"{path} was made from other input files: {', '.join(changed)} changed since (content hash "
                           "differs): restore them, or start a new --out")
        diff = config_diff(old, config, (*ignore, "inputs"))
        if diff:
            raise RunError(f"{path} was made with a different configuration: {'; '.join(diff)}: continue it with the "
                           "same settings, or choose another --out")

    @classmethod
    def resume(
        cls, path: str | Path, config: dict[str, Any], ignore: tuple[str, ...] = ("steps",),
        defaults: dict[str, Any] | None = None, required: tuple[str, ...] = (), max_step: int | None = None,
    ) -> tuple[RunDir, dict | None]:
        """Reopen a run whose config matches `config` (see check_config); returns it and its checkpoint (or None).
        `required`: keys the checkpoint must hold; `max_step`: the most steps it may have (the run's budget). Every
        check runs, and every file is read whole, before anything is rewritten."""
        check_output_dir(path)
        run = cls(Path(path))
        if not (run.path / "config.json").exists():
            raise RunError(f"{run.path} holds no run to resume (no config.json): drop --resume to start one")
        run._take()
        try:
            cls.check_config(run.path, config, ignore, defaults)
            run.id = run_id(read_run_config(run.path))
            ckpt = run.load_checkpoint(required)
            if ckpt is not None:
                check_checkpoint_config(run.checkpoint_path, ckpt, config, ignore)
            done = ckpt["step"] if ckpt else 0
            if max_step is not None and done > max_step:
                raise RunError(f"{run.path} already has {done} steps, more than --steps {max_step}: give --steps "
                               f"{done} or more to continue it")
            if ckpt is not None and {"master", "snapshots"} <= set(required):  # the trainer's own checkpoint
                check_checkpoint(run.checkpoint_path, ckpt, int(config.get("staleness", 0)))
            logged = {p: read_jsonl(p, run.path) for p in (run.metrics_path, run.samples_path, run.tokens_path)}
            check_metrics_rows(run.metrics_path, logged[run.metrics_path])
            for p, found in logged.items():  # rows of another run copied in would be continued from
                check_run_ids(p, found, run.id)
            if ckpt is None and logged[run.metrics_path]:  # killed before its first checkpoint: a run's rows are a
                # function of its config and seed, so recomputing them from step 0 gives them again
                warnings.warn(f"{run.path} has {len(logged[run.metrics_path])} logged steps but no checkpoint.pt: "
                              "recomputing them from step 0", PhantomclipWarning, stacklevel=2)
            # metrics: a row per step; samples: a row per step where any were logged; tokens: the first steps only
            for p, every_step in ((run.metrics_path, True), (run.samples_path, bool(logged[run.samples_path])),
                                  (run.tokens_path, False)):
                check_steps(p, logged[p], done, every_step)
            rows = {p: [r for r in found if r.get("step", 0) <= done] for p, found in logged.items()}
            # drop what came after the checkpoint: it is recomputed
            for p, kept in rows.items():
                write_owned_bytes(run.path, p, "".join(jsonl_line(r) for r in kept).encode())
        except BaseException:
            run.close()
            raise
        run.config = config
        return run, ckpt

    def load_checkpoint(self, required: tuple[str, ...] = ()) -> dict | None:
        """The checkpoint (None if there is none), read as tensors and plain containers only: a file holding
        anything else (a crafted pickle, damage) is refused with one line and runs nothing. It must hold a step
        count >= 0 and the `required` keys."""
        if not os.path.lexists(self.checkpoint_path):
            return None
        try:  # never through a link (another run's checkpoint), never a FIFO
            fd = open_reading(self.path, self.checkpoint_path)
        except InputError as e:
            raise RunError(f"{e}: nothing was rewritten") from None
        try:
            with warnings.catch_warnings(), os.fdopen(fd, "rb") as f:  # torch's notes on a foreign pickle protocol:
                warnings.simplefilter("ignore")  # the refusal below says it
                ckpt = torch.load(f, weights_only=True)
        except OSError as e:  # no permission to read it (chmod 000), an I/O error: not damage
            raise RunError(f"{printable(str(self.checkpoint_path))} cannot be read ({e.strerror or e}): give yourself "
                           "read access (chmod u+r) and resume again; nothing was rewritten") from None
        except Exception as e:  # UnpicklingError (a forbidden object), EOFError, RuntimeError (a truncated zip)...
            # torch's weights-only unpickler names a refused object a GLOBAL; anything else is damage
            why = "it holds objects other than tensors" if "GLOBAL" in str(e) else "it is damaged"
            raise RunError(f"{self.checkpoint_path} is not a checkpoint this tool can read safely ({why}; "
                           f"{type(e).__name__}): nothing in it was run; remove it to restart the run from step 0, or "
                           "restore it") from None
        step = ckpt.get("step") if isinstance(ckpt, dict) else None
        missing = [k for k in required if k not in ckpt] if isinstance(ckpt, dict) else list(required)
        if not isinstance(step, int) or isinstance(step, bool) or step < 0 or missing:
            what = f"no {', '.join(missing)}" if missing else f"step {step!r}"
            raise RunError(f"{self.checkpoint_path} is not a checkpoint this tool wrote ({what}): remove it to restart "
                           "the run from step 0, or restore it")
        return ckpt

    def _append(self, path: Path, row: dict) -> None:
        row = row if self.id is None else {**row, RUN_ID: self.id}
        fd = open_owned(self.path, path, os.O_WRONLY | os.O_APPEND)  # never through a link or into a FIFO
        try:
            with open(fd, "a", encoding="utf-8") as f:
                f.write(jsonl_line(row))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise write_error(path, e) from None

    def log_metrics(self, row: dict) -> None:
        self._append(self.metrics_path, row)

    def log_samples(self, row: dict) -> None:
        self._append(self.samples_path, row)

    def log_tokens(self, row: dict) -> None:
        self._append(self.tokens_path, row)

    def metrics(self) -> list[dict]:
        rows = check_metrics_rows(self.metrics_path, read_jsonl(self.metrics_path, self.path))
        check_run_ids(self.metrics_path, rows, self.id if self.id is not None else run_id(read_run_config(self.path)))
        return [nan_for_null({k: v for k, v in r.items() if k != RUN_ID}) for r in rows]  # the figures alone

    @property
    def snapshots_path(self) -> Path:
        return self.path / "snapshots"

    def snapshot_path(self, step: int, suffix: str = ".safetensors") -> Path:
        """snapshots/step-NNNNNN.safetensors (the weights after `step` steps) or .tokens.json (tokens sampled with
        them)."""
        return self.snapshots_path / f"step-{step:06d}{suffix}"

    def snapshot_steps(self) -> list[int]:
        """Steps with a weights snapshot (snapshots/step-NNNNNN.safetensors), ascending."""
        names = (p.name.removeprefix("step-").removesuffix(".safetensors")
                 for p in self.snapshots_path.glob("step-*.safetensors"))
        # only the names snapshot_path writes: step-2 beside step-000002 would read one step twice
        return sorted(int(n) for n in names if ascii_digits(n) and n == f"{int(n):06d}")

    def keep_snapshot(self, model: torch.nn.Module, step: int, every: int, missing_only: bool = False) -> int | None:
        """`train --keep-snapshots every`: the weights after `step` steps when step is a multiple of `every`
        (`missing_only`: unless the file exists, as on a resumed run's first step). Returns the bytes written, or None
        when nothing was due."""
        if not every or step % every or (missing_only and self.snapshot_path(step).exists()):
            return None
        return self.save_snapshot(model, step)

    def keep_snapshot_tokens(self, version: int, every: int, record: dict) -> None:
        """The tokens of the first batch sampled with snapshot `version`'s weights (at staleness s, batches 0..s all
        sample with θ_0: the first one is kept)."""
        if every and not version % every and not self.snapshot_path(version, ".tokens.json").exists():
            self.save_snapshot_tokens(version, record)

    def save_snapshot(self, model: torch.nn.Module, step: int) -> int:
        """The model's weights after `step` optimizer steps (safetensors: no pickle; tied weights stored once),
        written atomically. Returns its size in bytes."""
        from safetensors.torch import save_model

        path = self.snapshot_path(step)
        write_owned(self.path, path, lambda tmp: save_model(model, tmp))
        return path.stat().st_size

    def save_snapshot_tokens(self, version: int, record: dict) -> None:
        """The tokens sampled with the weights of snapshot `version` (prompt and completion ids), beside it."""
        record = {"step": version, **record}
        write_owned_bytes(self.path, self.snapshot_path(version, ".tokens.json"), json.dumps(record).encode())

    def log_step(self, row: dict, samples: dict, tokens: dict, token_log_steps: int) -> None:
        """One training step's rows: metrics always, samples always, per-token records for the first steps."""
        self.log_metrics(row)
        self.log_samples(samples)
        if row["step"] <= token_log_steps:
            self.log_tokens({"step": row["step"], **tokens})

    def save_training_state(self, step: int, master: torch.nn.Module, optimizer, scaler, snapshots: dict,
                            staleness: int) -> None:
        """Everything the next steps of a run depend on: weights, optimizer, loss scale, and the weight versions that
        batches step .. step + staleness − 1 will be sampled with (trainer.CHECKPOINT_KEYS)."""
        keep = {v: w for v, w in snapshots.items() if step - staleness <= v < step}
        self.save_checkpoint({"step": step, "master": master.state_dict(), "optimizer": optimizer.state_dict(),
                              "scaler": scaler.state_dict(), "snapshots": keep})

    def save_checkpoint(self, state: dict) -> None:
        """`state` must hold 'step'; written atomically so a kill mid-save keeps the previous checkpoint. The run's
        configuration goes with it (key CHECKPOINT_CONFIG), so a resume can tell another run's checkpoint."""
        buf = io.BytesIO()
        torch.save(state if self.config is None else {**state, CHECKPOINT_CONFIG: plain_config(self.config)}, buf)
        write_owned_bytes(self.path, self.checkpoint_path, buf.getvalue())
