"""Hostile paths, by kind of path rather than by instance: every output (--json of
diagnose, trace and engines; --out of train and experiment) over every kind of thing already at its path, and every
kind of prompts file. An output replaces only a regular file or nothing; a symlink is followed (the link stays); a
character device or FIFO is written into (it is what the user named: /dev/null, /dev/stdout, a pipe); a directory,
block device, socket or too long a name is refused in one line, before any work, and left as it was.

FIFOs are made with os.mkfifo and device nodes with os.mknod inside the test's temp dir only (mknod needs root)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import bad_cli, over
from phantomclip.base.files import atomic_write_bytes, output_target
from phantomclip.cli.main import main
from phantomclip.models.prompts import PromptError, read_prompts

TINY = ["--model", "tiny-random"]
ENGINES = ["engines", *TINY, "--n", "2", "--max-tokens", "4", "--repeats", "1", "--engines", "local",
           "--dtypes", "fp32"]
JSON_COMMANDS = {  # every command with --json, as cheap as it runs
    "diagnose": ["diagnose", *TINY, "--n", "2", "--max-tokens", "4", "--trainer", "fp32"],
    "trace": ["trace", *TINY, "--n", "2", "--max-tokens", "4", "--no-what-if"],
    "engines": ENGINES,
}
OUT_COMMANDS = {  # every command with a directory --out
    "train": ["train", *TINY, "--steps", "1", "--group-size", "2", "--max-tokens", "4"],
    "experiment": ["experiment", "sanity", *TINY, "--only", "none", "--seeds", "1", "--steps", "1",
                   "--group-size", "2", "--max-tokens", "4"],
}
LONG = "n" * 300
"""a file name past NAME_MAX (255 bytes): ENAMETOOLONG was a traceback."""
root = pytest.mark.skipif(os.geteuid() != 0, reason="os.mknod needs root")


def _no_model_work(monkeypatch):
    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad path was refused")

    monkeypatch.setattr("phantomclip.models.load.check_vocab", loaded)


def _kind(path: Path) -> str:
    mode = os.lstat(path).st_mode
    return ("link" if stat.S_ISLNK(mode) else "fifo" if stat.S_ISFIFO(mode) else "char" if stat.S_ISCHR(mode)
            else "block" if stat.S_ISBLK(mode) else "socket" if stat.S_ISSOCK(mode) else "dir" if stat.S_ISDIR(mode)
            else "file")


def _make(kind: str, path: Path) -> object:
    """A thing of `kind` at `path`; returns what must stay open for it to exist (a bound socket)."""
    if kind == "dir":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "block":
        os.mknod(path, stat.S_IFBLK | 0o600, os.makedev(7, 0))  # a loop device's number: never opened here
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        return s
    return None


# ------------------------------------------------------------------------------------ refused before any work

@pytest.mark.parametrize("kind", ["dir", "long", "block", "socket"])
@pytest.mark.parametrize("command", list(JSON_COMMANDS))
def test_json_over_what_it_would_replace_is_refused_before_work(command, kind, tmp_path, capsys, monkeypatch):
    if kind == "block" and os.geteuid() != 0:
        pytest.skip("os.mknod needs root")
    _no_model_work(monkeypatch)
    target = tmp_path / (LONG if kind == "long" else "out")
    keep = _make(kind, target) if kind != "long" else None
    line = bad_cli([*JSON_COMMANDS[command], "--json", str(target)], capsys)
    want = {"dir": "is a directory: give a file path such as", "long": "a name of 300 bytes",
            "block": "is a block device, not a regular file", "socket": "is a socket, not a regular file"}[kind]
    assert line.startswith(f"phantomclip {command}: error: --json ") and want in line, line
    assert kind == "long" and LONG not in os.listdir(tmp_path) or _kind(target) == kind
    del keep


@pytest.mark.parametrize("kind", ["file", "fifo", "long", "block"])
@pytest.mark.parametrize("command", list(OUT_COMMANDS))
def test_out_that_cannot_be_a_directory_is_refused_before_work(command, kind, tmp_path, capsys, monkeypatch):
    if kind == "block" and os.geteuid() != 0:
        pytest.skip("os.mknod needs root")
    _no_model_work(monkeypatch)
    target = tmp_path / (LONG if kind == "long" else "out")
    if kind == "file":
        target.write_text("mine\n")
    elif kind != "long":
        _make(kind, target)
    line = bad_cli([*OUT_COMMANDS[command], "--out", str(target)], capsys)
    want = "a name of 300 bytes" if kind == "long" else "exists and is not a directory"
    assert f"--out {target}" in line and want in line, line
    assert kind == "long" and LONG not in os.listdir(tmp_path) or _kind(target) == kind
    assert kind != "file" or target.read_text() == "mine\n"


# ------------------------------------------------------------------------------------ what is written, and how

def test_atomic_write_by_kind_of_target(tmp_path):
    """The writer every output goes through: a regular file replaced (permissions kept), a symlink's target
    replaced and the link kept, a dangling symlink's target created, a FIFO written into, a directory refused."""
    regular = tmp_path / "regular.json"
    regular.write_text("old")
    regular.chmod(0o640)
    atomic_write_bytes(regular, b"new")
    assert regular.read_bytes() == b"new" and stat.S_IMODE(regular.stat().st_mode) == 0o640

    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target)
    atomic_write_bytes(link, b"through the link")
    assert link.is_symlink() and target.read_bytes() == b"through the link"

    dangling, missing = tmp_path / "dangling.json", tmp_path / "sub" / "created.json"
    dangling.symlink_to(missing)
    atomic_write_bytes(dangling, b"created")
    assert dangling.is_symlink() and missing.read_bytes() == b"created"

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    atomic_write_bytes(fifo, b"through the pipe")
    reader.join(10)
    assert got == [b"through the pipe"] and _kind(fifo) == "fifo"
    assert output_target(fifo) == (fifo, True) and output_target(Path("/dev/stdout"))[1] is True

    from phantomclip.base.errors import WriteError

    with pytest.raises(WriteError, match="is a directory"):
        atomic_write_bytes(tmp_path, b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.json", "fifo", "link.json", "regular.json", "sub",
                                                         "target.json"]  # no temp file left behind


@root
def test_write_json_streams_json_dumps_bytes_and_a_failed_encode_leaves_the_old_file(tmp_path):
    """--json is written as the encoder makes it (never held whole): the bytes are exactly json.dumps's of the
    json_safe result (NaN and inf as null, non-ASCII escaped, indent 1), and an object the encoder refuses midway
    leaves the old file and no temp file (the text is streamed into the temp file, renamed only when whole)."""
    import math

    from phantomclip.base.files import json_safe, write_json

    result = {"β": {"beta": [i / 7 for i in range(5000)] + [math.nan, -math.inf], "t": (1, "ü")}, "n": None}
    target = tmp_path / "out.json"
    write_json(result, target)
    assert target.read_bytes() == json.dumps(json_safe(result), indent=1, allow_nan=False).encode("utf-8")
    assert json.loads(target.read_text())["β"]["beta"][-2:] == [None, None]
    with pytest.raises(TypeError):
        write_json({"a": list(range(5000)), "z": object()}, target)  # refused after the list is written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    assert json.loads(target.read_text())["n"] is None


def test_json_into_device_nodes_writes_into_them_or_says_why(tmp_path, capsys):
    """A copy of /dev/null takes the JSON and stays a device; a copy of /dev/full is one line (no space), exit 2,
    and stays a device (it was replaced by a 431-byte file, exit 0)."""
    null, full = tmp_path / "null", tmp_path / "full"
    os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mknod(full, stat.S_IFCHR | 0o666, os.makedev(1, 7))
    assert main([*ENGINES, "--json", str(null)]) == 0
    capsys.readouterr()
    line = bad_cli([*ENGINES, "--json", str(full)], capsys, after_progress=True)
    assert f"cannot write {full} (No space left on device)" in line
    assert _kind(null) == "char" and _kind(full) == "char"


def test_json_through_symlink_fifo_and_regular_file(tmp_path, capsys):
    """The engines job (the cheapest with --json) over a regular file, a symlink and a FIFO: the same JSON each time,
    the link still a link, the FIFO still a FIFO. The files there are earlier outputs (a schema first: replaced; a
    user's file would be refused, tests/test_bad_input_5.py)."""
    regular, target, link, fifo = (tmp_path / n for n in ("regular.json", "target.json", "link.json", "fifo"))
    regular.write_text('{"schema": 1, "rows": []}')
    target.write_text('{"schema": 1, "rows": []}')
    link.symlink_to(target)
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    for path in (regular, link, fifo):
        assert main([*ENGINES, "--json", str(path)]) == 0
    reader.join(10)
    rows = [json.loads(regular.read_text()), json.loads(target.read_text()), json.loads(got[0])]
    assert all(r["config"]["engines"] == ["local"] and len(r["rows"]) == 1 for r in rows)
    assert link.is_symlink() and _kind(fifo) == "fifo"


def test_json_to_dev_stdout_and_a_full_stdout(tmp_path):
    """In a real process: `--json /dev/stdout > file` keeps the table and the JSON (the file is written through
    the shell's descriptor, not replaced); `> /dev/full` is one line on stderr, exit 2, no 'Exception ignored'."""
    cmd = [sys.executable, "-m", "phantomclip.cli.main", *ENGINES]
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        done = subprocess.run([*cmd, "--json", "/dev/stdout"], stdout=f, stderr=subprocess.PIPE, text=True,
                              timeout=300)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert "tokens/s" in text and '"rows"' in text and text.index("tokens/s") < text.index('"rows"')
    with open("/dev/full", "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.PIPE, text=True, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.startswith("phantomclip")]
    assert done.returncode == 2, done.stderr
    assert lines == [lines[-1]] and "cannot write or read stdout (No space left on device)" in lines[-1]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


# ------------------------------------------------------------------------------------ prompts files by kind

@pytest.mark.parametrize("kind", ["missing", "dir", "fifo", "devnull", "surrogate", "surrogate-text"])
def test_a_prompts_file_by_kind(kind, tmp_path, capsys, monkeypatch):
    """Each kind of --prompts that is no prompts file is named for what it is (a FIFO or /dev/null said 'does not
    exist'); a JSON escape of a lone surrogate is one line naming the line (a tokenizer TypeError before)."""
    _no_model_work(monkeypatch)
    path = {"devnull": Path("/dev/null")}.get(kind, tmp_path / "p.txt")
    if kind == "dir":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "surrogate":
        path.write_text('{"prompt": "fine"}\n{"prompt": "bad \\ud800 half"}\n')
    elif kind == "surrogate-text":  # plain text cannot hold one: its UTF-8 form is not UTF-8
        path.write_bytes(b"fine\n\xed\xa0\x80\n")
    want = {"missing": "does not exist", "dir": "is a directory", "fifo": "is a FIFO (named pipe), not a regular file",
            "devnull": "is a character device, not a regular file",
            "surrogate": "non-empty line 2: holds '\\ud800', a lone UTF-16 surrogate",
            "surrogate-text": "is not UTF-8 text"}[kind]
    for argv in (["diagnose", *TINY, "--n", "2"], ["train", *TINY, "--steps", "1"]):
        assert want in bad_cli([*argv, "--prompts", str(path)], capsys)


def test_only_the_prompts_used_are_read(tmp_path, capsys):
    """diagnose --n 2 reads two prompts of a file however long (500,000 lines was killed after 90 s): a damaged line
    past them is never reached; the whole file still is, and refused, where all of it is used."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one"}\n\n{"prompt": "two"}\n' + '{"prompt": "more"}\n' * 1000 + "not json\n")
    assert read_prompts(path, limit=2) == ["one", "two"]
    with pytest.raises(PromptError, match="non-empty line 1003: not valid JSON"):
        read_prompts(path)
    assert main(["diagnose", *TINY, "--n", "2", "--max-tokens", "4", "--trainer", "fp32", "--prompts", str(path),
                 "--no-batch-invariance"]) == 0
    capsys.readouterr()


def test_train_tokenizes_only_the_prompts_its_steps_draw(tmp_path, capsys, monkeypatch):
    """train draws its prompts from the seed before it starts (producer.drawn_prompts): only those are tokenized and
    checked against the context, and they are the ones the steps sample; a prompt past the context where no step
    draws is never encoded (every line of a 500,000-line file was)."""
    import phantomclip.models.prompts
    from phantomclip.training.producer import drawn_prompts

    lines = [f"prompt {i}" for i in range(5000)]
    drawn = [drawn_prompts(0, k, 1, len(lines))[0] for k in range(2)]
    far = next(i for i in range(len(lines)) if i not in drawn)
    lines[far] = "ab " * 700  # past tiny-random's 512 positions
    path, out = tmp_path / "p.txt", tmp_path / "run"
    path.write_text("\n".join(lines) + "\n")
    encoded, encode = [], phantomclip.models.prompts.encode_prompts
    monkeypatch.setattr(phantomclip.models.prompts, "encode_prompts",
                        lambda tok, ps: encoded.extend(ps) or encode(tok, ps))
    assert main(["train", *TINY, "--steps", "2", "--group-size", "2", "--max-tokens", "4", "--prompts", str(path),
                 "--out", str(out)]) == 0
    capsys.readouterr()
    assert sorted(encoded) == sorted({lines[i] for i in drawn})
    sampled = [json.loads(x)["samples"][0]["prompt"] for x in (out / "samples.jsonl").read_text().splitlines()]
    assert sampled == [lines[i] for i in drawn]


# ------------------------------------------------------------------------------------ files that are not ours

def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file\n")
    return victim


@pytest.mark.parametrize("name,kind", [(".lock", "link"), (".lock", "fifo"), ("metrics.jsonl", "link"),
                                       ("checkpoint.pt", "link"), ("summary.json", "link"), ("index.html", "link"),
                                       ("data", "link")])
def test_no_output_goes_through_a_link_or_into_a_special_file_we_did_not_make(name, kind, tmp_path, capsys):
    """A file of a directory phantomclip writes (a run's lock, metrics and checkpoint, an experiment's summary, a
    report's page and data copies) that is a link to another file, or a FIFO, is refused in one line: the other file
    keeps its content (a lock through a link wrote a pid into it) and no open hangs. For a resumed run the link
    points at the run's own file moved away, so the run reads it as its own and only the write is refused."""
    victim = _victim(tmp_path)
    out = tmp_path / "out"
    if name == "summary.json":
        command = [*OUT_COMMANDS["experiment"], "--out", str(out)]
    elif name in ("index.html", "data"):
        command = ["report", "--out", str(out)]
    else:
        command = [*OUT_COMMANDS["train"], "--checkpoint-every", "1", "--out", str(out)]
    if name in ("metrics.jsonl", "checkpoint.pt"):  # a run to resume, whose file is then moved and linked
        assert main(command) == 0
        (out / name).rename(victim)
        command = over(command, "--resume", "--steps", "2")
    before = victim.read_bytes()
    out.mkdir(exist_ok=True)
    if name == "data":  # a report's data copy, linked by someone between two builds
        assert main(command) == 0  # the first build: its copies' names (their numbering depends on the demo's size)
        first = sorted((out / "data").iterdir())[0]
        first.unlink()
        first.symlink_to(victim)
    elif kind == "fifo":
        os.mkfifo(out / name)
    else:
        (out / name).symlink_to(victim)
    capsys.readouterr()
    line = bad_cli(command, capsys, after_progress=True)  # the report says first that it draws the demo
    assert "is a symbolic link" in line or "is a FIFO" in line, line
    assert victim.read_bytes() == before


def test_only_our_own_temp_files_are_removed_from_an_existing_out(tmp_path, capsys):
    """train --out into an existing directory removes the temp files a killed phantomclip stranded there (named
    .<one of its files>.<8 random characters>.tmp) and nothing else: a user's .notes.tmp, a name that only looks
    like ours, a link named like ours."""
    out = tmp_path / "out"
    out.mkdir()
    theirs = [".notes.tmp", ".config.json.tmp", ".metrics.jsonl.abcdefghi.tmp", ".other.abcdefgh.tmp"]
    for name in theirs:
        (out / name).write_text("keep me\n")
    (out / ".samples.jsonl.abcdefgh.tmp").symlink_to(_victim(tmp_path))
    (out / ".metrics.jsonl.k2_x9q0z.tmp").write_text("stranded\n")  # ours: mkstemp's name beside metrics.jsonl
    assert main([*OUT_COMMANDS["train"], "--out", str(out)]) == 0
    assert all((out / name).read_text() == "keep me\n" for name in theirs)
    assert (out / ".samples.jsonl.abcdefgh.tmp").is_symlink()
    assert not (out / ".metrics.jsonl.k2_x9q0z.tmp").exists()


@pytest.mark.parametrize("command", list(JSON_COMMANDS))
def test_a_read_only_json_target_is_refused_before_work(command, tmp_path, capsys, monkeypatch):
    """--json onto a file made read-only (0444) is refused in one line before any work, the file unchanged: the
    rename of a temp file replaced it, as root too."""
    _no_model_work(monkeypatch)
    target = tmp_path / "kept.json"
    target.write_text("{}\n")
    target.chmod(0o444)
    line = bad_cli([*JSON_COMMANDS[command], "--json", str(target)], capsys)
    assert f"--json {target} is read-only: make it writable" in line, line
    assert target.read_text() == "{}\n" and stat.S_IMODE(target.stat().st_mode) == 0o444


# ------------------------------------------------------------------------------------ inputs that never end

@pytest.fixture(scope="module")
def snapshot_run(tmp_path_factory):
    """A 1-step tiny run with its snapshots (step 0 and 1, each with its tokens), made once for the input tests."""
    out = tmp_path_factory.mktemp("inputs") / "run"
    assert main([*OUT_COMMANDS["train"], "--keep-snapshots", "1", "--out", str(out)]) == 0
    return out


@pytest.fixture
def deadline():
    """Fail, rather than hang the suite, when a command blocks on what it opened (a FIFO had no writer)."""
    import signal

    def late(signum, frame):
        raise AssertionError("the command blocked on an input for 60 s")

    old = signal.signal(signal.SIGALRM, late)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _special(kind: str, path: Path) -> None:
    """A FIFO at `path`, or a link to an endless character device (/dev/zero)."""
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")


@pytest.mark.parametrize("kind", ["fifo", "zero"])
@pytest.mark.parametrize("name,command", [
    ("config.json", "resume"), ("metrics.jsonl", "resume"), ("config.json", "report"), ("metrics.jsonl", "report"),
    ("config.json", "trace"), ("snapshots/step-000001.tokens.json", "trace"),
    ("snapshots/step-000001.safetensors", "trace"),
])
def test_a_run_file_that_never_ends_is_one_line(name, command, kind, snapshot_run, tmp_path, capsys, deadline):
    """A FIFO or /dev/zero in place of a run file, for every command that reads run files (resume, report --from,
    trace --run): one line naming the file, at once (a FIFO blocked each for ever, /dev/zero was a MemoryError)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(snapshot_run, run)
    _special(kind, run / name)
    args = {"resume": over(OUT_COMMANDS["train"], "--out", str(run), "--resume", "--steps", "2"),
            "report": ["report", "--from", str(run), "--out", str(tmp_path / "r")],
            "trace": ["trace", "--run", str(run)]}[command]
    what = "is a FIFO (named pipe), not a regular file" if kind == "fifo" else "is a character device, not a regular"
    if kind == "zero" and command == "resume":  # a run's own files are read beneath it: the link itself is refused
        what = "is a symbolic link: phantomclip reads no link inside a directory it reads"
    if command == "report" and name == "config.json":  # a file found in a --from directory: skipped, named
        assert main(args) == 2
        line = capsys.readouterr().err
        assert "warning: " in line and "Traceback" not in line, line
    else:
        line = bad_cli(args, capsys, after_progress=True)
    assert name.split("/")[-1] in line and what in line, line


@pytest.mark.parametrize("kind", ["fifo", "zero"])
@pytest.mark.parametrize("flag", ["--from-trl-config", "--from-verl-config"])
def test_a_config_that_never_ends_is_one_line(flag, kind, tmp_path, capsys, deadline, monkeypatch):
    _no_model_work(monkeypatch)
    path = tmp_path / "grpo.yaml"
    _special(kind, path)
    line = bad_cli(["diagnose", *TINY, flag, str(path)], capsys)
    assert f"{flag} {path}: is a " in line and "not a regular file" in line, line


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_report_and_experiment_inputs_that_never_end(kind, tmp_path, capsys, deadline):
    """report --from names a FIFO or device: one line; one found in a --from directory: skipped with the warning
    that names it; an experiment's experiment.json: one line."""
    from phantomclip.report import demo_sources

    special = tmp_path / "special.json"
    _special(kind, special)
    line = bad_cli(["report", "--from", str(special), "--out", str(tmp_path / "r")], capsys)
    assert "special.json: is a " in line and "not a regular file" in line, line
    found = tmp_path / "dir"
    found.mkdir()
    (found / "diagnose.json").write_bytes((demo_sources()[0] / "diagnose.json").read_bytes())
    _special(kind, found / "special.json")
    assert main(["report", "--from", str(found), "--out", str(tmp_path / "r")]) == 0
    assert "skipped 1 file that phantomclip cannot use: special.json is a " in capsys.readouterr().err
    exp = tmp_path / "exp"
    exp.mkdir()
    _special(kind, exp / "experiment.json")
    line = bad_cli([*OUT_COMMANDS["experiment"], "--out", str(exp)], capsys)
    assert "experiment.json: is a " in line and "not a regular file" in line, line


def test_a_full_disk_at_the_lock_and_an_unreadable_checkpoint_are_named(tmp_path, capsys, monkeypatch):
    """A full disk met first at the lock file was 'cannot write or read stdout'; a checkpoint with no read permission
    (chmod 000; root reads it anyway, so the refusal is simulated) was called damaged, with the advice to remove it."""
    import errno

    import torch

    out = tmp_path / "run"
    real_pwrite = os.pwrite

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    line = bad_cli([*OUT_COMMANDS["train"], "--out", str(out)], capsys)
    assert f"cannot write {out / '.lock'} (No space left on device)" in line, line
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    assert main([*OUT_COMMANDS["train"], "--out", str(out)]) == 0
    capsys.readouterr()

    def denied(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(torch, "load", denied)
    line = bad_cli(over(OUT_COMMANDS["train"], "--out", str(out), "--resume", "--steps", "2"), capsys)
    assert "checkpoint.pt cannot be read (Permission denied): give yourself read access" in line, line
    assert "damaged" not in line and "remove it" not in line
