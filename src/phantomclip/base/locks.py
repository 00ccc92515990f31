"""The one lock every job that writes a run or an experiment honours: an advisory flock on DIR/.lock.

`train` (a new run or a resume) holds its run directory's lock exclusively; `experiment` holds its own directory's
lock exclusively for its whole life, and each of its runs' as it trains them; a run trained by hand inside an
experiment's directory (OUT/<arm>/seed-<s>) also holds the experiment's lock shared. So two jobs never write one
run, and an experiment never runs beside a job training one of its runs, whichever starts first.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import PhantomclipError, WriteError
from .files import printable, write_error
from .owned import open_owned


class LockError(PhantomclipError):
    """A run or experiment directory another job is writing, or whose .lock is not one phantomclip made."""


EXPERIMENT_MANIFEST = "experiment.json"
"""the file that makes a directory an experiment's (experiments.check_manifest writes it); its runs are
OUT/<arm>/seed-<s>."""


def experiment_of(run: Path) -> Path | None:
    """The experiment directory `run` belongs to (OUT for OUT/<arm>/seed-<s>, where OUT holds experiment.json), or
    None: a run trained there by hand shares the experiment's lock."""
    outer = Path(run).parent.parent
    return outer if Path(run).name.startswith("seed-") and os.path.lexists(outer / EXPERIMENT_MANIFEST) else None


LOCK_TEXT = re.compile(r"[0-9]{0,10}")
"""what a .lock phantomclip made holds: nothing yet, or the pid of the last process that held it exclusively."""


class DirLock:
    """An advisory lock (fcntl.flock) on DIR/.lock for as long as this object lives: exclusive for the one writer of
    a run or experiment directory, shared (`shared`) for a run trained inside an experiment's directory, so that no
    experiment runs while any of its runs is trained by another job, and no run of it is trained while it runs. The
    kernel drops a flock when its holder dies, so a killed run's lock is free at once (a stale .lock file holds no
    lock); the file's text, the exclusive holder's pid, is only for the message a second writer gets. A .lock that is
    not one phantomclip made (a link, a second hard link to a user's file, a special file, or text other than a pid)
    is refused, never truncated. A lock this process already holds on the same file satisfies a shared request (an
    experiment training its own runs)."""

    _held: dict[tuple[int, int], DirLock] = {}
    """(device, inode) of each .lock this process holds exclusively -> its DirLock."""

    def __init__(self, directory: Path, what: str, shared: bool = False, inside: Path | None = None):
        import fcntl

        self.path, self.fd, self.key = Path(directory) / ".lock", None, None
        try:  # never through a link (its target's content would become a pid), never a FIFO (the open would hang)
            self.fd = open_owned(directory, self.path, os.O_RDWR, "its lock file")
        except WriteError as e:
            raise LockError(str(e)) from None
        st = os.fstat(self.fd)
        key = (st.st_dev, st.st_ino)
        if shared and key in DirLock._held:  # this process runs the experiment: its runs are its own
            self.release()
            return
        try:
            fcntl.flock(self.fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(self.fd, 32, 0).decode(errors="replace").strip()
            self.release()
            raise LockError(_in_use(Path(directory), what, text, inside)) from None
        except OSError as e:  # no flock on this filesystem (some network mounts), or interrupted
            self.release()
            raise LockError(f"cannot lock {self.path} ({e.strerror or e}): put the run on a local filesystem") from None
        self._check_own_text()
        if shared:
            return
        try:  # a full disk fails here, first of all the run's writes: said as this file's, not as stdout's
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, str(os.getpid()).encode(), 0)
        except OSError as e:
            self.release()
            raise write_error(self.path, e) from None
        self.key = key
        DirLock._held[key] = self

    def _check_own_text(self) -> None:
        """Refuse a .lock whose text is not what phantomclip writes there (a user's file named .lock)."""
        text = os.pread(self.fd, 64, 0).decode(errors="replace").strip()
        if not LOCK_TEXT.fullmatch(text):
            self.release()
            raise LockError(f"{printable(str(self.path))} holds {text[:20]!r}, not the process id phantomclip writes "
                           "in its lock file: it is not a lock phantomclip made; remove it, or choose another --out")

    def release(self) -> None:
        if self.key is not None:
            DirLock._held.pop(self.key, None)
            self.key = None
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __del__(self):
        self.release()


def _in_use(directory: Path, what: str, text: str, inside: Path | None) -> str:
    """The one line for a lock held elsewhere: by the exclusive holder named in the file (when that process lives),
    or, for an experiment's directory, by a job training one of its runs."""
    alive = False
    if text.isdigit() and text.isascii():
        try:
            os.kill(int(text), 0)
            alive = True
        except (OSError, OverflowError, ValueError):
            alive = False
    who = ("this process" if text == str(os.getpid()) else
           f"another phantomclip process (pid {text})" if alive else "another phantomclip process")
    if inside is not None:
        return (f"{inside} belongs to the {what} in {directory}, which {who} is running: wait for it to finish, or "
                "stop it first")
    doing = f"writing this {what}" if alive or what == "run" else f"training a run of this {what}"
    return f"{directory} is in use by {who} {doing}: wait for it to finish, or stop it first"


def writer_of(directory: Path) -> str | None:
    """The pid (as its text, or 'unknown') of the process writing the run or experiment in `directory` (holding its
    lock exclusively), or None when none is: how a reader (the report) honours the lock without taking it. The probe
    opens DIR/.lock read-only, never through a link and never creating it, and takes a shared flock for an instant
    (a writer starting in that instant is told the directory is in use, and may retry)."""
    import fcntl
    import stat

    try:
        fd = os.open(Path(directory) / ".lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    except OSError:
        return None
    finally:
        os.close(fd)  # drops the shared flock, if taken
