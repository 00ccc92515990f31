"""The files of a directory phantomclip owns (a run's, an experiment's, a report's) and the one way to open them:
beneath that directory, one component at a time, never through a link.

The root is the directory the user named (`--out DIR`), followed as given, a link included: naming it is asking for
it. Everything below it is phantomclip's own layout, so a link there (`snapshots -> elsewhere`, `data -> ~`, an
experiment's `none -> /etc`) or a file with a second hard link (a `.lock` linked to a user's file) was put there by
another hand, and writing through it would change a file phantomclip did not make. Every open below the root walks
the path with openat (`dir_fd`), O_NOFOLLOW at every component and O_DIRECTORY for each directory, so a link at any
depth is refused, not only the last; a file is opened without blocking (a FIFO cannot hang it) and must be a regular
file; one written in place (appended, locked) must have a single link. Writes go to a temp file in the same
directory (created O_EXCL), fsynced, renamed over the target through the directory's descriptor.

Readers of a directory a user hands in (a run to report on, a directory of rollouts) use `read_owned`: the same walk,
the same checks as files.read_input, so a link inside the directory cannot point the reader at another file.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from .errors import WriteError
from .files import (
    TEMP_SUFFIX,
    InputError,
    check_name_lengths,
    input_text_fd,
    json_safe,
    printable,
    special_kind,
    write_error,
)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def parts_below(root: str | Path, path: str | Path) -> tuple[str, ...]:
    """The components of `path` below `root` (lexically: `path` is built as root / ...); () for the root itself.
    ValueError for a path outside the root or one that climbs out of it with '..' (a caller's mistake)."""
    parts = Path(path).relative_to(Path(root)).parts
    if ".." in parts:
        raise ValueError(f"{path} climbs out of {root}")
    return parts


def _link_refusal(where: Path, dir_fd: int, name: str, what: str, e: OSError) -> WriteError:
    """The one line for a component that could not be opened as `what`: a link, something else, or the system's
    reason."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except OSError:
        st = None
    shown = printable(str(where))
    if st is not None and stat.S_ISLNK(st.st_mode):
        return WriteError(f"{shown} is a symbolic link, where phantomclip keeps {what} of its own: it writes and reads "
                          "through no link it did not make; remove the link")
    if st is not None and e.errno in (errno.ENOTDIR, errno.ELOOP):
        kind = "a file" if stat.S_ISREG(st.st_mode) else special_kind(st.st_mode)
        return WriteError(f"{shown} is {kind}, where phantomclip keeps {what}: remove it")
    return write_error(where, e)


def open_dir(root: str | Path, path: str | Path, create: bool = False) -> int:
    """A descriptor on the directory `path` (the root or one beneath it), reached from the root one component at a
    time without following a link (`create`: missing directories are made, the root with its parents as the user
    named it). WriteError, one line naming the component, for a link or a non-directory on the way. The caller
    closes it."""
    root, parts = Path(root), parts_below(root, path)
    check_name_lengths(Path(path), str(path))
    try:
        if create:
            root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root, _DIR_FLAGS)
    except OSError as e:
        raise write_error(root, e) from None
    for i, part in enumerate(parts):
        try:
            try:
                child = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, 0o777, dir_fd=fd)
                except FileExistsError:  # another writer made it meanwhile: open it the same way
                    pass
                child = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
        except OSError as e:
            refusal = _link_refusal(root.joinpath(*parts[: i + 1]), fd, part, "a directory", e)
            os.close(fd)
            raise refusal from None
        os.close(fd)
        fd = child
    return fd


def make_dirs(root: str | Path, path: str | Path) -> None:
    """Make the directory `path` beneath `root` (and those on the way) without following a link: an experiment's
    OUT/<arm>/seed-<s> before its run is trained there."""
    os.close(open_dir(root, path, create=True))


def check_no_links(root: str | Path, path: str | Path) -> None:
    """Refuse (WriteError, one line) a link or a non-directory among the components of `path` below `root` that
    exist; a missing one ends the check (open_dir makes it later, the same way). For a job that reads a directory
    before it writes there (an experiment's runs, all checked before the first is trained); every write still walks
    with open_dir."""
    here = Path(root)
    for part in parts_below(root, path):
        here = here / part
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            return
        except OSError as e:
            raise write_error(here, e) from None
        if stat.S_ISLNK(st.st_mode):
            raise WriteError(f"{printable(str(here))} is a symbolic link, where phantomclip keeps a directory of its "
                             "own: it writes and reads through no link it did not make; remove the link")
        if not stat.S_ISDIR(st.st_mode):
            kind = "a file" if stat.S_ISREG(st.st_mode) else special_kind(st.st_mode)
            raise WriteError(f"{printable(str(here))} is {kind}, where phantomclip keeps a directory: remove it")


def _parent(root: str | Path, path: str | Path, create: bool) -> tuple[int, str]:
    path = Path(path)
    if path == Path(root):
        raise ValueError(f"{path} is the owned directory itself, not a file in it")
    return open_dir(root, path.parent, create), path.name


def open_owned(root: str | Path, path: str | Path, flags: int, what: str = "") -> int:
    """A descriptor on the file `path` beneath `root`, opened with `flags` | O_CREAT, without following a link at any
    component and without blocking on a FIFO (O_NONBLOCK, cleared after the open): a regular file with one link (a
    second hard link would make an append or a lock write into another name's file). The way to append to, or
    lock, a file of a directory phantomclip owns. One WriteError line otherwise."""
    import fcntl

    shown, described = printable(str(path)), what or "a file of its own"
    dir_fd, name = _parent(root, path, create=True)
    try:
        try:
            fd = os.open(name, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
        except OSError as e:
            raise _link_refusal(Path(path), dir_fd, name, described, e) if e.errno == errno.ELOOP else write_error(
                Path(path), e) from None
    finally:
        os.close(dir_fd)
    st = os.fstat(fd)
    problem = (f"is {special_kind(st.st_mode)}" if not stat.S_ISREG(st.st_mode) else
               f"has {st.st_nlink} hard links (another name's file would change with it)" if st.st_nlink > 1 else "")
    if problem:
        os.close(fd)
        raise WriteError(f"{shown} {problem}, where phantomclip keeps {described}: remove it")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def _check_target(dir_fd: int, name: str, path: Path) -> int | None:
    """The permissions of the file a write will replace (None: none there yet); WriteError for a link, a special
    file, or a read-only file there."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise write_error(path, e) from None
    shown = printable(str(path))
    if stat.S_ISLNK(st.st_mode):
        raise WriteError(f"{shown} is a symbolic link, where phantomclip keeps a file of its own: it writes through no "
                         "link it did not make; remove the link")
    if not stat.S_ISREG(st.st_mode):
        raise WriteError(f"{shown} is {special_kind(st.st_mode)}, where phantomclip keeps a regular file of its own: "
                         "remove it")
    if not os.access(name, os.W_OK, dir_fd=dir_fd, follow_symlinks=False) or not st.st_mode & 0o222:
        raise WriteError(f"{shown} is read-only: make it writable (chmod u+w) or choose another --out")
    return stat.S_IMODE(st.st_mode)


def write_owned(root: str | Path, path: str | Path, write: Callable[[str], None]) -> None:
    """Write the file `path` beneath `root` through `write(tmp_path)`: into a temp file made (O_EXCL) in the same
    directory, reached without following a link (open_dir), fsynced, then renamed over `path` through the
    directory's descriptor, so a reader sees the old file or the new one and nothing outside the root changes. The
    target must be absent or a writable regular file (a link or special file there is refused); its permissions are
    kept. `write` gets the temp file's path through /proc/self/fd when there is one (the directory it names cannot be
    swapped meanwhile). One WriteError line for an OSError."""
    path = Path(path)
    dir_fd, name = _parent(root, path, create=True)
    tmp, fd = None, None
    try:
        mode = _check_target(dir_fd, name, path)
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        tmp = f".{name}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        through = f"/proc/self/fd/{dir_fd}"
        write(f"{through}/{tmp}" if os.path.isdir(through) else str(path.parent / tmp))
        os.close(fd)  # the writer may have replaced the file it was given (safetensors does): sync the one there now
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise WriteError(f"{printable(str(path))}: the temp file written for it is not a regular file")
        os.fsync(fd)
        os.fchmod(fd, mode)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        tmp = None
    except OSError as e:
        raise write_error(path, e) from None
    finally:
        if fd is not None:
            os.close(fd)
        if tmp is not None:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
        os.close(dir_fd)


def write_owned_bytes(root: str | Path, path: str | Path, data: bytes) -> None:
    """`data` into `path` beneath `root`, atomically (write_owned)."""
    write_owned(root, path, lambda tmp: Path(tmp).write_bytes(data))


def write_owned_json(root: str | Path, path: str | Path, doc: dict) -> None:
    """`doc` as strict JSON (NaN and inf as null) into `path` beneath `root`, atomically."""
    write_owned_bytes(root, path, json.dumps(json_safe(doc), indent=1, allow_nan=False).encode("utf-8"))


def remove_owned(root: str | Path, path: str | Path) -> None:
    """Remove a regular file phantomclip wrote beneath `root` (an experiment's finished checkpoint); a link or
    anything else there, or a link on the way, is left as it is."""
    try:
        dir_fd, name = _parent(root, path, create=False)
    except WriteError:
        return
    try:
        if stat.S_ISREG(os.lstat(name, dir_fd=dir_fd).st_mode):
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise write_error(Path(path), e) from None
    finally:
        os.close(dir_fd)


STRANDED = re.compile(r"\.(?P<name>.+)\.[a-z0-9_]{8}" + re.escape(TEMP_SUFFIX) + r"\Z")
"""the name of a temp file write_owned (or files.atomic_write, tempfile.mkstemp's 8 characters) makes beside `name`."""


def remove_stranded_temps(root: str | Path, directory: str | Path, names: Callable[[str], bool]) -> int:
    """Remove the temp files a killed write left in `directory` beneath `root` for a target whose name `names`
    accepts: regular files named as the writers name them, nothing else (a user's own `.notes.tmp` is not ours),
    and nothing at all when the directory is absent or reached through a link. Returns how many."""
    try:
        dir_fd = open_dir(root, directory)
    except WriteError:
        return 0
    removed = 0
    try:
        for entry in os.listdir(dir_fd):
            m = STRANDED.match(entry)
            if m and names(m["name"]) and stat.S_ISREG(os.lstat(entry, dir_fd=dir_fd).st_mode):
                os.unlink(entry, dir_fd=dir_fd)
                removed += 1
    except FileNotFoundError:
        pass
    finally:
        os.close(dir_fd)
    return removed


def open_reading(root: str | Path, path: str | Path) -> int:
    """A read-only descriptor on the regular file `path` beneath `root`, reached without following a link at any
    component and opened without blocking: for a reader that hands the file to a library (torch.load of a
    checkpoint, which may be larger than read_owned's limit). InputError, one line naming the file, otherwise. The
    caller closes it."""
    try:
        dir_fd, name = _parent(root, path, create=False)
    except WriteError as e:
        raise InputError(path, str(e).removeprefix(printable(str(path)) + " ")) from None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        reason = ("is a symbolic link: phantomclip reads no link inside a directory it reads; give the file itself"
                  if e.errno == errno.ELOOP else f"cannot be read ({e.strerror or e})")
        raise InputError(path, reason) from None
    finally:
        os.close(dir_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise InputError(path, f"is {special_kind(st.st_mode)}, not a regular file: phantomclip reads only the files "
                               "it writes there")
    return fd


def read_owned(root: str | Path, path: str | Path) -> str:
    """The UTF-8 text of the file `path` beneath `root`, reached without following a link at any component: a
    regular file of at most files.input_limit() bytes, opened without blocking. InputError, one line naming the
    file, otherwise (a link inside a run directory or a directory of rollouts is not followed to another file)."""
    return input_text_fd(path, open_reading(root, path))
