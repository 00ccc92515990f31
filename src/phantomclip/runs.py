"""Run directories that lose nothing: config.json, metrics.jsonl, samples.jsonl, atomic checkpoints, resume.

Layout of a run directory:
    config.json        the exact configuration, versions and seed (written once, atomically)
    metrics.jsonl      one JSON object per step, flushed and fsynced as it is written
    samples.jsonl      a few completions per step
    tokens.jsonl       per-token α, β, advantage and clip flags of the first steps (for the report)
    checkpoint.pt      the latest checkpoint (temp file + fsync + rename: never half-written)

A SIGKILL can leave at most a torn last line in the JSONL files; readers skip it and `resume` truncates both
files back to the checkpoint's step, so the steps after it are recomputed and logged exactly once.
"""

from __future__ import annotations

import io
import json
import math
import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from .errors import PhantomclipError


class RunError(PhantomclipError):
    """A run directory that cannot be created or resumed as asked."""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temp file in the same directory, fsync, rename: a reader sees the old
    file or the new one, never a half-written one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def json_safe(x):
    """NaN and ±inf become null: strict JSON, readable by JavaScript's JSON.parse."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def rounded(x: torch.Tensor, digits: int = 6) -> list[float | None]:
    """Values of `x` as a JSON list rounded to `digits` decimals (1e-6 is far below any β worth reading, and keeps
    per-token arrays short); a non-finite value becomes None (null), as `json_safe` writes it."""
    return [round(v, digits) if math.isfinite(v) else None for v in x.double().tolist()]


class _SilentProgress:
    """What `progress_bar` returns without a console: rich's Progress methods, doing nothing."""

    def add_task(self, *args, **kwargs) -> int:
        return 0

    def advance(self, *args, **kwargs) -> None:
        pass

    def update(self, *args, **kwargs) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


def progress_bar(console, transient: bool = True, info: bool = False):
    """A rich progress bar on `console` (each task: description, bar, done/total, time elapsed), to use as a context
    manager with rich's add_task / advance / update; silent when console is None (library use, tests).
    `info`: one more column, the task's `info` field (add_task(..., info="") then update(task, info=...)).
    `transient`: the bar disappears when done (the job prints its own results after it)."""
    if console is None:
        return _SilentProgress()
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    if info:
        columns.append(TextColumn("{task.fields[info]}"))
    return Progress(*columns, console=console, transient=transient)


def write_json(result: dict, path: str | Path) -> None:
    """Write `result` to `path` as strict JSON (NaN/inf -> null), atomically (temp file, fsync, rename)."""
    atomic_write_bytes(Path(path), json.dumps(json_safe(result), indent=1, allow_nan=False).encode("utf-8"))


def read_jsonl(path: Path) -> list[dict]:
    """All complete JSON lines of `path` (a torn last line from a killed writer is skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def config_diff(old: dict, new: dict, ignore: tuple[str, ...] = ()) -> list[str]:
    """Keys whose values differ between two configs, as 'key: old -> new'."""
    keys = sorted((set(old) | set(new)) - set(ignore))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


class RunDir:
    """One run's directory. Create with `RunDir.create` (new run) or `RunDir.resume` (continue one)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.metrics_path = self.path / "metrics.jsonl"
        self.samples_path = self.path / "samples.jsonl"
        self.tokens_path = self.path / "tokens.jsonl"
        self.checkpoint_path = self.path / "checkpoint.pt"

    @classmethod
    def create(cls, path: str | Path, config: dict[str, Any]) -> RunDir:
        run = cls(Path(path))
        if (run.path / "config.json").exists():
            raise RunError(f"{run.path} already holds a run: pass --resume to continue it, or choose another --out")
        try:
            run.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunError(f"cannot create run directory {run.path} ({e.strerror})") from None
        atomic_write_bytes(run.path / "config.json", json.dumps(config, indent=1, sort_keys=True).encode())
        return run

    @classmethod
    def resume(
        cls, path: str | Path, config: dict[str, Any], ignore: tuple[str, ...] = ("steps",),
        defaults: dict[str, Any] | None = None,
    ) -> tuple[RunDir, dict | None]:
        """Reopen a run whose config matches `config` (except `ignore`); returns it and its checkpoint (or None).
        `defaults`: values of config keys added since older runs were made; a key the run's config.json lacks
        counts as its default (a setting that did not exist then ran as its default does now)."""
        run = cls(Path(path))
        cfg_path = run.path / "config.json"
        if not cfg_path.exists():
            raise RunError(f"{run.path} holds no run to resume (no config.json): drop --resume to start one")
        diff = config_diff({**(defaults or {}), **json.loads(cfg_path.read_text())}, config, ignore)
        if diff:
            raise RunError(f"--resume: {run.path} was made with a different configuration: {'; '.join(diff)}")
        ckpt = torch.load(run.checkpoint_path, weights_only=False) if run.checkpoint_path.exists() else None
        done = ckpt["step"] if ckpt else 0
        # drop what came after the checkpoint: it is recomputed
        for p in (run.metrics_path, run.samples_path, run.tokens_path):
            rows = [r for r in read_jsonl(p) if r.get("step", 0) <= done]
            atomic_write_bytes(p, "".join(json.dumps(r) + "\n" for r in rows).encode())
        return run, ckpt

    def _append(self, path: Path, row: dict) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def log_metrics(self, row: dict) -> None:
        self._append(self.metrics_path, row)

    def log_samples(self, row: dict) -> None:
        self._append(self.samples_path, row)

    def log_tokens(self, row: dict) -> None:
        self._append(self.tokens_path, row)

    def metrics(self) -> list[dict]:
        return read_jsonl(self.metrics_path)

    def save_checkpoint(self, state: dict) -> None:
        """`state` must hold 'step'; written atomically so a kill mid-save keeps the previous checkpoint."""
        buf = io.BytesIO()
        torch.save(state, buf)
        atomic_write_bytes(self.checkpoint_path, buf.getvalue())


class GracefulStop:
    """First Ctrl-C: finish the current step, checkpoint, stop. Second: KeyboardInterrupt as usual.
    Only in the main thread (signal handlers cannot be installed elsewhere)."""

    def __init__(self):
        self.flag = False
        self._old = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.flag:
            raise KeyboardInterrupt
        self.flag = True
        print("\nstopping after this step with a checkpoint (Ctrl-C again to abort)", flush=True)

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False
