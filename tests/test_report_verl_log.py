"""`phantomclip report --from` a verl run's file log: what the run logged from inside verl (docs/verl.md), read back
into "Your framework" beside diagnose's figures for the same definitions (runs/framework_log.py read_verl_log, which
report/sources.py calls on every .jsonl it finds, and report/framework_log.py).

The log is written here in verl 0.9.1's format (verl/utils/tracking.py `FileLogger.log`: one
`{"step": N, "data": {...}}` per line, NaN as null as orjson writes it). Values are compared as the table prints them
(4 significant digits, `.4g`), each worked out by hand below."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from phantomclip.cli.main import main
from phantomclip.report.framework_panel import html_framework_panel
from phantomclip.report.sources import ReportError, collect
from phantomclip.runs.framework_log import read_verl_log

GOLDEN = Path(__file__).parent / "golden" / "diagnose-tiny-amx.json"


def _write_log(path: Path) -> Path:
    rows = [
        {"step": 1, "data": {"phantomclip/beta_abs_mean": 0.03, "phantomclip/actor/clip_rate": 0.10,
                             "rollout_corr/kl": 0.002, "actor/pg_loss": 0.5, "perf/list": [1, 2]}},
        {"step": 2, "data": {"actor/pg_loss": 0.4}},  # nothing kept: not a step of the table
        {"step": 3, "data": {"phantomclip/beta_abs_mean": 0.05, "phantomclip/actor/clip_rate": None,
                             "rollout_corr/kl": 0.004}},
        {"step": 4, "data": {"phantomclip/beta_abs_mean": 0.04, "phantomclip/actor/clip_rate": 0.30,
                             "rollout_corr/kl": 0.003}},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_read_verl_log_keeps_phantomclip_and_rollout_corr(tmp_path):
    log = read_verl_log(_write_log(tmp_path / "exp.jsonl"))
    assert [s["step"] for s in log["steps"]] == [1, 3, 4]
    assert set(log["steps"][0]["figures"]) == {"phantomclip/beta_abs_mean", "phantomclip/actor/clip_rate",
                                               "rollout_corr/kl"}  # losses, timings and lists left out
    assert log["steps"][1]["figures"]["phantomclip/actor/clip_rate"] != log["steps"][1]["figures"][
        "phantomclip/actor/clip_rate"]  # null: NaN


def test_panel_shows_the_run_beside_diagnose(tmp_path):
    log = read_verl_log(_write_log(tmp_path / "exp.jsonl"))
    diag = json.loads(GOLDEN.read_text())
    panel = html_framework_panel([diag], [log])
    # |β| mean: median of 0.03, 0.05, 0.04 = 0.04, last 0.04; clip rate: median of 0.10, 0.30 (NaN left out) = 0.2,
    # last 0.3; rollout_corr/kl: median 0.003, last 0.003, diagnose's value for verl's definition beside it.
    assert "<tr><td><code>phantomclip/beta_abs_mean</code></td><td>0.04</td><td>0.04</td><td>—</td></tr>" in panel
    assert "<tr><td><code>phantomclip/actor/clip_rate</code></td><td>0.2</td><td>0.3</td><td>—</td></tr>" in panel
    predicted = next(iter(diag["recipes"].values()))["frameworks"]["verl"]["rollout_corr/kl"]
    row = f"<tr><td><code>rollout_corr/kl</code></td><td>0.003</td><td>0.003</td><td>{predicted:.4g}</td></tr>"
    assert row in panel
    assert "3 steps" in panel and "what each framework would log" in panel.lower()
    alone = html_framework_panel([], [log])  # a verl log without a diagnose JSON: the run's table alone
    assert "What your verl run logged" in alone and "<td>—</td></tr>" in alone


def test_collect_finds_verl_logs_and_leaves_other_jsonl(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _write_log(src / "exp.jsonl")
    (src / "other.jsonl").write_text('{"step": 1, "loss": 0.5}\n')  # not verl's shape: left for its run directory
    data = collect([src])
    assert [Path(d["_path"]).name for d in data.verl_logs] == ["exp.jsonl"]
    with pytest.raises(ReportError, match="not verl's file log") as e:
        collect([src / "other.jsonl"])
    assert "\n" not in str(e.value)
    (src / "exp.jsonl").write_text('{"step": 1, "data": {}}\n{"step": 2, "data": \n')
    with pytest.raises(ReportError, match=r"exp.jsonl:2: not JSON"):
        collect([src])


def test_report_from_a_diagnose_json_and_a_verl_log(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(GOLDEN, src / "diagnose.json")
    _write_log(src / "exp.jsonl")
    assert main(["report", "--from", str(src), "--out", str(tmp_path / "out")]) == 0
    page = (tmp_path / "out" / "index.html").read_text()
    assert "What your verl run logged" in page
    assert any(f"exp.jsonl, a verl run{q}s file log of 3 steps" in page for q in ("'", "&#x27;", "&#39;"))
