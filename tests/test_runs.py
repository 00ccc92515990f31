import json

import pytest
import torch

from phantomclip.runs import RunDir, RunError, config_diff, read_jsonl


def test_create_log_checkpoint_resume(tmp_path):
    cfg = {"seed": 1, "lr": 1e-5, "steps": 10}
    run = RunDir.create(tmp_path / "r", cfg)
    for step in range(1, 6):
        run.log_metrics({"step": step, "loss": float(step)})
        if step == 3:
            run.save_checkpoint({"step": 3, "w": torch.ones(2) * 3})
    with open(run.metrics_path, "a") as f:
        f.write('{"step": 6, "lo')  # torn line from a SIGKILL
    assert [r["step"] for r in run.metrics()] == [1, 2, 3, 4, 5]
    with pytest.raises(RunError, match="already holds a run"):
        RunDir.create(tmp_path / "r", cfg)
    again, ckpt = RunDir.resume(tmp_path / "r", {**cfg, "steps": 20})  # more steps is allowed
    assert ckpt["step"] == 3 and torch.equal(ckpt["w"], torch.ones(2) * 3)
    assert [r["step"] for r in again.metrics()] == [1, 2, 3]  # steps after the checkpoint are dropped
    assert json.loads((tmp_path / "r" / "config.json").read_text()) == cfg


def test_resume_refuses_a_different_config(tmp_path):
    RunDir.create(tmp_path / "r", {"seed": 1, "lr": 1e-5})
    with pytest.raises(RunError, match="lr: 1e-05 -> 0.001"):
        RunDir.resume(tmp_path / "r", {"seed": 1, "lr": 1e-3})
    with pytest.raises(RunError, match="no config.json"):
        RunDir.resume(tmp_path / "none", {})
    assert config_diff({"a": 1, "b": 2}, {"a": 1, "c": 3}) == ["b: 2 -> None", "c: None -> 3"]


def test_interrupted_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    run = RunDir.create(tmp_path / "r", {})
    run.save_checkpoint({"step": 1})

    import os

    real_fdopen = os.fdopen

    class Dying:  # the temp file gets a few bytes, then the process is interrupted
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[:10])
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: Dying(real_fdopen(fd, mode)))
    with pytest.raises(KeyboardInterrupt):
        run.save_checkpoint({"step": 2})
    monkeypatch.undo()
    assert torch.load(run.checkpoint_path)["step"] == 1
    assert sorted(p.name for p in run.path.iterdir()) == ["checkpoint.pt", "config.json"]
    assert read_jsonl(run.metrics_path) == []
