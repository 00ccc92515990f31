"""The reader's post-mortem (section 6 and the summary): a change between two steps is called a rise or a fall only
where the 95% interval of the difference of the two shares excludes zero, the y axis starts at zero, the summary
names the step its figures are from, the lead-in says which weights scored the steps, and the data line counts
every step's tokens. Constructed on the demo's diagnose file with a `postmortem` block added."""

import copy
import html
import json

import pytest

from phantomclip.diagnose.postmortem_text import change_sentence, change_test
from phantomclip.maths.proportions import difference_interval, wilson_interval
from phantomclip.report import collect, demo_sources, render
from phantomclip.report.growth_panel import fig_postmortem
from phantomclip.report.sources import ReportData
from phantomclip.report.summary import html_summary, source_line


def _rows(shares: list[tuple[int, int]]) -> list[dict]:
    """Steps 1, 2, ... with k of n tokens outside the trust region, each scored at its own weights (lag 0)."""
    return [{"step": i + 1, "tokens": n, "outside_trust_region": k / n, "phantom_share_at_alpha0": None, "lag": 0,
             "checkpoint": "model"} for i, (k, n) in enumerate(shares)]


@pytest.fixture(scope="module")
def base():
    return collect(demo_sources()).diagnose[-1]


def _data(base: dict, shares: list[tuple[int, int]], checkpoints: str | None = None) -> ReportData:
    doc = copy.deepcopy(base)
    doc["postmortem"] = {"steps": _rows(shares), "recipe": "fp32", "checkpoints": checkpoints}
    return ReportData(diagnose=[doc])


def test_two_shares_intervals_match_published_values():
    """Newcombe (1998, Stat Med 17: 873), example (a): 56/70 against 48/80, method 10: 0.0524 to 0.3339; Wilson's
    interval for 81/263 in Newcombe's companion paper (Stat Med 17: 857): 0.2553 to 0.3662, and for 0/10: 0 to
    0.2775 (the tables' 4 decimals, hence abs=5e-5)."""
    d, low, high = difference_interval(48, 80, 56, 70)
    assert d == pytest.approx(0.2, abs=1e-12) and low == pytest.approx(0.0524, abs=5e-5)
    assert high == pytest.approx(0.3339, abs=5e-5)
    assert wilson_interval(81, 263) == pytest.approx((0.2553, 0.3662), abs=5e-5)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=5e-5)


def test_the_issues_noise_is_no_detectable_change_and_a_true_rise_is_a_clear_one(base):
    """35 of 1053 tokens at step 1 against 39 of 1008 at step 3 (the issue's run, p = 0.55) is noise: the interval
    holds zero and the sentence, the figure's note and the page say "no detectable change", never "rose"; 80 of 1008
    at step 3 is a clear rise; 10 of 1008 a clear fall."""
    noise = _rows([(35, 1053), (36, 1012), (39, 1008)])
    t = change_test(noise)
    assert (t["k1"], t["n1"], t["k2"], t["n2"]) == (35, 1053, 39, 1008) and t["low"] < 0 < t["high"]
    said = change_sentence(noise)
    assert said.startswith("the share outside the trust region went from 3.32% (35 of 1053 tokens) at step 1 to "
                           "3.87% (39 of 1008) at step 3: no detectable change (difference +0.55 pp, 95% interval "
                           "[-1.08, +2.20] pp") and "rose" not in said and "3 steps, 3073 tokens" in said
    fig = fig_postmortem(_data(base, [(35, 1053), (36, 1012), (39, 1008)]).diagnose)
    assert fig["layout"]["annotations"][0]["text"] == "no detectable change, step 1 to 3 (+0.55 pp, 95% [-1.1, +2.2])"
    assert fig["layout"]["yaxis"]["rangemode"] == "tozero"  # not an axis of 3.3-3.9% that makes noise steep
    bars = fig["data"][0]["error_y"]
    lo, hi = wilson_interval(35, 1053)
    assert bars["arrayminus"][0] == pytest.approx(100 * (35 / 1053 - lo), rel=1e-12)
    assert bars["array"][0] == pytest.approx(100 * (hi - 35 / 1053), rel=1e-12)

    rise = change_sentence(_rows([(35, 1053), (80, 1008)]))
    assert ": a clear rise (difference +4.61 pp" in rise
    assert ": a clear fall (difference -2.33 pp" in change_sentence(_rows([(35, 1053), (10, 1008)]))


def test_the_post_mortem_page_names_its_step_its_weights_and_every_steps_tokens(base):
    """Without checkpoints the lead-in says every step was scored at one set of weights (never "against the
    checkpoint of each step"); the summary's first line names the last recorded step, not "Before training"; the
    data line counts the 3073 tokens of the three steps the figure draws, with the last step's 1008 beside them."""
    data = _data(base, [(35, 1053), (36, 1012), (39, 1008)])
    page = html.unescape(render(data))
    assert "against the checkpoint of each step" not in page
    assert "No checkpoints were given for this run: every step was scored at one set of weights (model)" in page
    summary = html_summary(data.diagnose, [])
    assert "At step 3, the last recorded step of your run, a fp32 trainer" in summary
    assert "Before training" not in summary
    line = source_line("diagnose", data.diagnose, [])
    assert "3073 tokens over 3 recorded steps (step 3's tables: 1008)" in line

    given = _data(base, [(35, 1053), (39, 1008)], checkpoints="ckpts")
    page = html.unescape(render(given))
    assert "Here each step was scored at its own checkpoint, the weights that sampled it." in page
    assert "No checkpoints were given" not in page
    json.dumps(fig_postmortem(given.diagnose))  # the figure is plain JSON
