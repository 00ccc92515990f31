"""Files that are never half-written, and JSON that is always strict: the I/O every job shares.

`atomic_write` writes to a temp file beside the target, fsyncs and renames, so a killed job leaves the old file or
the new one, never a torn one. JSON is written strictly (NaN and inf become null, tensors lists) and JSONL is read
back line by line, a torn last line (a SIGKILL mid-write) skipped with a warning, any other bad line an error.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from .errors import WriteError


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Write `path` through `write(tmp_path)` into a temp file in the same directory, fsync, rename: a reader sees the
    old file or the new one, never a half-written one; an OSError becomes one WriteError line naming `path`."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
        os.close(fd)
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
        os.replace(tmp, path)
    except OSError as e:
        raise write_error(path, e) from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            Path(tmp).unlink(missing_ok=True)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """`data` into `path`, atomically (atomic_write)."""
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


TEMP_SUFFIX = ".tmp"
"""atomic_write_bytes's temp files are `.<name>.<random>.tmp` beside the target; a kill can strand one."""


def write_error(path: Path, e: OSError) -> WriteError:
    """An OSError while writing `path` as one line: the path, the system's reason, what to do."""
    return WriteError(f"cannot write {path} ({e.strerror or e}): free some space or choose a writable location")


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


def write_json(result: dict, path: str | Path) -> None:
    """Write `result` to `path` as strict JSON (NaN/inf -> null), atomically (temp file, fsync, rename)."""
    atomic_write_bytes(Path(path), json.dumps(json_safe(result), indent=1, allow_nan=False).encode("utf-8"))


def content_hash(path: Path) -> str:
    """sha256 of a file, or of a directory's files (their relative paths and contents, in sorted order)."""
    import hashlib

    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        digest.update(str(f.relative_to(path) if path.is_dir() else "").encode() + b"\0")
        with open(f, "rb") as fh:
            digest.update(hashlib.file_digest(fh, "sha256").digest())
    return digest.hexdigest()


