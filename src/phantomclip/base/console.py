"""The console side of a job: progress bars on stderr, a Ctrl-C that stops at the end of a step, and the one error
line that never fails."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager


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


PIPED_EVERY_S = 60.0
"""with output that is not a terminal (a pipe, a log file), a task's progress line at most this often: a run of many
minutes says it is alive about once a minute (rich draws its bar on a terminal only)."""


class LineProgress:
    """Progress as plain lines, for a console that is not a terminal: one line when a task starts, one when it ends,
    and one at most every `every` seconds between ('scoring (fp32): 3/5, 42 s'), each with the task's `info`. The
    methods of rich's Progress that the jobs use (add_task, advance, update, console)."""

    def __init__(self, console, every: float = PIPED_EVERY_S, clock=None):
        import time

        self.console, self.every, self.clock = console, every, clock or time.monotonic
        self.tasks: dict[int, dict] = {}

    def add_task(self, description: str, total: float | None = None, completed: float = 0, **fields) -> int:
        task = len(self.tasks)
        now = self.clock()
        self.tasks[task] = {"description": description, "total": total, "completed": completed, "start": now,
                            "said": now, **fields}
        self._say(task)
        return task

    def advance(self, task: int, advance: float = 1) -> None:
        self.update(task, advance=advance)

    def update(self, task: int, advance: float | None = None, **changes) -> None:
        t = self.tasks[task]
        t.update(changes)
        t["completed"] += advance or 0
        now = self.clock()
        done = t["total"] is not None and t["completed"] >= t["total"]
        if done or now - t["said"] >= self.every:
            t["said"] = now
            self._say(task)

    def _say(self, task: int) -> None:
        t = self.tasks[task]
        total = "" if t["total"] is None else f"/{t['total']:g}"
        info = f"; {t['info']}" if t.get("info") else ""
        self.console.print(f"{t['description']}: {t['completed']:g}{total}, {self.clock() - t['start']:.0f} s{info}",
                           markup=False, highlight=False, soft_wrap=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


def progress_bar(console, transient: bool = True, info: bool = False):
    """A rich progress bar on `console` (each task: description, bar, done/total, time elapsed), to use as a context
    manager with rich's add_task / advance / update; silent when console is None (library use, tests); plain lines
    (LineProgress) when the console is not a terminal, where rich would draw nothing until the end.
    `info`: one more column, the task's `info` field (add_task(..., info="") then update(task, info=...)).
    `transient`: the bar disappears when done (the job prints its own results after it)."""
    if console is None:
        return _SilentProgress()
    if not console.is_terminal:
        return LineProgress(console)
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


TERMINATED_EXIT = 128 + signal.SIGTERM
"""the exit status of a run SIGTERM ended: 143, what a shell reports for a process the signal killed, as 130 is
Ctrl-C's (128 + SIGINT)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a `kill`, a job scheduler's stop, a container's shutdown), raised where the program is, as Ctrl-C's
    KeyboardInterrupt is: every `finally` runs (an atomic write's temp file is removed, files.atomic_write), a handler
    of Ctrl-C handles it too, and the command line says one line and exits with TERMINATED_EXIT. Python's default
    for SIGTERM is to die at once, with no line and the temp file left."""


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Inside the block, SIGTERM raises Terminated in the main thread (a handler cannot be installed elsewhere); the
    handler before it is back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Terminated

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextmanager
def exit_at_once_on_interrupt(prog: str) -> Iterator[None]:
    """Inside the block (a command's start-up: building its parser imports torch, transformers and the rest, a few
    seconds), Ctrl-C prints '<prog>: interrupted' and exits with 130 at once, and SIGTERM '<prog>: terminated' with
    TERMINATED_EXIT: nothing has been written yet, and a KeyboardInterrupt raised inside a library's import is a
    traceback (or is caught there and turned into another error). The handlers are the process's from its first
    heavy import; after the block the ones before them are back, and the command handles Ctrl-C its own way
    (GracefulStop, or 'interrupted' from the CLI). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum, frame):
        said, code = ("terminated", TERMINATED_EXIT) if signum == signal.SIGTERM else ("interrupted", 130)
        try:
            os.write(2, f"{prog}: {said}\n".encode())
        finally:
            os._exit(code)

    old = {sig: signal.signal(sig, leave) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


PIPED_WIDTH = 200
"""the columns stdout's console lays out for when it is not a terminal (a file, a pipe, less, grep): wide enough for
every table's one-row-per-recipe layout (diagnose's widest, 16 + 13 x 14 = 198 columns), so no cell is folded
mid-word (`bf16-autoc`/`ast` at Rich's default of 80 columns); prose is not hard-wrapped at all (soft wrap), the
reader's pager or editor wraps it."""


def stdout_console():
    """A Rich console on stdout: a terminal's own width (or COLUMNS, where set); piped, PIPED_WIDTH and no hard wrap."""
    from rich.console import Console

    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=PIPED_WIDTH, soft_wrap=True)


def say_error(line: str, code: int) -> int:
    """Print the one error line on stderr and return `code`; a stderr that cannot be written loses the line, never
    raises. A stdout that failed is pointed at /dev/null, so Python's flush at exit does not fail a second time."""
    from .files import shown

    try:
        print(shown(line), file=sys.stderr, flush=True)  # a newline in a file name must not split the one line
    except (OSError, ValueError):
        pass
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # a captured stdout (tests) has no descriptor
            pass
    return code
