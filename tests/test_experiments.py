import json
import math

import pytest

from conftest import bad_cli
from phantomclip.base.errors import ConfigError
from phantomclip.cli.main import _split_run_names, main
from phantomclip.training.experiments import (
    EXPERIMENTS,
    SANITY_INTERVENTIONS,
    build_matrix,
    run_experiment,
    summarize,
    summarize_run,
    summary_markdown,
)
from phantomclip.training.trainer import TrainConfig, TrainConfigError

TINY = ["--model", "tiny-random:30", "--max-tokens", "8", "--prompts-per-step", "2", "--lr", "3e-3"]


def test_matrices_names_configs_and_seeds():
    m = build_matrix("sanity", TrainConfig(seed=4), seeds=3)
    assert list(m.arms) == list(SANITY_INTERVENTIONS) and m.seeds == (4, 5, 6)
    runs = m.runs()
    assert len(runs) == 12 * 3 and [r[:2] for r in runs[:2]] == [("none", 4), ("match-bf16", 4)]  # seed-major
    assert all(cfg.seed == s and cfg.intervention == arm for arm, s, cfg in runs)
    eps = build_matrix("epsilon", TrainConfig(), seeds=1)
    # the base ε (0.2) is the plain arm; 0.05, 0.1, 0.3 for the baseline and match-bf16
    assert list(eps.arms) == [a if e == 0.2 else f"{a},epsilon={e}"
                              for a in ("none", "match-bf16") for e in (0.05, 0.1, 0.2, 0.3)]
    with pytest.raises(TrainConfigError, match="unknown run"):
        build_matrix("sanity", TrainConfig(), seeds=2, only=["none", "warp"])
    # arm names hold commas ('none,epsilon=0.05'): every name in a list is quoted, so the list reads one way
    with pytest.raises(TrainConfigError,
                       match=r"unknown run\(s\) 'fp8,warp'; the runs are: 'none,epsilon=0.05', "
                             r"'none,epsilon=0.1', 'none', "):
        build_matrix("epsilon", TrainConfig(), seeds=1, only=["fp8,warp"])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(TrainConfigError, match="--seeds must be a whole number"):
            build_matrix("sanity", TrainConfig(), seeds=bad)
    # vLLM runs one dtype: the fp32-head arm is left out of the whole matrix, said why, and refused when named
    vllm = build_matrix("sanity", TrainConfig(engine="vllm"), seeds=1)
    assert list(vllm.arms) == [a for a in SANITY_INTERVENTIONS if a != "fp32-head"] and m.left_out == {}
    assert "vLLM cannot" in vllm.left_out["fp32-head"] and all(c.engine == "vllm" for c in vllm.arms.values())
    with pytest.raises(TrainConfigError, match="run it with --engine local"):
        build_matrix("sanity", TrainConfig(engine="vllm"), seeds=1, only=["none", "fp32-head"])


def _rows(lengths, phantom=0.0, clip=0.0, beta=0.03, converged_from=None):
    return [{"step": i + 1, "task/converged": converged_from is not None and i + 1 >= converged_from,
             "reward/mean": -x, "completion/length_mean": x, "clip/phantom_rate": phantom, "clip/rate": clip,
             "clip/phantom_adv_share": phantom, "adv/abs_sum": 8.0, "mismatch/tokens": 100,
             "mismatch/beta_abs_mean": beta, "mismatch/beta_outside_trust_region": 0.0, "time/step_s": 2.0}
            for i, x in enumerate(lengths)]


def test_summarize_run_hand_worked():
    # 7 steps of lengths 9..3; converged from step 5 (length <= 2 is neglen's rule; set by hand here)
    rows = _rows([9.0, 8, 7, 6, 5, 4, 3], converged_from=5)
    rows[0]["clip/phantom_rate"], rows[0]["clip/rate"] = 0.1, 0.2  # step 1: 10 of 100 tokens phantom, 20 clipped
    s = summarize_run("none", 0, rows, budget=10)
    assert s["steps_to_converge"] == 5 and s["converged"]
    assert s["final_length"] == pytest.approx((7 + 6 + 5 + 4 + 3) / 5)  # the last 5 steps
    # stopped at 7 of 10: steps 8-10 carried at the mean of the last 5 (5.0): (9+8+...+3 + 3·5) / 10 = (42 + 15) / 10
    assert s["length_auc"] == pytest.approx(5.7)
    assert s["phantom_rate"] == pytest.approx(10 / 700)  # token-weighted over the whole run
    assert s["phantom_share_of_clipped"] == pytest.approx(10 / 20)
    assert s["wall_s"] == 14.0
    never = summarize_run("none", 0, _rows([9.0] * 4), budget=4)
    assert not never["converged"] and never["steps_to_converge"] == 4  # censored at the budget
    # patience 3: converged flags at steps 2, 4, 5, 6 -> the first 3-step streak starts at step 4
    flaky = _rows([9.0, 1, 9, 1, 1, 1], converged_from=4)
    flaky[1]["task/converged"] = True
    assert summarize_run("none", 0, flaky, budget=6)["steps_to_converge"] == 2  # patience 1: the first flag
    assert summarize_run("none", 0, flaky, budget=6, patience=3)["steps_to_converge"] == 4
    assert not summarize_run("none", 0, flaky[:5], budget=6, patience=3)["converged"]  # steps 4, 5 only


def test_intervals_and_verdict_on_a_made_up_3_seed_table():
    # final lengths: none 20, 22, 24 (seeds 0-2); force-r1 2, 3, 4; tis 21, 21, 26.
    # force-r1 − none per seed: -18, -19, -20: mean -19, sd 1, t_{0.975,2} = 4.303: -19 ± 4.303/√3 = ±2.484
    # tis − none: 1, -1, 2: mean 0.667, sd 1.528, half-width 4.303 · 1.528/√3 = 3.795: includes zero
    m = build_matrix("sanity", TrainConfig(), seeds=3, only=["none", "force-r1", "tis"])
    finals = {"none": [20, 22, 24], "force-r1": [2, 3, 4], "tis": [21, 21, 26]}
    results = [summarize_run(arm, s, _rows([float(x)] * 5), budget=5)
               for arm, xs in finals.items() for s, x in enumerate(xs)]
    summary = summarize(m, results)
    arms = {a["run"]: a for a in summary["arms"]}
    none = arms["none"]["final_length"]
    assert none["mean"] == 22 and none["high"] - 22 == pytest.approx(4.303 * 2 / math.sqrt(3))
    d = arms["force-r1"]["vs_baseline"]["final_length"]
    assert (d["mean"], d["n"]) == (-19, 3) and d["high"] == pytest.approx(-19 + 4.303 / math.sqrt(3))
    t = arms["tis"]["vs_baseline"]["final_length"]
    assert t["low"] == pytest.approx(2 / 3 - 4.303 * math.sqrt(7 / 3) / math.sqrt(3)) and t["low"] < 0 < t["high"]
    verdict = dict(line.split(": ", 1) for line in summary["verdict"])
    assert verdict["force-r1"].startswith("final length -19 [") and "(3 seeds)" in verdict["force-r1"]
    assert verdict["tis"] == "no detectable difference from none at 3 seeds"
    assert "no detectable" in summary_markdown(summary) and "| force-r1 | 3 |" in summary_markdown(summary)


def test_split_run_names():
    """Run names hold commas (the epsilon sweep's 'none,epsilon=0.1', the FP8 arms' 'fp8,tis'): each is read whole,
    a bare name beside it stays apart, an unknown name passes through for build_matrix to refuse."""
    epsilon = list(EXPERIMENTS["epsilon"](TrainConfig()))
    assert _split_run_names("none,shadow-ratio,none,epsilon=0.1", epsilon) == [
        "none", "shadow-ratio", "none,epsilon=0.1"]
    fp8 = list(EXPERIMENTS["fp8"](TrainConfig()))
    assert _split_run_names("fp8,tis,fp8, none ,fp8,force-r1", fp8) == ["fp8,tis", "fp8", "none", "fp8,force-r1"]
    assert _split_run_names("fp8,bogus", fp8) == ["fp8", "bogus"]
    with pytest.raises(ConfigError, match="--only is empty"):
        _split_run_names(" , ", fp8)


def test_two_arms_two_seeds_end_to_end_interrupted_and_continued(tmp_path, capsys, monkeypatch):
    """The tiny model's sanity with 2 arms x 2 seeds; an interruption after the first run continues to the same
    summary as the uninterrupted experiment; a different seed or arm set is refused, naming the runs."""
    import phantomclip.training.experiments as experiments

    args = ["experiment", "sanity", *TINY, "--steps", "3", "--seeds", "2", "--only", "none,force-r1"]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert [(r["run"], r["seed"]) for r in whole["runs"]] == [("none", 0), ("force-r1", 0), ("none", 1),
                                                              ("force-r1", 1)]
    assert not list((tmp_path / "whole").rglob("checkpoint.pt"))  # finished runs drop their checkpoints
    assert len(whole["verdict"]) == 1 and whole["arms"][1]["vs_baseline"]["final_length"]["n"] == 2

    real_train, calls = experiments.train, []

    def stop_after_first(cfg, out, resume, console):
        result = real_train(cfg, out=out, resume=resume, console=console)
        calls.append(cfg.intervention)
        result.interrupted = len(calls) == 1  # as if Ctrl-C came during the first run's last step
        return result

    monkeypatch.setattr(experiments, "train", stop_after_first)
    assert main([*args, "--out", str(tmp_path / "cut")]) == 130
    monkeypatch.setattr(experiments, "train", real_train)
    assert main([*args, "--out", str(tmp_path / "cut")]) == 0
    cut = json.loads((tmp_path / "cut" / "summary.json").read_text())
    drop = lambda runs: [{k: v for k, v in r.items() if k != "wall_s"} for r in runs]  # noqa: E731
    assert drop(cut["runs"]) == drop(whole["runs"]) and cut["verdict"] == whole["verdict"]
    capsys.readouterr()
    line = bad_cli([*args[:-4], "--seeds", "3", "--only", "none,force-r1", "--out", str(tmp_path / "whole")], capsys)
    assert "new in this command: 'force-r1/seed-2', 'none/seed-2'" in line
    line = bad_cli([*args[:-2], "--only", "none", "--out", str(tmp_path / "whole")], capsys)
    assert "not in this command: 'force-r1/seed-0', 'force-r1/seed-1'" in line


def test_train_bad_inputs_exit_2(tmp_path, capsys):
    assert "unknown task 'nope'" in bad_cli(["train", *TINY, "--task", "nope", "--out", str(tmp_path / "a")], capsys)
    assert "--staleness must be a whole number >= 0, got -1" in bad_cli(["train", "--staleness", "-1"], capsys)
    assert "--group-size must be a whole number >= 2, got 1" in bad_cli(["train", "--group-size", "1"], capsys)
    assert "unknown intervention" in bad_cli(["train", "--intervention", "magic"], capsys)
    assert "cannot import nosuchmodule" in bad_cli(["train", *TINY, "--reward", "nosuchmodule:f",
                                                    "--out", str(tmp_path / "b")], capsys)
    assert "write it as module:function" in bad_cli(["train", *TINY, "--reward", "justaname",
                                                     "--out", str(tmp_path / "c")], capsys)
    assert main(["train", *TINY, "--steps", "1", "--out", str(tmp_path / "r")]) == 0
    capsys.readouterr()
    assert "--lr 0.001: the run in" in bad_cli(["train", *TINY[:-2], "--lr", "1e-3", "--steps", "2",
                                            "--out", str(tmp_path / "r"), "--resume"], capsys)
    assert "already holds a run" in bad_cli(["train", *TINY, "--steps", "1", "--out", str(tmp_path / "r")], capsys)
    assert "no config.json there, so no run to continue" in bad_cli(["train", *TINY, "--out", str(tmp_path / "empty"),
                                                                     "--resume"], capsys)


def test_a_run_stops_once_converged_and_counts_as_finished(tmp_path):
    base = TrainConfig(model="tiny-random:30", max_tokens=8, prompts_per_step=2, lr=3e-3, steps=40,
                       stop_after_converged=3)
    matrix = build_matrix("sanity", base, seeds=1, only=["force-r1"])
    r = run_experiment(matrix, tmp_path)["runs"][0]
    assert r["converged"] and r["steps_run"] == r["steps_to_converge"] + 2 < 40  # converged on 3 steps in a row
    before = (tmp_path / "force-r1" / "seed-0" / "metrics.jsonl").read_text()
    run_experiment(matrix, tmp_path)  # finished early counts as finished: nothing is rerun
    assert (tmp_path / "force-r1" / "seed-0" / "metrics.jsonl").read_text() == before


def test_fp8_matrix_pairs_the_bf16_engine_with_the_fp8_engine_and_its_corrections():
    from phantomclip.training.experiments import build_matrix
    from phantomclip.training.interventions import resolve_plan

    m = build_matrix("fp8", TrainConfig(model="tiny-random:30"), seeds=3)
    assert list(m.arms) == ["none", "fp8", "fp8,tis", "fp8,mis", "fp8,icepop", "fp8,shadow-ratio", "fp8,force-r1"]
    assert resolve_plan(m.arms["none"]).engine_recipe == "bf16"
    plans = {a: resolve_plan(c) for a, c in m.arms.items() if a != "none"}
    assert {p.engine_recipe for p in plans.values()} == {"bf16+fp8-w8a8"}
    assert plans["fp8,tis"].correction == "token_truncate" and plans["fp8,shadow-ratio"].clip_on == "shadow"
    assert all(p.trainer_recipe == "fp32" for p in plans.values()) and m.seeds == (0, 1, 2)
