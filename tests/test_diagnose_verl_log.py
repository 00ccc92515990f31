"""`phantomclip diagnose --from-verl-log LOG` (diagnose/verl_log.py) over the reader both it and the report use
(runs/framework_log.py).

The console excerpt, tests/golden/verl-0.9.1-console.log, is what verl 0.9.1's console logger printed for STEPS below
(verl/utils/logger/aggregate_logger.py `concat_dict_to_str`, run in the verl venv; numpy 2 prints np.float64(x)), each
line prefixed as Ray prefixes the TaskRunner's stdout (step 2's prefix coloured, as on a terminal), among lines that
are not verl's metrics. `test_excerpt_is_verls_own_format` regenerates it with verl where verl is installed. Figures
are compared after the same arithmetic in float64 on both sides (a mean of at most 5 values: |Δ| ≤ 5·2^-53 relative,
1e-12 taken), and as printed.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from phantomclip.cli.main import main
from phantomclip.diagnose.verl_log import summarise, verl_log_lines
from phantomclip.runs.framework_log import console_number, read_verl_log

EXCERPT = Path(__file__).parent / "golden" / "verl-0.9.1-console.log"
BETA = [0.030, 0.032, 0.034, 0.036, 0.040, 0.044, 0.048, 0.052]
OUTSIDE = [0.004, 0.006, 0.005, 0.007, 0.010, 0.012, 0.011, 0.015]
IS_SHARE = [0.0004, 0.0006, 0.0008, 0.0010, 0.0020, 0.0020, 0.0030, 0.0050]
CLIP = [0.1, 0.1, math.nan, 0.2, 0.2, 0.3, 0.3, 0.4]
KL = [0.002, 0.002, 0.003, 0.003, 0.004, 0.004, 0.005, 0.006]
ESS = [0.99, 0.98, 0.98, 0.97, 0.96, 0.95, 0.95, 0.94]
REL = 1e-12


def steps_logged():
    """The metrics dicts verl's trainer logged at steps 1-8 (plain floats from the driver's hook, np.float64 from
    reduce_metrics over the workers' lists), then step 8's validation line: what the excerpt was printed from."""
    import numpy as np

    rows = [{"training/global_step": i + 1, "training/epoch": 0, "actor/pg_loss": np.float64(-0.01 * (i + 1)),
             "actor/pg_clipfrac": np.float64(CLIP[i]), "phantomclip/actor/clip_rate": np.float64(CLIP[i]),
             "rollout_corr/kl": np.float64(KL[i]), "rollout_corr/rollout_is_eff_sample_size": np.float64(ESS[i]),
             "phantomclip/beta_tokens": 4096, "phantomclip/beta_abs_mean": BETA[i],
             "phantomclip/beta_outside_trust_region": OUTSIDE[i], "phantomclip/is_token_share": IS_SHARE[i],
             "timing_s/gen": 12.5, "perf/max_memory_allocated_gb": np.float32(3.25)} for i in range(8)]
    return [(i + 1, r) for i, r in enumerate(rows)] + [
        (8, {"val-core/openai/gsm8k/reward/mean@1": np.float64(0.25), "ok": True})]


@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed in this venv: run this "
                    "file in the verl venv (docs/verl.md, 'Tests')")
def test_excerpt_is_verls_own_format():
    from verl.utils.logger.aggregate_logger import concat_dict_to_str

    printed = [line.split(" ", 2)[2] for line in EXCERPT.read_text().splitlines() if " step:" in line]
    assert printed == [concat_dict_to_str(d, step=n) for n, d in steps_logged()]


def test_console_number_reads_what_pprint_writes():
    assert console_number("np.float64(0.03)") == 0.03 and console_number("np.float32(3.25)") == 3.25
    assert console_number("4096") == 4096.0 and console_number("-1.5e-07") == -1.5e-07
    assert math.isnan(console_number("np.float64(nan)")) and console_number("-inf") == -math.inf
    assert console_number("True") is None and console_number("'text'") is None and console_number("") is None


def test_read_console_excerpt():
    log = read_verl_log(EXCERPT)
    assert log["format"] == "console"
    assert [s["step"] for s in log["steps"]] == list(range(1, 9))  # step 8's validation line keeps nothing
    assert log["steps"][0]["figures"] == {
        "phantomclip/actor/clip_rate": 0.1, "rollout_corr/kl": 0.002, "rollout_corr/rollout_is_eff_sample_size": 0.99,
        "phantomclip/beta_tokens": 4096.0, "phantomclip/beta_abs_mean": 0.03,
        "phantomclip/beta_outside_trust_region": 0.004, "phantomclip/is_token_share": 0.0004}  # losses, timings out
    assert log["steps"][1]["figures"]["phantomclip/beta_abs_mean"] == 0.032  # the coloured prefix read through
    assert math.isnan(log["steps"][2]["figures"]["phantomclip/actor/clip_rate"])


def test_summary_hand_worked():
    s = summarise(read_verl_log(EXCERPT))
    f = s["figures"]
    # 8 steps: k = min(5, 8 // 2) = 4. |β| mean: first (0.030+0.032+0.034+0.036)/4 = 0.033, last
    # (0.040+0.044+0.048+0.052)/4 = 0.046, median (0.036+0.040)/2 = 0.038, change 0.046/0.033 = 1.3939.
    b = f["phantomclip/beta_abs_mean"]
    assert (b["steps"], b["k"]) == (8, 4)
    for key, want in {"first": 0.033, "last": 0.046, "median": 0.038, "change": 0.046 / 0.033}.items():
        assert b[key] == pytest.approx(want, rel=REL)
    # IS share: first (4+6+8+10)e-4/4 = 7e-4 (0.07%), last (20+20+30+50)e-4/4 = 3e-3 (0.30%): above ok's 0.1%, below
    # stall's 10%: at risk; rollout_is is set (the IS share is logged) and no bypass-only figure is: decoupled mode,
    # β in a weight, so the share outside the trust region is not what is judged.
    assert f["phantomclip/is_token_share"]["last"] == pytest.approx(3e-3, rel=REL)
    assert f["phantomclip/is_token_share"]["verdict"] == "at risk"
    assert f["phantomclip/beta_outside_trust_region"]["verdict"] == "-"
    assert s["answer"] == {"status": "at risk", "figure": "phantomclip/is_token_share",
                           "share": pytest.approx(3e-3, rel=REL), "k": 4}
    # clip rate's first 4 steps hold a NaN (step 3): (0.1+0.1+0.2)/3; its median over the 7 finite values is 0.2
    assert f["phantomclip/actor/clip_rate"]["first"] == pytest.approx(0.4 / 3, rel=REL)
    assert f["phantomclip/actor/clip_rate"]["median"] == pytest.approx(0.2, rel=REL)


def test_cli_prints_the_table(capsys):
    assert main(["diagnose", "--from-verl-log", str(EXCERPT)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("answer: AT RISK: 0.30% of tokens whose IS weight your rollout_is setting changes, mean "
                             "of the last 4 steps")
    rows = {}  # each figure's first row: its per-step row
    for line in out:
        if line.startswith("  "):
            rows.setdefault(line.split()[0], line.split()[1:])
    # per step: steps 1, 2, 3, …, 6, 7, 8 (the … column is empty in the rows)
    assert "step 1" in out[4] and "…" in out[4] and "step 8" in out[4] and "step 4" not in out[4]
    per_step = [line.split() for line in out if line.startswith("  phantomclip/is_token_share")]
    assert per_step[0][1:] == ["0.04%", "0.06%", "0.08%", "0.20%", "0.30%", "0.50%"]
    # whole run: steps, median (0.15%: (0.10+0.20)/2), first 0.07%, last 0.30%, change 3e-3/7e-4 = x4.29, verdict
    assert per_step[1][1:] == ["8", "0.15%", "0.07%", "0.30%", "x4.29", "at", "risk"]
    whole = [line.split() for line in out if line.startswith("  phantomclip/beta_abs_mean")][1]
    assert whole[1:] == ["8", "0.038", "0.033", "0.046", "x1.39", "-"]
    assert rows["phantomclip/beta_tokens"][:3] == ["4096", "4096", "4096"]  # a count printed whole
    assert rows["rollout_corr/kl"][:3] == ["2.0e-03", "2.0e-03", "3.0e-03"]  # below 0.01: as diagnose prints it
    assert any(line.startswith("  rollout_corr/kl") and "KL(engine ‖ trainer)" in line for line in out)


def _file_log(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps({"step": n, "data": d}) + "\n" for n, d in enumerate(rows, 1)))
    return path


def test_bypass_mode_file_log_will_stall(tmp_path):
    # bypass mode (its recompute figure is logged): β is in the clip, the share outside the trust region is judged;
    # 2 steps, k = 1: last = 0.12 ≥ 10%: will stall; first 0.08, change 0.12/0.08 = x1.50
    log = _file_log(tmp_path / "run.jsonl", [
        {"phantomclip/beta_outside_trust_region": 0.08, "phantomclip/phantom_clip_rate_at_alpha0": 0.04},
        {"phantomclip/beta_outside_trust_region": 0.12, "phantomclip/phantom_clip_rate_at_alpha0": 0.05}])
    s = summarise(read_verl_log(log))
    assert s["where"] == "the clip (bypass mode)"
    assert s["answer"]["status"] == "will stall" and s["answer"]["share"] == 0.12
    assert s["figures"]["phantomclip/beta_outside_trust_region"]["change"] == pytest.approx(1.5, rel=REL)
    lines = verl_log_lines(log)
    assert lines[0] == ("answer: WILL STALL: 12.00% of tokens outside the trust region at α = 0, mean of the last 1 "
                        "steps that logged it (phantomclip/beta_outside_trust_region; ok ≤ 0.1%, stall ≥ 10%)")
    assert "(file log)" in lines[3]


def test_only_verls_own_figures_is_not_judged(tmp_path):
    log = _file_log(tmp_path / "run.jsonl", [{"rollout_corr/kl": 0.01}, {"rollout_corr/kl": 0.02}])
    assert verl_log_lines(log)[0].startswith("answer: NOT JUDGED: the log holds no share of tokens β touches")


@pytest.mark.parametrize("case", ["not verl", "no figure", "directory", "missing", "torn file log", "other flag"])
def test_bad_input_one_line_exit_2(tmp_path, capsys, case):
    path = tmp_path / "run.log"
    args = []
    if case == "not verl":
        path.write_text("INFO ray started\nstep 3 done\n")
    elif case == "no figure":
        path.write_text("(TaskRunner pid=1) step:1 - actor/pg_loss:np.float64(0.5) - timing_s/gen:1.5\n")
    elif case == "directory":
        path.mkdir()
    elif case == "torn file log":
        path.write_text('{"step": 1, "data": {"rollout_corr/kl": 0.1}}\n{"step": 2, "da\n')
    elif case == "other flag":
        args = ["--n", "4"]
        path = EXCERPT
    assert main(["diagnose", "--from-verl-log", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    want = {"not verl": "not a verl log", "no figure": "no phantomclip/* or rollout_corr/* figure",
            "directory": "is a directory", "missing": "cannot be read", "torn file log": "run.log:2: not JSON",
            "other flag": "--n with --from-verl-log"}[case]
    assert want in err
