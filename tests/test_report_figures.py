"""What the article's figures draw, read from their Plotly specs (no browser): every measured site on the depth
axes, log axes labelled inside the data's range, legends that count what they draw, small data that no axis hides,
titles that match the number of seeds, one note per empty section."""

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
