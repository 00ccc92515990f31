"""Every job's terminal output fits an 80-column terminal: no line longer, no cell cut short with an ellipsis.
Rendered from the bundled demo results (the bundled model's real figures) and a crafted engines result."""

import io
import json
from dataclasses import asdict
from importlib.resources import files

import pytest
from rich.console import Console

from phantomclip.diagnose.text import render_diagnose
from phantomclip.engines.compare import CompareConfig
from phantomclip.engines.compare_text import render_engines
from phantomclip.trace.text import render_growth, render_trace
from phantomclip.training.experiment_text import column_groups, render_experiment

DEMO = files("phantomclip.report").joinpath("demo")


def _engines() -> dict:
    rows = [{"engine": engine, "dtype": dtype, "startup_seconds": 31.2, "tokens_per_s": 312.0, "vs_local": 1.23}
            for engine in ("local", "vllm") for dtype in ("fp32", "bf16")]
    return {"config": asdict(CompareConfig()), "rows": rows}


JOBS = {
    "diagnose": (render_diagnose, lambda: json.loads(DEMO.joinpath("diagnose.json").read_text())),
    "trace": (render_trace, lambda: json.loads(DEMO.joinpath("trace.json").read_text())),
    "trace --run": (render_growth, lambda: json.loads(DEMO.joinpath("growth/none-seed0.json").read_text())),
    "experiment": (render_experiment, lambda: json.loads(DEMO.joinpath("sanity/summary.json").read_text())),
    "engines": (render_engines, _engines),
}


@pytest.mark.parametrize("job", list(JOBS))
def test_every_job_fits_80_columns(job):
    render, result = JOBS[job]
    out = io.StringIO()
    render(result(), Console(file=out, width=80))
    lines = out.getvalue().splitlines()
    assert lines and max(map(len, lines)) <= 80, max(lines, key=len)
    assert "…" not in out.getvalue(), [line for line in lines if "…" in line][:3]  # rich's mark of a cut cell


def test_the_experiment_table_splits_only_when_it_must():
    summary = json.loads(DEMO.joinpath("sanity/summary.json").read_text())
    wide, narrow = io.StringIO(), io.StringIO()
    render_experiment(summary, Console(file=wide, width=400))
    render_experiment(summary, Console(file=narrow, width=80))
    assert wide.getvalue().count("experiment sanity: mean") == 1
    assert narrow.getvalue().count("experiment sanity: mean") > 1  # the same arms, in several tables
    for arm in summary["arms"]:
        assert narrow.getvalue().count(f"  {arm['run']} ") >= 2


def test_column_groups_pack_in_order():
    # room 10: 4 + 5 fit (9), 3 starts a new group, 12 is wider than the room and stands alone, 1 joins nothing before
    assert column_groups([4, 5, 3, 12, 1], 10) == [[0, 1], [2], [3], [4]]
    assert column_groups([4, 5, 1], 10) == [[0, 1, 2]]
