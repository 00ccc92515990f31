"""The article's sentences that state a direction, a slope, a ratio or a count follow the data: the demo data, then
the same data altered so the true answer flips, and the page must say the other thing."""

import copy
import html
import math

import pytest

from phantomclip.report import collect, demo_sources, render
from phantomclip.report.prose import alpha_beta_steps, gap_along_runs, pearson_and_slope, rare_tokens


@pytest.fixture(scope="module")
def demo():
    return collect(demo_sources())


def test_pearson_and_slope_by_hand():
    # x = 1, 2, 3; y = 2, 4, 7: mean x 2, mean y 13/3; Sxy = (-1)(-7/3) + 0 + (1)(8/3) = 5, Sxx = 2,
    # Syy = 49/9 + 1/9 + 64/9 = 114/9: slope 2.5, r = 5 / sqrt(2 * 114/9) = 0.99340...
    r, slope = pearson_and_slope([1.0, 2.0, 3.0], [2.0, 4.0, 7.0])
    assert slope == pytest.approx(2.5, rel=1e-12)  # float64 sums of three small numbers: a few ulps at most
    assert r == pytest.approx(5 / math.sqrt(2 * 114 / 9), rel=1e-12)
    assert pearson_and_slope([1.0, 2.0], [1.0, 2.0]) is None  # too few points for a direction
    assert pearson_and_slope([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None  # no spread in x


def _alpha_beta(data) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in data.runs:
        for m in r["metrics"]:
            if m.get("mismatch/alpha_mean") is not None and m.get("mismatch/beta_mean") is not None:
                xs.append(m["mismatch/alpha_mean"])
                ys.append(m["mismatch/beta_mean"])
    return xs, ys


def test_alpha_beta_sentence_follows_the_points(demo):
    """The demo's per-step points rise (r = +0.79 over all arms, the issue's measure); the page says so, with the
    numbers of the points drawn, and no longer says they fall. Negate every α: the same points mirrored fall, with
    r and slope of the opposite sign, and the sentence says that instead."""
    xs, ys = _alpha_beta(demo)
    r, slope = pearson_and_slope(xs, ys)
    assert r == pytest.approx(0.79, abs=0.01)
    text = alpha_beta_steps(demo)
    assert f"the {len(xs)} points rise to the right (Pearson r = {r:+.2f}, least-squares slope {slope:+.2f}" in text
    assert "r = +0.81" in text  # the arms shown on opening, the other figure
    page = html.unescape(render(demo))
    assert text in page and "sloping down" not in page and "points fall along" not in page

    flipped = copy.deepcopy(demo)
    for run in flipped.runs:
        for m in run["metrics"]:
            if m.get("mismatch/alpha_mean") is not None:
                m["mismatch/alpha_mean"] = -m["mismatch/alpha_mean"]
    text = alpha_beta_steps(flipped)
    assert f"points fall to the right (Pearson r = {-r:+.2f}, least-squares slope" in text
    assert "the direction the shared rounding gives them" in text
    assert text in html.unescape(render(flipped))

    flat = copy.deepcopy(demo)  # β held constant but for a tiny alternation: no direction
    for run in flat.runs:
        for i, m in enumerate(run["metrics"]):
            if m.get("mismatch/beta_mean") is not None:
                m["mismatch/beta_mean"] = 0.01 * (-1) ** (i + len(run["name"]))
    assert "show no clear direction" in alpha_beta_steps(flat)


def test_rare_token_and_growth_sentences_follow_the_data(demo):
    """Section 3's ratio of the rarest bucket's |β| to the most confident's and section 6's count of runs whose
    |β| grew are computed: swap the data and they say the other thing."""
    assert "carry " in rare_tokens(demo) and "times the mean |β|" in rare_tokens(demo)
    growth = gap_along_runs(demo)
    firsts = [[s for s in g["snapshots"] if "reference" in s] for g in demo.growths]
    factors = [r[-1]["reference"]["beta_abs_mean"] / r[0]["reference"]["beta_abs_mean"] for r in firsts]
    assert all(f > 1.05 for f in factors) and len(factors) == 6  # the demo: all six runs grew
    assert "grew by more than 5% from the first to the last snapshot in 6, shrank by more than 5% in 0" in growth
    assert f"×{min(factors):.2f} to ×{max(factors):.2f}" in growth

    one = copy.deepcopy(demo)  # one run whose last snapshot equals its first: it neither grew nor shrank
    one.growths = one.growths[:1]
    rows = [s for s in one.growths[0]["snapshots"] if "reference" in s]
    rows[-1]["reference"]["beta_abs_mean"] = rows[0]["reference"]["beta_abs_mean"]
    text = gap_along_runs(one)
    assert "In the one run measured here" in text and "stayed within 5% of where it was" in text and "×1.00" in text

    diag = copy.deepcopy(demo)  # the rare tokens' β made tiny: they now carry less than the confident ones
    d = diag.diagnose[-1]
    per = next(iter(d["tokens"]["per_recipe"].values()))
    per["beta"] = [b * 1e-6 if lp is not None and b is not None and math.exp(lp) < 0.01 else b
                   for lp, b in zip(d["tokens"]["logp_engine"], per["beta"])]
    assert "times less than the mean |β|" in rare_tokens(diag)

    empty = copy.deepcopy(demo)
    empty.growths, empty.diagnose, empty.runs = [], [], []
    assert gap_along_runs(empty) == rare_tokens(empty) == alpha_beta_steps(empty) == ""


def test_summary_intervals_carry_a_multiple_comparison_note(demo):
    """The demo compares 11 arms with the baseline, each at 95% on its own: on average 11 * 0.05 = 0.55 exclude zero
    by chance when nothing changes, at least one with probability 1 - 0.95^11 = 0.4312 (43%); 4 were detected."""
    from phantomclip.report.prose import multiple_comparisons_note
    from phantomclip.report.summary import html_summary

    text = html_summary(demo.diagnose, demo.sanity)
    assert ("no correction for the 11 comparisons: if no arm changed anything, on average 0.55 of them would still "
            "exclude zero by chance (at least one with probability 43%), against 4 here") in text
    assert multiple_comparisons_note(1, 1) == ""  # one comparison: the interval means what it says
    assert "probability 10%" in multiple_comparisons_note(2, 0)  # 1 - 0.95^2 = 0.0975
    # with the FP8 line the one note counts both lines: 11 + 12 (6 FP8 arms x final length and phantom-clip rate)
    # = 23 comparisons; 23 * 0.05 = 1.15 (1.2 at two significant digits); 1 - 0.95^23 = 1 - 0.3074 = 0.6926 (69%);
    # 4 detected in section 7 and 9 in section 8 (3 shorter; 2 below and 4 above in phantom-clip rate)
    both = html_summary(demo.diagnose, demo.sanity, demo.fp8)
    assert ("no correction for the 23 comparisons (11 in section 7, 12 in section 8): if no arm changed anything, on "
            "average 1.2 of them would still exclude zero by chance (at least one with probability 69%), against 13 "
            "here") in both
    assert both.count("Each interval is 95% on its own") == 1 and both.count("<li>") == 4
    assert both.split("<li>")[-1].startswith("The FP8 arms ran")  # the note closes the last line with intervals


def test_glossary_defines_every_unit_and_name_the_demo_page_uses(demo):
    """nats, mean |·|, the task names and the loss aggregations (the four once undefined) are in the page's
    glossary box, and so is every task and loss_type the demo runs name in their configuration."""
    from phantomclip.report.glossary import term_id, terms

    page = html.unescape(render(demo))
    box = page.split('<details class="glossary" id="glossary">')[1].split("</details>")[0]
    for term in ("nats", "mean |·|", "neglen (task)", "grpo, dapo, dr_grpo", "pp", "ulp"):
        assert f'<dt id="{term_id(term)}">{term}</dt>' in box, term
    names = " ".join(terms())
    for run in demo.runs:
        assert f"{run['config']['task']} (task)" in names and run["config"]["loss_type"] in names
