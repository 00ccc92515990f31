"""What the article's figures draw, read from their Plotly specs (no browser): every measured site on the depth
axes, log axes labelled inside the data's range, legends that count what they draw, small data that no axis hides,
titles that match the number of seeds, one note per empty section."""

import copy
import html
import math

import pytest

from phantomclip.report import collect, demo_sources
from phantomclip.report.figures import fig_trace_depth
from phantomclip.report.growth_panel import fig_growth_depth
from phantomclip.report.plots import log_axis


@pytest.fixture(scope="module")
def demo():
    return collect(demo_sources())


def test_log_axis_labels_at_least_three_ticks_inside_the_data():
    # 0.004-0.03 spans less than one decade: decades alone give only 10⁻² inside it; 1-2-5 gives 0.005, 0.01, 0.02
    axis = log_axis([0.004, 0.03])
    assert axis["tickvals"] == [0.005, 0.01, 0.02] and axis["ticktext"] == ["5·10⁻³", "10⁻²", "2·10⁻²"]
    assert log_axis([1e-5, 0.3])["ticktext"] == ["10⁻⁵", "10⁻⁴", "10⁻³", "10⁻²", "10⁻¹"]  # 4+ decades: decades
    narrow = log_axis([0.011, 0.019, 0.0, -1.0])  # zeros and negatives have no place on a log axis
    assert narrow["tickvals"] == [0.01, 0.015, 0.02]
    lo, hi = narrow["range"]  # log10 units: the three ticks are inside the range drawn
    assert lo < math.log10(0.01) and hi > math.log10(0.02)


def test_depth_figures_draw_every_site_on_a_category_axis(demo):
    """The demo trace has 34 sites of the depth figure (embed, 30 residual streams, final norm, logits,
    log-probabilities); on a numeric axis Plotly dropped the four named ones. A category axis in depth order draws
    all 34, and the log y axis is labelled at least three times inside the data."""
    fig = fig_trace_depth(demo)
    x, y = fig["data"][0]["x"], fig["data"][0]["y"]
    assert len(x) == 34 and x[0] == "embed" and x[-3:] == ["norm", "logits", "logprobs"]
    assert x[1:31] == [str(i) for i in range(30)]
    assert fig["layout"]["xaxis"]["type"] == "category" and fig["layout"]["xaxis"]["categoryarray"] == x
    ticks = fig["layout"]["yaxis"]["tickvals"]
    assert len([t for t in ticks if min(y) / 1.05 <= t <= max(y) * 1.05]) >= 3
    growth = fig_growth_depth(demo.growths)
    sites = growth["layout"]["xaxis"]["categoryarray"]
    assert growth["layout"]["xaxis"]["type"] == "category" and sites[0] == "embed" and sites[-2:] == ["norm", "logits"]
    assert all(t["x"] == sites for t in growth["data"])
    assert len(growth["layout"]["yaxis"]["tickvals"]) >= 3


def test_token_legend_counts_zero_advantage_apart_and_points_to_a_clip(demo):
    """The demo's logged tokens (run none/seed-0, steps 1-5): 1024 of 1192 have advantage exactly 0 (steps 1, 3, 4,
    5: groups whose rewards were all equal), 168 carry a gradient, none was clipped. The legend says so, and the
    title names the first step whose metrics record a clip (step 7 of that run). Give a second run clipped tokens and
    the figure draws that run instead."""
    from phantomclip.report.figures import fig_alpha_beta_tokens

    fig = fig_alpha_beta_tokens(demo)
    names = [t["name"] for t in fig["data"]]
    assert "advantage 0: no gradient to lose (1024)" in names and "gradient flows (168)" in names
    run = next(r for r in demo.runs if r.get("tokens"))
    zeros = sum(a == 0 for t in run["tokens"] for a in t["advantage"])
    assert zeros == 1024 and sum(len(t["advantage"]) for t in run["tokens"]) == 1192
    first = next(m for m in run["metrics"] if m["clip/rate"] > 0)
    assert first["step"] == 7
    assert "no token of these steps was clipped" in fig["title"]
    assert "The first clip in this run's metrics is at step 7" in fig["title"] and "--token-log-steps 7" in fig["title"]

    altered = copy.deepcopy(demo)
    other = next(r for r in altered.runs if r["config"]["intervention"] == "force-r1")
    other["tokens"] = copy.deepcopy(run["tokens"])
    row = other["tokens"][1]  # step 2 of the copy: its first token clipped, with an α inside the trust region
    row["clipped"][0], row["alpha"][0], row["advantage"][0] = True, 0.0, 1.0
    fig = fig_alpha_beta_tokens(altered)
    assert fig["title"].startswith(f"Run '{other['name']}'")
    assert "phantom-clipped (1)" in [t["name"] for t in fig["data"]]
    assert "no token of these steps was clipped" not in fig["title"]


def test_a_one_seed_six_step_run_reads_as_well_as_the_demo(tmp_path):
    """The page from one run of 6 steps (the demo's none/seed-0 cut to 6 steps, no experiment, no trace --run): the
    α-β axes hold all 6 points (a 1-99 percentile range hid 2), titles and prose speak of one run and no band,
    nothing points to an absent table, and section 6 has one note, not five."""
    from phantomclip.report import render
    from phantomclip.report.page import FIGURES

    run = tmp_path / "run"
    src = demo_sources()[0] / "sanity" / "none" / "seed-0"
    run.mkdir()
    (run / "config.json").write_text((src / "config.json").read_text())
    (run / "metrics.jsonl").write_text("".join((src / "metrics.jsonl").read_text().splitlines(True)[:6]))
    data = collect([run])
    assert len(data.runs) == 1 and len(data.runs[0]["metrics"]) == 6
    fig = FIGURES["alpha_beta_steps"][0](data)
    (xs,), (ys,) = [t["x"] for t in fig["data"]], [t["y"] for t in fig["data"]]
    (x0, x1), (y0, y1) = fig["layout"]["xaxis"]["range"], fig["layout"]["yaxis"]["range"]
    assert len(xs) == 6 and all(x0 <= x <= x1 for x in xs) and all(y0 <= y <= y1 for y in ys)
    assert "outside these axes" not in fig["title"] and "marker: the seed" not in fig["title"]
    for name in ("training", "phantom_steps", "beta_steps"):
        title = FIGURES[name][0](data)["title"]
        assert "(one run; no band: a band needs two seeds" in title and "mean over seeds" not in title, title
    text = html.unescape(render(data))
    assert "This page has one run: each line is that run" in text and "same 3 seeds" not in text
    assert "section 7" not in text.split("7. Interventions")[0]  # the pointer to an absent table is gone
    section6 = text.split("6. The gap along training")[1].split("7. Interventions")[0]
    assert section6.count('class="missing"') == 1 and "No data for the 5 figures of this section" in section6
