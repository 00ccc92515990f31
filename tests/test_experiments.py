import json

import pytest
from conftest import bad_cli

from phantomclip.cli import _split_run_names, main
from phantomclip.experiments import SANITY_INTERVENTIONS, sanity_runs, summarize
from phantomclip.trainer import TrainConfig, TrainConfigError

TINY = ["--model", "tiny-random:30", "--max-tokens", "8", "--prompts-per-step", "2", "--lr", "3e-3"]


def test_sanity_matrix_names_and_configs():
    runs = sanity_runs(TrainConfig())
    assert list(runs)[: len(SANITY_INTERVENTIONS)] == list(SANITY_INTERVENTIONS)
    # the ε sweep adds 0.05, 0.1, 0.3 for the baseline and match-bf16 (0.2 is the base run itself)
    assert [n for n in runs if "epsilon" in n] == [f"{a},epsilon={e}" for a in ("none", "match-bf16") for e in (0.05, 0.1, 0.3)]
    assert runs["match-bf16,epsilon=0.1"].intervention == "match-bf16,epsilon=0.1"
    with pytest.raises(TrainConfigError, match="unknown run"):
        sanity_runs(TrainConfig(), only=["none", "warp"])


def test_summarize_hand_worked():
    rows = [{"step": i, "task/converged": i >= 3, "reward/mean": -float(10 - i), "completion/length_mean": float(10 - i),
             "clip/phantom_rate": 0.1 * (i <= 2), "clip/rate": 0.2, "mismatch/beta_abs_mean": 0.03, "time/step_s": 2.0}
            for i in range(1, 8)]
    s = summarize("none", rows, 7)
    assert s["steps_to_converge"] == 3 and s["converged"]
    assert s["final_reward"] == pytest.approx(-(5 + 4 + 3) / 3)  # steps 5, 6, 7
    assert s["phantom_rate_first5"] == pytest.approx(0.1 * 2 / 5)  # steps 1 and 2 of the first 5
    assert s["wall_s"] == 14.0


def test_split_run_names():
    assert _split_run_names("none,shadow-ratio,none,epsilon=0.1") == ["none", "shadow-ratio", "none,epsilon=0.1"]


def test_experiment_sanity_on_tiny_runs_and_continues(tmp_path, capsys):
    args = ["experiment", "sanity", *TINY, "--steps", "3", "--out", str(tmp_path), "--only", "none,force-r1,none,epsilon=0.1"]
    assert main(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["run"] for r in summary["runs"]] == ["none", "force-r1", "none,epsilon=0.1"]
    assert all(r["steps_run"] == 3 for r in summary["runs"])
    table = (tmp_path / "summary.md").read_text()
    assert "| force-r1 |" in table and "not converged in 3" in table
    first = (tmp_path / "none" / "metrics.jsonl").read_text()
    assert main(args) == 0  # finished runs are read back, not rerun
    assert (tmp_path / "none" / "metrics.jsonl").read_text() == first
    assert main(["experiment", "sanity", *TINY, "--steps", "4", "--out", str(tmp_path), "--only", "none"]) == 0
    assert len((tmp_path / "none" / "metrics.jsonl").read_text().splitlines()) == 4  # a bigger budget resumes


def test_train_bad_inputs_exit_2(tmp_path, capsys):
    assert "unknown task 'nope'" in bad_cli(["train", *TINY, "--task", "nope", "--out", str(tmp_path / "a")], capsys)
    assert "--staleness must be >= 0" in bad_cli(["train", "--staleness", "-1"], capsys)
    assert "--group-size must be >= 2" in bad_cli(["train", "--group-size", "1"], capsys)
    assert "unknown intervention" in bad_cli(["train", "--intervention", "magic"], capsys)
    assert "cannot import nosuchmodule" in bad_cli(["train", *TINY, "--reward", "nosuchmodule:f", "--out", str(tmp_path / "b")], capsys)
    assert "write it as module:function" in bad_cli(["train", *TINY, "--reward", "justaname", "--out", str(tmp_path / "c")], capsys)
    assert main(["train", *TINY, "--steps", "1", "--out", str(tmp_path / "r")]) == 0
    capsys.readouterr()
    assert "lr: 0.003 -> 0.001" in bad_cli(["train", *TINY[:-2], "--lr", "1e-3", "--steps", "2", "--out", str(tmp_path / "r"), "--resume"], capsys)
    assert "already holds a run" in bad_cli(["train", *TINY, "--steps", "1", "--out", str(tmp_path / "r")], capsys)
    assert "holds no run to resume" in bad_cli(["train", *TINY, "--out", str(tmp_path / "empty"), "--resume"], capsys)


def test_a_run_stops_once_converged_and_counts_as_finished(tmp_path):
    from phantomclip.experiments import run_sanity

    base = TrainConfig(model="tiny-random:30", max_tokens=8, prompts_per_step=2, lr=3e-3, steps=40, stop_after_converged=3)
    rows = run_sanity(base, tmp_path, only=["force-r1"])
    r = rows[0]
    assert r["converged"] and r["steps_run"] == r["steps_to_converge"] + 2 < 40  # converged on 3 steps in a row
    before = (tmp_path / "force-r1" / "metrics.jsonl").read_text()
    run_sanity(base, tmp_path, only=["force-r1"])  # finished early counts as finished: nothing is rerun
    assert (tmp_path / "force-r1" / "metrics.jsonl").read_text() == before


def test_ctrl_c_stops_the_whole_experiment(tmp_path, monkeypatch):
    """An interrupted run (Ctrl-C) ends the experiment with its summary written, instead of starting the next run."""
    import phantomclip.experiments as experiments
    from phantomclip.trainer import TrainResult

    calls = []

    def interrupted_train(cfg, out, resume, console):
        calls.append(cfg.intervention)
        return TrainResult(metrics=[{"step": 1, "task/converged": False, "reward/mean": -8.0, "completion/length_mean": 8.0,
                                     "clip/phantom_rate": 0.0, "clip/rate": 0.0, "mismatch/beta_abs_mean": 0.01, "time/step_s": 1.0}],
                           run_dir=out, interrupted=True)

    monkeypatch.setattr(experiments, "train", interrupted_train)
    with pytest.raises(KeyboardInterrupt):
        experiments.run_sanity(TrainConfig(model="tiny-random:30", steps=3), tmp_path, only=["none", "force-r1"])
    assert calls == ["none"]
    assert json.loads((tmp_path / "summary.json").read_text())["runs"][0]["steps_run"] == 1
