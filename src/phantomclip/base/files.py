"""Files that are never half-written, and JSON that is always strict: the I/O every job shares.

`atomic_write` writes to a temp file beside the target, fsyncs and renames, so a killed job leaves the old file or
the new one, never a torn one. JSON is written strictly (NaN and inf become null, tensors lists) and JSONL is read
back line by line, a torn last line (a SIGKILL mid-write) skipped with a warning, any other bad line an error.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from .errors import ConfigError, PhantomclipError, WriteError


class InputError(PhantomclipError):
    """An input file that is not one to read: a FIFO, device or directory, too large, unreadable, not UTF-8. The
    message names the file; `reason` is the rest, for a caller that words the line itself."""

    def __init__(self, path: str | Path, reason: str):
        super().__init__(f"{printable(str(path))}: {reason}")
        self.reason = reason


INPUT_MEMORY_SHARE = 16
"""an input file may hold at most this fraction of the machine's memory: JSON read into Python takes about 4 times
its text (measured with tracemalloc on the demo's metrics.jsonl: 4.2x at the peak), and the job needs the rest."""
INPUT_CAP = 2**30
"""and at most 1 GiB whatever the memory: a metrics.jsonl of 10,000 steps of 47 figures is 16.6 MB."""


def input_limit() -> int:
    """The most bytes an input file may have on this machine (INPUT_MEMORY_SHARE, INPUT_CAP)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        memory = 16 * 2**30
    return min(INPUT_CAP, memory // INPUT_MEMORY_SHARE)


def _check_input_stat(path: str | Path, st: os.stat_result) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise InputError(path, "is a directory, not a file: give the file")
    if not stat.S_ISREG(st.st_mode):
        raise InputError(path, f"is {special_kind(st.st_mode)}, not a regular file: give the file itself (a pipe or "
                               "device is never read: it may never end)")
    limit = input_limit()
    if st.st_size > limit:
        raise InputError(path, f"is {st.st_size / 1e6:,.0f} MB, more than the {limit / 1e6:,.0f} MB an input file may "
                               f"have on this machine (1/{INPUT_MEMORY_SHARE} of its memory, 1 GiB at most): give "
                               "the file phantomclip wrote")


def check_input(path: str | Path) -> None:
    """Refuse (InputError) an input that is not a regular file of a sane size, before a library that takes a path
    (safetensors, transformers) opens it: a FIFO would block that open for ever."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise InputError(path, f"cannot be read ({e.strerror or e})") from None
    _check_input_stat(path, st)


def read_input(path: str | Path) -> str:
    """The UTF-8 text of the input file `path`: the one way phantomclip reads a file it did not just write (configs,
    run files, report sources, snapshot tokens). A regular file only (opened without blocking, so a FIFO cannot
    hang it, and checked on the open descriptor), at most input_limit() bytes, checked before reading; InputError
    otherwise, naming the file printably (a name that is not UTF-8 shows its bytes as \\xNN)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise InputError(path, f"cannot be read ({e.strerror or e})") from None
    return input_text_fd(path, fd)


def input_text_fd(path: str | Path, fd: int) -> str:
    """The UTF-8 text of the input file open on `fd` (check_input_fd), which it closes; InputError otherwise."""
    try:
        data = check_input_fd(path, fd)
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(path, "is not UTF-8 text") from None


def check_input_fd(path: str | Path, fd: int) -> bytes:
    """The bytes of the input file open on `fd` (named `path` in messages), checked on the descriptor to be a
    regular file of at most input_limit() bytes before it is read; InputError otherwise. The caller closes `fd`."""
    try:
        _check_input_stat(path, os.fstat(fd))
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(input_limit() + 1)
    except OSError as e:
        raise InputError(path, f"cannot be read ({e.strerror or e})") from None


def output_target(path: str | Path) -> tuple[Path, bool]:
    """Where an output named `path` goes and how: (the file to replace atomically, False) for a regular file or a
    path that does not exist yet, a symlink followed to its target (the link stays a link); (path, True) for a stream
    the user means to write into, a character device (/dev/null, a terminal) or a FIFO, and for /dev/stdout and the
    other /proc/self/fd links. A directory, a block device, a socket or a name longer than the file system allows is
    refused with one WriteError line: a temp file renamed over it would replace it."""
    path = Path(path)
    check_name_lengths(path, str(path))
    try:
        st = os.stat(path)  # follows symlinks: the kind of what a write would reach
    except FileNotFoundError:
        st = None
    except OSError as e:  # a symlink loop, a file used as a directory, no permission to look
        raise WriteError(f"cannot write {path} ({e.strerror or e}): choose another location") from None
    if st is not None and (stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
        return path, True
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise WriteError(f"{path} is a directory: give a file path such as {path / 'out.json'}")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise WriteError(f"{path} is {special_kind(st.st_mode)}, not a regular file: an output written there would "
                         "replace it; give a regular file's path")
    if _names_a_descriptor(path):  # /dev/stdout redirected to a file: write into the descriptor, as asked
        if st is None:  # /proc/nope/x: no descriptor there to write into, and /proc takes no new file
            raise WriteError(f"cannot write {printable(str(path))}: nothing under /proc is there to write into; "
                             "choose another location")
        return path, True
    if st is not None and read_only(path, st):  # a rename would replace it all the same: ask first
        raise WriteError(f"{printable(str(path))} is read-only: make it writable (chmod u+w) or choose another path")
    return Path(os.path.realpath(path)), False


def printable(text: str) -> str:
    """`text` safe to print, encode as UTF-8 or put in a page: the bytes of a file name that are not UTF-8 (which
    Python holds as lone surrogates, PEP 383) shown as \\xNN, any other lone surrogate (from JSON's \\udXXX) as
    \\udXXX; valid text is returned unchanged. Every message and page that names a path goes through it, so a name
    that is not UTF-8 is shown, not a UnicodeEncodeError traceback."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate outside U+DC80-U+DCFF: not a file name's byte
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
"""C0 and C1 control characters and DEL: never printed raw from a file or a name."""


def shown(text: str) -> str:
    """`text` as one printable line: `printable`, then every control character as \\xNN, so a newline in a file's
    name or a header's words cannot forge or split a line, nor an ESC sequence reach the terminal."""
    return CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", printable(text))


def special_kind(mode: int) -> str:
    """What a file that is neither regular nor a directory is, in words ('a FIFO (named pipe)'), from its st_mode."""
    return ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
            else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "a special file")


def _names_a_descriptor(path: Path) -> bool:
    """Whether `path` reaches its file through /proc (/dev/stdout, /dev/fd/N, bash's <(...)): an open descriptor,
    whose file must be written into, not replaced (the shell holds the one it opened)."""
    return _through_proc(path)[0]


def _own_descriptor(path: Path) -> int | None:
    """The descriptor of this process that `path` names (/dev/stdout: 1), or None."""
    through, hop = _through_proc(path)
    prefix = f"/proc/{os.getpid()}/fd/"
    number = hop.removeprefix(prefix) if through and hop.startswith(prefix) else ""
    return int(number) if number.isdigit() else None


def _through_proc(path: Path) -> tuple[bool, str]:
    """Follow `path`'s symlinks one at a time: (True, the /proc path) if one hop is in /proc, else (False, '')."""
    hop = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on a symlink chain
        hop = os.path.join(os.path.realpath(os.path.dirname(hop)), os.path.basename(hop))
        if hop.startswith("/proc/"):
            return True, hop
        if not os.path.islink(hop):
            return False, ""
        hop = os.path.join(os.path.dirname(hop), os.readlink(hop))
    return False, ""


def check_output_dir(path: str | Path, flag: str = "--out") -> None:
    """Refuse, in one line naming `flag`, a directory output that cannot be one: a name longer than the file system
    allows, or something other than a directory already at the path (a file, a device, a FIFO)."""
    path = Path(path)
    check_name_lengths(path, f"{flag} {path}")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise WriteError(f"{flag} {path}: cannot use it ({e.strerror or e}): choose another directory") from None
    if not stat.S_ISDIR(st.st_mode):
        raise WriteError(f"{flag} {path} exists and is not a directory: give a directory (new or a run's)")


def check_name_lengths(path: Path, said: str) -> None:
    """ENAMETOOLONG as one line before any system call meets it: a component longer than NAME_MAX bytes."""
    too_long = [part for part in path.parts if len(os.fsencode(part)) > NAME_MAX]
    if too_long:
        raise WriteError(f"{said}: a name of {len(os.fsencode(too_long[0]))} bytes ({too_long[0][:20]}...) is longer "
                         f"than the {NAME_MAX} a file name may have: choose a shorter name")


NAME_MAX = 255
"""the longest file name (one path component), in bytes, that Linux's file systems accept."""


def read_only(path: Path, st: os.stat_result) -> bool:
    """Whether the file at `path` (its stat `st`) is read-only to this process, or to everyone by its mode (0444):
    root may write anything, yet a file its owner made read-only is one they meant to keep."""
    return not os.access(path, os.W_OK) or not st.st_mode & 0o222


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Write `path` through `write(tmp_path)` into a temp file in the same directory, fsync, rename: a reader sees the
    old file or the new one, never a half-written one. Only a regular file (or nothing) is replaced: a symlink is
    followed, a character device or FIFO (/dev/null, /dev/stdout, a pipe) is written into directly, anything else is
    refused (`output_target`). An output the user named; a file of a directory phantomclip owns (a run's, a
    report's) is written by owned.write_owned instead, which follows no link. An OSError becomes one WriteError line
    naming `path`."""
    target, direct = output_target(path)
    tmp = None
    try:
        if direct:  # the stream may be this process's own stdout: what it printed goes first
            sys.stdout.flush()
            write(str(target))
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TEMP_SUFFIX, dir=target.parent)
        os.close(fd)
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, _new_file_mode(target))  # mkstemp creates 0600
        os.replace(tmp, target)
    except OSError as e:
        raise write_error(path, e) from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            Path(tmp).unlink(missing_ok=True)


def _new_file_mode(target: Path) -> int:
    """The permissions of the file `target` replaces, or the usual ones (0666 less the umask) for a new file."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def check_output_path(path: str | Path, flag: str = "--json") -> None:
    """Fail before a long run, not after it, when `path` cannot be written (output_target's refusals, or no writable
    directory to create it in)."""
    try:
        target, direct = output_target(path)
    except WriteError as e:
        raise ConfigError(f"{flag} {e}") from None
    if direct:
        return
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK) or not _can_create_in(parent):
        raise ConfigError(f"{flag} {path}: cannot write under {parent}: choose a writable location")


def _can_create_in(directory: Path) -> bool:
    """Whether a file can really be made in `directory`: os.access says yes to root everywhere, /proc included,
    where the write then fails after the run's work; a probe file made and removed at once says what will happen."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".phantomclip-probe-"):
            return True
    except OSError:
        return False


def check_distinct_outputs(outputs: dict[str, str | Path]) -> None:
    """Refuse (ConfigError) two outputs of one run that name the same file, before any work: the second written
    would replace the first (`--save-rollouts x --json x` left the JSON and lost the rollouts). The same file is the
    same resolved path (links and /dev/stdout followed) or the same inode (a hard link); /dev/null takes any number."""
    seen: dict[tuple, str] = {}
    for flag, path in outputs.items():
        real = os.path.realpath(path)
        if real == os.devnull:
            continue
        try:
            st = os.stat(real)
            keys = [("path", real), ("inode", st.st_dev, st.st_ino)]
        except OSError:  # not there yet: its path is all there is
            keys = [("path", real)]
        for key in keys:
            if key in seen:
                raise ConfigError(f"{flag} {printable(str(path))} and {seen[key]} name the same file: the one written "
                                  f"last would replace the other; give {flag} another path")
        for key in keys:
            seen[key] = f"{flag} {printable(str(path))}"


OWN_OUTPUT = re.compile(rb'\A\s*\{\s*"(?:schema|phantomclip_rollouts)"\s*:')
"""how a file phantomclip wrote begins: a result JSON's first key is its "schema" (diagnose, trace, compare), a
rollout file's header's first key "phantomclip_rollouts"."""


def check_replaceable(path: str | Path, flag: str) -> bool:
    """Refuse (ConfigError), before any work, an output path where a non-empty regular file is that phantomclip did
    not write (OWN_OUTPUT): a user's file is never replaced unless they remove it; a run's earlier output is. Returns
    whether writing `path` replaces a file (replaces_a_file), for the line that says it was written."""
    if not replaces_a_file(path):
        return False
    target, _ = output_target(path)
    with open(target, "rb") as f:
        head = f.read(256)
    if head and not OWN_OUTPUT.match(head):
        raise ConfigError(f"{flag} {printable(str(path))}: a file phantomclip did not write is there and is never "
                          "replaced: remove it first or choose another path")
    return True


def replaces_a_file(path: str | Path) -> bool:
    """Whether writing the output `path` replaces a regular file already there (a stream such as /dev/stdout is
    written into, a new path creates one): what the line saying it was written adds."""
    try:
        target, direct = output_target(path)
    except WriteError:
        return False
    return not direct and target.is_file()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """`data` into `path`, atomically (atomic_write); into the descriptor itself when `path` names one of this
    process's (/dev/stdout), after what it printed: reopening it would write at another offset."""
    fd = _own_descriptor(Path(path))
    if fd is None:
        atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))
        return
    try:
        sys.stdout.flush()
        with os.fdopen(os.dup(fd), "wb") as f:
            f.write(data)
    except OSError as e:
        raise write_error(Path(path), e) from None


def atomic_write_chunks(path: Path, chunks: Iterable[str]) -> None:
    """The text `chunks` (consumed once, as they come) into `path` as UTF-8, as atomic_write_bytes writes bytes:
    atomically, or into this process's own descriptor after what it printed."""

    def write(f) -> None:
        for chunk in chunks:
            f.write(chunk)

    fd = _own_descriptor(Path(path))
    if fd is None:
        atomic_write(path, lambda tmp: _write_text(tmp, write))
        return
    try:
        sys.stdout.flush()
        with os.fdopen(os.dup(fd), "w", encoding="utf-8", newline="") as f:
            write(f)
    except OSError as e:
        raise write_error(Path(path), e) from None


def _write_text(path: str, write: Callable) -> None:
    """`write(f)` into a new text file at `path` (UTF-8, newlines as given)."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        write(f)


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


JSON_ERRORS = (ValueError, RecursionError)
"""what json.loads raises on text it cannot read: JSONDecodeError (a ValueError), int()'s digit limit on a number of
thousands of digits (a ValueError), and a RecursionError for nesting past the interpreter's stack."""


def json_reason(e: Exception) -> str:
    """Why json.loads refused a text, in a few words: Python's own limits said as what they mean in the file, else
    the decoder's first line."""
    if isinstance(e, RecursionError):
        return "nested too deep to read"
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if "integer string conversion" in text:
        return f"holds an integer of more than {sys.get_int_max_str_digits()} digits"
    return text[:80]


def write_json(result: dict, path: str | Path) -> None:
    """Write `result` to `path` as strict JSON (NaN/inf -> null), atomically (temp file, fsync, rename). The text is
    written as the encoder makes it, never held whole: a diagnose result's per-token arrays are most of it (277
    characters a token with the default recipes), and as one string and then its bytes they cost about 0.55 KB a token
    on top of the lists themselves (bench/RESULTS.md section 13). The bytes are json.dumps(json_safe(result),
    indent=1, allow_nan=False)'s."""
    encoder = json.JSONEncoder(indent=1, allow_nan=False)
    atomic_write_chunks(Path(path), encoder.iterencode(json_safe(result)))


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


