"""The article's sentences that state a direction, a slope, a ratio or a count follow the data: the demo data, then
the same data altered so the true answer flips, and the page must say the other thing."""

import copy
import html
import math

import pytest

from phantomclip.report import collect, demo_sources, render
from phantomclip.report.correlation import pearson_and_slope
from phantomclip.report.prose import alpha_beta_steps, gap_along_runs, rare_tokens


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


def _spearman_by_sorting(xs: list[float], ys: list[float]) -> float:
    """ρ = 1 − 6 Σ d² / (n (n² − 1)) with ranks from a sort: the textbook formula, exact without ties (the demo's
    per-step means have none), a second implementation beside prose.spearman's Pearson-of-ranks."""
    def rank(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0] * len(v)
        for r, i in enumerate(order):
            out[i] = r + 1
        return out

    rx, ry, n = rank(xs), rank(ys), len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def _set_points(data, f) -> None:
    """Each run's per-step (α, β) replaced by f(α, β, run index, row index)."""
    for i, run in enumerate(data.runs):
        for j, m in enumerate(run["metrics"]):
            if m.get("mismatch/alpha_mean") is not None and m.get("mismatch/beta_mean") is not None:
                m["mismatch/alpha_mean"], m["mismatch/beta_mean"] = f(m["mismatch/alpha_mean"],
                                                                      m["mismatch/beta_mean"], i, j)


def test_alpha_beta_sentence_reads_the_bulk_not_a_few_far_points(demo):
    """The demo's 1060 per-step points: Pearson's r over all of them is +0.79 (the issue's figure), set by a few far
    points; the sentence reads the points inside the figure's axes by rank (Spearman ρ, computed here by the
    textbook formula) with its 95% interval: ρ = −0.10 [−0.17, −0.04] excludes zero, so it is a clear (small) fall,
    never "no clear direction", and 10 of 12 arms falling is a sign test's p = 0.039. Altered data: the same points
    with 12 far points added along a rising line (Pearson over all turns positive and large) still read by rank;
    points on β = −α read as falling, the shared rounding's direction; on β = α as rising."""
    from phantomclip.report.page import FIGURES

    xs, ys = _alpha_beta(demo)
    r, _ = pearson_and_slope(xs, ys)
    assert len(xs) == 1060 and r == pytest.approx(0.79, abs=0.01)
    fig = FIGURES["alpha_beta_steps"][0](demo)
    (x0, x1), (y0, y1) = fig["layout"]["xaxis"]["range"], fig["layout"]["yaxis"]["range"]
    inside = [(x, y) for x, y in zip(xs, ys) if x0 <= x <= x1 and y0 <= y <= y1]
    rho = _spearman_by_sorting([p[0] for p in inside], [p[1] for p in inside])
    assert -0.11 < rho < -0.10 and len(inside) == 991
    # Fisher's z with Fieller's 1.06: atanh(ρ) ± 1.96 √(1.06 / 988), by hand: [−0.166, −0.039], clear of zero
    z, half = math.atanh(rho), 1.959964 * math.sqrt(1.06 / 988)
    low, high = math.tanh(z - half), math.tanh(z + half)
    assert -0.17 < low < -0.16 and -0.04 < high < -0.03
    text = alpha_beta_steps(demo)
    assert text.startswith(f"Over the 991 points inside these axes, mean β shows a clear small fall against mean α "
                           f"(Spearman's rank correlation ρ = {rho:+.2f}, 95% interval [{low:+.2f}, {high:+.2f}]); "
                           "of the 12 arms, 2 rise and 10 fall on their own points (two-sided sign test p = 0.039: "
                           "more fall than chance would give)")  # 2 * (1 + 12 + 66) / 4096 = 0.0386
    assert "The 69 points outside the axes are left out: with them Pearson's r reads +0.79" in text
    assert "the direction the shared rounding gives them, and a small one" in text
    assert "no clear direction" not in text and "nothing else" not in text and text in html.unescape(render(demo))
    note = fig["layout"]["annotations"][0]["text"]  # 371 of the 991 belong to the 5 arms drawn on opening
    assert note == (f"Spearman ρ = {rho:+.2f} [{low:+.2f}, {high:+.2f}] over the 991 points inside the axes, all "
                    "arms (371 shown on opening)")

    far = copy.deepcopy(demo)  # 12 far points along β = α, 10 to 60 interquartile ranges out
    far.runs[0]["metrics"] = far.runs[0]["metrics"] + [
        {**far.runs[0]["metrics"][-1], "step": 100 + k, "mismatch/alpha_mean": 0.5 * (k + 1),
         "mismatch/beta_mean": 0.5 * (k + 1)} for k in range(12)]
    fx, fy = _alpha_beta(far)
    assert pearson_and_slope(fx, fy)[0] > 0.9  # a Pearson-based sentence would say 'rise'
    text = alpha_beta_steps(far)
    assert "a direction a few far points set, not the bulk" in text

    down = copy.deepcopy(demo)  # β = −α plus a small alternation: falls, as the shared rounding alone would make it
    _set_points(down, lambda a, b, i, j: (a, -a + 1e-4 * (-1) ** j))
    text = alpha_beta_steps(down)
    assert "a clear large fall" in text and "the direction the shared rounding gives them, and a large one" in text
    up = copy.deepcopy(demo)
    _set_points(up, lambda a, b, i, j: (a, a + 1e-4 * (-1) ** j))
    text = alpha_beta_steps(up)
    assert "a clear large rise" in text and "opposite of the shared rounding's direction" in text
    assert "of the 12 arms, 12 rise and 0 fall on their own points (two-sided sign test p = 0.00049" in text

    one = copy.deepcopy(demo)  # one run: no count of arms
    one.runs = one.runs[:1]
    text = alpha_beta_steps(one)
    assert text.startswith(f"Over the {len(one.runs[0]['metrics'])} points") and "arms" not in text


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
    by chance when nothing changes; 4 were detected. With the FP8 line: 11 + 10 = 21 comparisons (6 FP8 arms x
    final length and phantom-clip rate, less fp8,shadow-ratio's and fp8,force-r1's phantom-clip rate, 0 by
    construction), 21 * 0.05 = 1.05 (1.1 at two significant digits; 1.05 is 1.0500000000000000444 in binary),
    4 + 7 detected (3 shorter; 4 above in phantom-clip rate)."""
    from phantomclip.report.prose import multiple_comparisons_note
    from phantomclip.report.summary import html_summary

    text = html_summary(demo.diagnose, demo.sanity)
    assert "These 11 intervals are 95% each, uncorrected: about 0.55 would exclude zero by chance; 4 do." in text
    assert multiple_comparisons_note(1, 1) == ""  # one comparison: the interval means what it says
    assert "probability 10%" in multiple_comparisons_note(2, 0)  # 1 - 0.95^2 = 0.0975
    both = html_summary(demo.diagnose, demo.sanity, demo.fp8)
    assert both.split("<li>")[-1].startswith("These 21 intervals are 95% each, uncorrected: about 1.1 would exclude "
                                             "zero by chance; 11 do.")
    assert both.count("<li>") == 5


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


def test_the_rare_bucket_ratio_of_section_6_is_every_runs_not_one_runs(demo):
    """Section 6 quoted 340.7, one run's ratio of the rarest bucket's mean |β| to the most confident's at the first
    snapshot; the six runs give 148.3 to 340.7. The sentence gives the median and the range over every distinct
    first snapshot, recomputed here from each file: the demo's none-seedN and force-r1-seedN start from the same
    weights on the same tokens, so 6 runs hold 3 distinct measurements, each counted once (it said "over 6 runs",
    each counted twice); with one run it says so."""
    ratios = []
    for g in demo.growths:
        first = next(s for s in g["snapshots"] if "reference" in s)["reference"]["bucket_beta_abs_mean"]
        filled = [m for m in first if m]
        ratios.append(filled[0] / filled[-1])
    assert len(ratios) == 6 and round(max(ratios), 1) == 340.7 and round(min(ratios), 1) == 148.3
    distinct = sorted(set(ratios))
    assert len(distinct) == 3  # each seed's first snapshot twice
    text = gap_along_runs(demo)
    assert (f"carried {distinct[1]:.1f} (median; {distinct[0]:.1f} to {distinct[-1]:.1f} over 3 distinct first "
            "snapshots) times the mean |β| of tokens at 0.99–1 (6 runs; runs that start from the same seed share "
            "their first snapshot, counted once)") in text
    one = copy.deepcopy(demo)
    one.growths = one.growths[:1]
    assert "(one measurement) times the mean |β|" in gap_along_runs(one) and "counted once" not in gap_along_runs(one)


def test_growth_table_shows_the_token_counts_beside_every_mean(demo):
    """The 'own' rows rest on the tokens each snapshot's policy sampled: force-r1-seed1's last own snapshot (step 25)
    holds 8 tokens against 256 at step 0 (read from its file here); every row shows both counts."""
    from phantomclip.report.growth_panel import html_growth_table

    table = html_growth_table(demo.growths)
    g = next(g for g in demo.growths if g["run"].endswith("force-r1-seed1"))
    own = [s["own"]["tokens"] for s in g["snapshots"] if "own" in s]
    assert (own[0], own[-1]) == (256, 8)
    assert "<td>force-r1-seed1</td><td>own</td><td>0 → 25</td><td>256 → 8</td>" in table
    assert table.count("<tr><td>") == 12 and table.count(" → ") == 24  # steps and counts on each of 12 rows


def test_alpha_beta_sentence_no_direction_when_the_interval_holds_zero_and_none_from_few_points(demo):
    """Constructed points: 40 points of one run with β independent of α (β alternates with the row, α rises), so ρ
    is about 0 and its interval holds zero: 'no detectable direction', no conclusion about the rounding. Then 4
    points (a 4-step page): ρ is given and no direction is read."""
    flat = copy.deepcopy(demo)
    flat.runs = flat.runs[:1]
    rows = [m for m in flat.runs[0]["metrics"] if m.get("mismatch/alpha_mean") is not None][:40]
    for j, m in enumerate(rows):  # α = j; β = +1, −1, −1, +1 repeating: ranks of β carry no trend in j
        m["mismatch/alpha_mean"], m["mismatch/beta_mean"] = 1e-3 * j, 1e-3 * (1, -1, -1, 1)[j % 4]
    flat.runs[0]["metrics"] = rows
    text = alpha_beta_steps(flat)
    assert "mean β shows no detectable direction against mean α" in text and "95% interval [-" in text
    assert "No direction is detected at this number of points" in text and "clear" not in text

    few = copy.deepcopy(flat)
    few.runs[0]["metrics"] = rows[:4]
    for j, m in enumerate(few.runs[0]["metrics"]):  # a perfect rise over 4 points: still no conclusion
        m["mismatch/alpha_mean"], m["mismatch/beta_mean"] = 1e-3 * j, 2e-3 * j
    text = alpha_beta_steps(few)
    assert text == ("Only 4 points lie inside these axes (Spearman's rank correlation ρ = +1.00): too few to read a "
                    "direction from, so none is read here.")


def test_spearman_interval_sign_test_and_cohen_words_by_hand():
    from phantomclip.report.correlation import cohen_size, sign_test_two_sided, spearman_interval

    # n = 13: half = 1.96 * sqrt(1.06 / 10) = 0.63812; atanh(0.5) = 0.549306: tanh(-0.08881) = -0.0886,
    # tanh(1.18742) = (e^2.37485 − 1) / (e^2.37485 + 1) = 9.7493 / 11.7493 = 0.8298 (hand-worked to 4 digits,
    # hence the 1e-4)
    low, high = spearman_interval(0.5, 13)
    assert low == pytest.approx(-0.0886, abs=1e-4) and high == pytest.approx(0.8298, abs=1e-4)
    assert spearman_interval(0.5, 3) is None and spearman_interval(1.0, 50) is None
    assert sign_test_two_sided(10, 2) == pytest.approx(2 * 79 / 4096, rel=1e-15)  # C(12,10..12) = 66 + 12 + 1
    assert sign_test_two_sided(3, 3) == 1.0 and sign_test_two_sided(0, 0) == 1.0
    assert [cohen_size(r) for r in (0.05, -0.1, 0.29, -0.3, 0.5)] == ["negligible", "small", "small", "medium",
                                                                      "large"]


def test_moe_line_uses_the_paired_interval_and_names_the_random_model(demo):
    """The demo's r3 − none in first-steps mean |β| by seed: −0.0376, −0.0176, −0.0544, mean −0.0366, s = 0.0184,
    half-width 4.303 · s / √3 = 0.0457: [−0.082, +0.009] holds zero, so no cut is claimed. Moved so that every seed
    of r3 is the baseline's less 0.03 ± 0.001, the interval excludes zero and the line says a detectable cut; the
    model is named as the random 2-layer model it is."""
    from phantomclip.report.moe_panel import moe_result, summary_line

    line, compared, found = summary_line(demo)
    assert "On tiny-moe, a random 2-layer Qwen3-MoE," in line and (compared, found) == (1, 0)
    assert "no detectable difference at 95% (paired 3 seeds: -0.037 [-0.082, +0.009])" in line
    assert "by the paired interval, no detectable difference at 95%" in moe_result(demo)

    moved = copy.deepcopy(demo)
    runs = moved.moe[-1]["runs"]
    base = {r["seed"]: r["beta_abs_mean_start"] for r in runs if r["run"] == "none"}
    for r in runs:
        if r["run"] == "r3":
            r["beta_abs_mean_start"] = base[r["seed"]] - 0.03 + 0.001 * (r["seed"] - 1)
    line, compared, found = summary_line(moved)
    assert "<b>a detectable cut (paired 3 seeds: -0.030 [" in line and (compared, found) == (1, 1)


def test_a_page_with_one_run_says_nothing_of_fp8_or_the_demo(demo):
    """A reader's page with one run and no FP8 or MoE data: no 'FP8 engine on this page is emulated', no word of
    the demo's MoE model, and the MoE hint says its script is not in the pip package; the demo page keeps both."""
    from phantomclip.report.moe_panel import EXPERIMENT
    from phantomclip.report.prose import fp8_emulated, moe_model

    one = copy.deepcopy(demo)
    one.runs, one.fp8, one.fp8_runs, one.moe, one.moe_runs = one.runs[:1], [], [], [], []
    one.diagnose = [d for d in one.diagnose if not d.get("routing")]
    assert fp8_emulated(one) == "" and moe_model(one) == ""
    page = html.unescape(render(one))
    assert "emulated on a CPU, not run on an FP8 GPU" not in page and "random 2-layer" not in page
    assert "pip does not ship bench/" in EXPERIMENT and "pip does not ship bench/" in page
    full = html.unescape(render(demo))
    assert "The FP8 engine on this page is emulated on a CPU" in full
    assert "The MoE model of this page is tiny-moe, a random 2-layer Qwen3-MoE" in full


def test_a_readers_single_run_has_one_name_in_every_figure(tmp_path):
    """A reader's run directory 'run1' (intervention none, in no experiment) and its `trace --run` JSON: the training
    figures and the growth figures both call it run1, never 'none' in one and 'run1' in the other; an experiment's
    seeds keep their arm (the demo's growth runs none/seed-k are the training figures' 'none')."""
    import json
    import shutil

    from phantomclip.report.growth_panel import arm_and_seed, fig_growth
    from phantomclip.report.training_panel import per_step

    demo = demo_sources()[0]
    shutil.copytree(demo / "sanity" / "none" / "seed-0", tmp_path / "run1")
    growth = json.loads((demo / "growth" / "none-seed0.json").read_text())
    (tmp_path / "growth.json").write_text(json.dumps({**growth, "run": str(tmp_path / "run1")}))
    data = collect([tmp_path])
    assert [r["config"]["intervention"] for r in data.runs] == ["none"]
    training = per_step(data, "completion/length_mean", "t", "tokens", carry=True)
    assert [t["name"] for t in training["data"] if t.get("name")] == ["run1 (1 seed)"]
    growth_names = {t["name"] for t in fig_growth(data.growths)["data"]}
    assert growth_names == {"run1"}
    assert arm_and_seed({"run": "/x/none/seed-2"}) == ("none", 2) and arm_and_seed({"run": "/x/run1"}) == ("run1", 0)
