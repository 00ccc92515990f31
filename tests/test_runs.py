import json

import pytest
import torch

from phantomclip.base.errors import PhantomclipWarning, WriteError
from phantomclip.base.locks import LockError
from phantomclip.runs.checks import METRIC_KEYS
from phantomclip.runs.read import RunError, config_diff, read_jsonl
from phantomclip.runs.rundir import RunDir

RUN = {"versions": {"phantomclip": "test"}}
"""what makes a config.json a run's (runs.is_run_config): every test run's configuration holds it."""


def _row(step: int, **figures) -> dict:
    """A metrics row with every figure readers need (runs.checks.METRIC_KEYS, at 0) and `figures`."""
    return {**dict.fromkeys(METRIC_KEYS, 0.0), "step": step, **figures}


def test_create_log_checkpoint_resume(tmp_path):
    cfg = {**RUN, "seed": 1, "lr": 1e-5, "steps": 10}
    run = RunDir.create(tmp_path / "r", cfg)
    for step in range(1, 6):
        run.log_metrics(_row(step, loss=float(step)))
        if step == 3:
            run.save_checkpoint({"step": 3, "w": torch.ones(2) * 3})
    with open(run.metrics_path, "a") as f:
        f.write('{"step": 6, "lo')  # torn line from a SIGKILL
    with pytest.warns(PhantomclipWarning, match=r"metrics.jsonl: the last line \(6\) is incomplete"):
        assert [r["step"] for r in run.metrics()] == [1, 2, 3, 4, 5]
    with pytest.raises(RunError, match="already holds a run"):
        RunDir.create(tmp_path / "r", cfg)
    run.close()
    with pytest.warns(PhantomclipWarning):
        again, ckpt = RunDir.resume(tmp_path / "r", {**cfg, "steps": 20})  # more steps is allowed
    assert ckpt["step"] == 3 and torch.equal(ckpt["w"], torch.ones(2) * 3)
    assert [r["step"] for r in again.metrics()] == [1, 2, 3]  # steps after the checkpoint are dropped
    assert json.loads((tmp_path / "r" / "config.json").read_text()) == cfg


def test_resume_refuses_a_different_config(tmp_path):
    RunDir.create(tmp_path / "r", {**RUN, "seed": 1, "lr": 1e-5}).close()
    with pytest.raises(RunError, match="lr: 1e-05 -> 0.001"):
        RunDir.resume(tmp_path / "r", {**RUN, "seed": 1, "lr": 1e-3})
    with pytest.raises(RunError, match="no config.json"):
        RunDir.resume(tmp_path / "none", RUN)
    assert config_diff({"a": 1, "b": 2}, {"a": 1, "c": 3}) == ["b: 2 -> None", "c: None -> 3"]


def test_interrupted_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    run = RunDir.create(tmp_path / "r", RUN)
    run.save_checkpoint({"step": 1})

    from pathlib import Path

    real_write = Path.write_bytes

    def dying(self, data):  # the temp file gets a few bytes, then the process is interrupted
        real_write(self, data[:10])
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_bytes", dying)
    with pytest.raises(KeyboardInterrupt):
        run.save_checkpoint({"step": 2})
    monkeypatch.undo()
    assert torch.load(run.checkpoint_path)["step"] == 1
    assert sorted(p.name for p in run.path.iterdir()) == [".lock", "checkpoint.pt", "config.json"]
    assert read_jsonl(run.metrics_path) == []


# ---------------------------------------------------------------------------------------------- hostile input


def _finished_run(path, cfg=None):
    run = RunDir.create(path, cfg or {**RUN, "seed": 1})
    for step in (1, 2):
        run.log_metrics(_row(step, loss=float(step)))
    run.save_checkpoint({"step": 2, "w": torch.ones(2)})
    run.close()
    return run


def test_a_crafted_checkpoint_runs_nothing(tmp_path):
    """A pickle whose __reduce__ calls os.system must be refused unread: the marker file is never created."""
    import os
    import pickle

    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    run = _finished_run(tmp_path / "r")
    run.checkpoint_path.write_bytes(pickle.dumps({"step": 2, "payload": Evil()}))
    with pytest.raises(RunError, match="checkpoint.pt is not a checkpoint this tool can read safely"):
        RunDir.resume(run.path, {**RUN, "seed": 1})
    assert not marker.exists()
    torch.save({"step": 2, "payload": Evil()}, run.checkpoint_path)  # the same inside torch's zip container
    with pytest.raises(RunError, match="holds objects other than tensors"):
        RunDir.resume(run.path, {**RUN, "seed": 1})
    assert not marker.exists()
    for damaged in (b"", b"random bytes", run.checkpoint_path.read_bytes()[:100]):
        run.checkpoint_path.write_bytes(damaged)
        with pytest.raises(RunError, match="it is damaged"):
            RunDir.resume(run.path, {**RUN, "seed": 1})


def test_damaged_config_json_is_named(tmp_path):
    run = _finished_run(tmp_path / "r")
    cases = {"{not json": "is not readable JSON", "[1, 2]": "holds a JSON list, not an object",
             '{"schema": 99, "seed": 1}': "has schema 99", '{"schema": "99", "seed": 1}': "has schema '99'"}
    for text, message in cases.items():
        (run.path / "config.json").write_text(text)
        with pytest.raises(RunError, match=message):
            RunDir.resume(run.path, {**RUN, "seed": 1})


def test_json_past_pythons_limits_is_one_line_in_every_run_file(tmp_path):
    """A number of more digits than int() converts, or nesting past the interpreter's stack, is named with its file
    (and line) by the shared readers, whichever command reads it (resume, trace --run, report), not a ValueError or
    RecursionError traceback; nothing is rewritten."""
    big, deep = "1" * 5000, "[" * 100_000 + "]" * 100_000
    run = _finished_run(tmp_path / "r")
    rows = run.metrics_path.read_text()
    for line, message in ((f'{{"step": 1, "x": {big}}}', r"metrics.jsonl: a line is not valid JSON \(line 1 holds "
                           r"an integer of more than \d+ digits\)"),
                          (deep, r"metrics.jsonl: a line is nested too deep to read \(line 1\)")):
        run.metrics_path.write_text(line + "\n" + rows)
        with pytest.raises(RunError, match=message):
            read_jsonl(run.metrics_path)
        with pytest.raises(RunError, match=message):
            RunDir.resume(run.path, {**RUN, "seed": 1})
        assert run.metrics_path.read_text() == line + "\n" + rows
    run.metrics_path.write_text(rows)
    for text, message in ((f'{{"seed": {big}}}', "holds an integer of more than"), (deep, "nested too deep to read")):
        (run.path / "config.json").write_text(text)
        with pytest.raises(RunError, match=f"config.json is not readable JSON \\({message}"):
            RunDir.resume(run.path, {**RUN, "seed": 1})


def test_a_bad_line_mid_file_is_an_error_and_nothing_is_rewritten(tmp_path):
    """Only a torn last line is a crash artefact; damage in the middle must not silently drop the rows after it."""
    run = _finished_run(tmp_path / "r")
    lines = run.metrics_path.read_text().splitlines()
    damaged = "\n".join([lines[0][:-5], *lines[1:]]) + "\n"
    run.metrics_path.write_text(damaged)
    with pytest.raises(RunError, match=r"metrics.jsonl, line 1: not a JSON object"):
        RunDir.resume(run.path, {**RUN, "seed": 1})
    assert run.metrics_path.read_text() == damaged


def test_nan_is_written_as_null_and_read_back_as_nan(tmp_path):
    run = RunDir.create(tmp_path / "r", RUN)
    run.log_metrics(_row(1, loss=float("nan"), norm=float("inf"), ok=1.5))
    line = run.metrics_path.read_text()
    # strict JSON, no bare NaN; every row carries its run's id
    assert json.loads(line) == {**_row(1, loss=None, norm=None, ok=1.5), "run/id": run.id}
    with open(run.metrics_path, "a") as f:
        f.write(json.dumps(_row(2, ok=2.0))[:-1] + ', "loss": NaN, "norm": 1.0}\n')  # older files: bare NaN
    rows = run.metrics()
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["loss"] != r["loss"] for r in rows) and rows[0]["norm"] != rows[0]["norm"] and rows[1]["ok"] == 2.0


def test_orphan_run_files_and_stranded_temp_files(tmp_path):
    path = tmp_path / "r"
    path.mkdir()
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunError, match=r"holds run files \(metrics.jsonl\) but no config.json"):
        RunDir.create(path, RUN)
    run = _finished_run(tmp_path / "s")
    stranded = run.path / ".checkpoint.pt.abc123de.tmp"  # mkstemp's 8 random characters
    stranded.write_bytes(b"half a checkpoint")
    again, ckpt = RunDir.resume(run.path, {**RUN, "seed": 1})
    assert ckpt["step"] == 2 and not stranded.exists()


def test_a_write_error_is_one_line_naming_the_path(tmp_path, monkeypatch):
    """A full disk (ENOSPC) at any write: WriteError with the path and the reason, and the checkpoint survives."""
    import errno
    import os

    run = RunDir.create(tmp_path / "r", RUN)
    run.save_checkpoint({"step": 1})

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(WriteError, match=r"cannot write .*checkpoint.pt \(No space left on device\)"):
        run.save_checkpoint({"step": 2})
    with pytest.raises(WriteError, match=r"cannot write .*metrics.jsonl \(No space left on device\)"):
        run.log_metrics({"step": 2})
    monkeypatch.undo()
    assert torch.load(run.checkpoint_path, weights_only=True)["step"] == 1
    assert not list(run.path.glob(".*.tmp"))


LOCK_HOLDER = """
import sys, time
from phantomclip.runs.rundir import RunDir
run = RunDir.create(sys.argv[1], {"versions": {"phantomclip": "test"}, "seed": 1})
print("locked", flush=True)
time.sleep(60)
"""


def test_one_writer_per_run_directory_across_processes(tmp_path):
    """A second process gets one line naming the holder's pid; once the holder is killed (SIGKILL: no clean-up)
    its stale lock is free at once."""
    import subprocess
    import sys

    path = tmp_path / "r"
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(LockError, match=rf"in use by another phantomclip process \(pid {holder.pid}\)"):
            RunDir.resume(path, {**RUN, "seed": 1})
    finally:
        holder.kill()
        holder.wait()
    run, ckpt = RunDir.resume(path, {**RUN, "seed": 1})
    assert ckpt is None and (path / ".lock").read_text() == str(__import__("os").getpid())
