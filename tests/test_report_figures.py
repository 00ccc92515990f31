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


def _outcomes(run: dict) -> tuple[int, int, int, int]:
    """(advantage 0, gradient flows, phantom-clipped, clipped with α alone too) over a run's logged tokens, by the
    rule by hand: a clipped token is phantom when the clip would not fire on α alone (A > 0 and e^α > 1 + ε, or
    A < 0 and e^α < 1 − ε; ε = 0.2 both sides in the demo's runs)."""
    zero = flows = phantom = real = 0
    for t in run["tokens"]:
        for a, adv, clipped in zip(t["alpha"], t["advantage"], t["clipped"]):
            if adv == 0:
                zero += 1
            elif not clipped:
                flows += 1
            elif (adv > 0 and math.exp(a) > 1.2) or (adv < 0 and math.exp(a) < 0.8):
                real += 1
            else:
                phantom += 1
    return zero, flows, phantom, real


def test_the_token_figure_draws_a_phantom_clip_and_counts_zero_advantage_apart(demo):
    """The demo's logged tokens: the sanity baseline's (none/seed-0, steps 1-5) hold no clipped token; the FP8
    experiment's bf16 baseline (the same contract: fp32 trainer, bf16 engine) holds 1152, of which 512 have advantage
    exactly 0, 628 carry a gradient, 5 are phantom-clipped and 7 clipped on α alone too (counted by hand,
    _outcomes). The figure draws that run, its legend counts each outcome, the zero-advantage tokens are counted in
    the caption instead of drawn, and a note on the plot points at a phantom-clipped token. Without those tokens
    the figure falls back to the sanity baseline and says at which step its metrics first record a clip (7)."""
    from phantomclip.report.figures import fig_alpha_beta_tokens

    fp8_base = next(r for r in demo.fp8_runs if r.get("tokens"))
    assert fp8_base["arm"] == "none" and fp8_base["name"] == "none/seed-0"
    assert _outcomes(fp8_base) == (512, 628, 5, 7)
    fig = fig_alpha_beta_tokens(demo)
    names = [t["name"] for t in fig["data"]]
    assert names == ["gradient flows (628)", "phantom-clipped (5)", "clipped (α alone too) (7)"]
    assert fig["title"] == "α against β per token, run 'none/seed-0' of experiment fp8, steps 1–5"
    assert "Not drawn: 512 tokens of advantage 0" in fig["caption"]
    phantom = fig["data"][1]
    (arrow,) = fig["layout"]["annotations"]
    k = max(range(5), key=lambda i: abs(phantom["y"][i]))
    assert (arrow["x"], arrow["y"]) == (phantom["x"][k], phantom["y"][k]) and "phantom-clipped" in arrow["text"]
    assert fig["source"] == ("runs", [fp8_base])

    sanity_only = copy.copy(demo)
    sanity_only.fp8_runs = []
    fig = fig_alpha_beta_tokens(sanity_only)
    run = next(r for r in demo.runs if r.get("tokens"))
    assert _outcomes(run) == (1024, 168, 0, 0)
    assert [t["name"] for t in fig["data"]] == ["gradient flows (168)", "phantom-clipped (0)",
                                                "clipped (α alone too) (0)"]
    assert next(m for m in run["metrics"] if m["clip/rate"] > 0)["step"] == 7
    assert "No token of these steps was clipped" in fig["caption"]
    assert "The first clip in this run's metrics is at step 7" in fig["caption"]
    assert "--token-log-steps 7" in fig["caption"] and "annotations" not in fig["layout"]


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
    assert "outside them" not in fig["caption"] and "marker: the seed" not in fig["caption"]
    for name in ("training", "phantom_steps", "beta_steps"):
        fig = FIGURES[name][0](data)
        assert fig["caption"].startswith("One run; no band: a band needs two seeds"), fig["caption"]
        assert "mean over seeds" not in fig["caption"]
        assert fig["layout"]["xaxis"]["dtick"] == 1 and fig["layout"]["xaxis"]["tickformat"] == "d"  # 6 steps
    text = html.unescape(render(data))
    assert "This page has one run: each line is that run" in text and "same 3 seeds" not in text
    assert "section 7" not in text.split("7. Interventions")[0]  # the pointer to an absent table is gone
    section6 = text.split("6. The gap along training")[1].split("7. Interventions")[0]
    assert section6.count('class="missing"') == 1 and "No data for the 5 figures of this section" in section6


def test_one_seeds_spike_does_not_set_the_beta_axis(demo):
    """The demo's |β| per step: 1060 seed values, 99th percentile 0.2788 (the value at index int(0.99 · 1059) =
    1048 of the sorted list), largest 1.205 (no-clip, step 27), over twice it: the axis stops at 1.5 × 0.2788 =
    0.418, and the 5 no-clip values above it (steps 18, 20, 24, 26, 27) are marked on the top edge and counted in the
    title. Without the no-clip runs nothing is cut."""
    from phantomclip.report.page import FIGURES
    from phantomclip.report.training_panel import step_values

    runs = {}
    for r in demo.runs:
        runs.setdefault(r["config"]["intervention"], []).append(r["metrics"])
    values = [(v, arm, i + 1) for arm, rows in runs.items()
              for i, vs in enumerate(step_values(rows, "mismatch/beta_abs_mean", False)) for v in vs]
    xs = sorted(v for v, _, _ in values)
    assert len(xs) == 1060 and xs[-1] == pytest.approx(1.205, abs=5e-4) and xs[1048] == pytest.approx(0.2788, abs=5e-4)
    fig = FIGURES["beta_steps"][0](demo)
    top = fig["layout"]["yaxis"]["range"][1]
    assert top == pytest.approx(1.5 * xs[1048], rel=1e-12)
    above = sorted((step, arm) for v, arm, step in values if v > top)
    assert above == [(18, "no-clip"), (20, "no-clip"), (24, "no-clip"), (26, "no-clip"), (27, "no-clip")]
    marks = [t for t in fig["data"] if t.get("marker", {}).get("symbol") == "triangle-up"]
    assert [(x, t["legendgroup"]) for t in marks for x in t["x"]] == above and all(y == top for t in marks
                                                                                  for y in t["y"])
    assert "The axis stops at 0.418" in fig["caption"] and "5 seed values above it" in fig["caption"]
    assert "(the largest 1.2, no-clip at step 27)" in fig["caption"]
    calm = copy.copy(demo)
    calm.runs = [r for r in demo.runs if r["config"]["intervention"] != "no-clip"]
    fig = FIGURES["beta_steps"][0](calm)
    assert "range" not in fig["layout"]["yaxis"] and "axis stops" not in fig["caption"]


def test_bands_of_two_arms_on_opening_and_a_button_for_the_rest(demo):
    """Five arms are shown when the page opens; their five translucent bands overlapped into one area. The baseline
    and the next shown arm keep a visible band, the other bands are drawn transparent (so the legend still toggles
    line and band together), and the page puts the button that shows them under the figure."""
    from phantomclip.report.page import FIGURES, render

    for name in ("training", "phantom_steps", "beta_steps"):
        fig = FIGURES[name][0](demo)
        bands = [t for t in fig["data"] if t.get("fill") == "toself"]
        drawn = {t["legendgroup"] for t in bands if t["opacity"] > 0}
        assert drawn == {"none", "force-r1"} and fig["band_toggle"], name
        assert "drawn for none and force-r1 (the button below shows every arm's)" in fig["caption"]
    # section 5's three, section 8's two (FP8 rollouts), section 9's one (three arms shown, two bands)
    assert render(demo).count('class="band-toggle"') == 3 + 2 + 1


def test_no_zero_on_a_log_axis_and_the_scatter_fits_its_bulk(demo):
    """'Share outside vs ε': a share of 0 is a gap (Plotly drew it as a vertical line to the axis's edge), and the
    title says from which ε each recipe has none outside. The per-step α-β scatter: axes at Tukey's far-out fences
    (3 IQR past the quartiles), every point counted; the middle 80% of the points now spans a third of each axis,
    where a 1-99 percentile range left it 13% x 10%."""
    from phantomclip.report.page import FIGURES

    fig = FIGURES["outside_vs_eps"][0](demo)
    for t in fig["data"]:
        assert all(y is None or y > 0 for y in t["y"])
        if None in t["y"]:
            first = t["x"][t["y"].index(None)]
            assert all(y is None for y in t["y"][t["y"].index(None):])  # the share only falls as ε grows
            assert f"{first:.2f} for {t['name']}" in fig["caption"]
    fig = FIGURES["alpha_beta_steps"][0](demo)
    xs = [x for t in fig["data"] for x in t["x"]]
    ys = [y for t in fig["data"] for y in t["y"]]
    (x0, x1), (y0, y1) = fig["layout"]["xaxis"]["range"], fig["layout"]["yaxis"]["range"]
    outside = sum(not (x0 <= x <= x1 and y0 <= y <= y1) for x, y in zip(xs, ys))
    assert f"{outside} of {len(xs)} points lie outside them" in fig["caption"] and 0 < outside < 0.1 * len(xs)
    for vs, (lo, hi) in ((sorted(xs), (x0, x1)), (sorted(ys), (y0, y1))):
        middle = vs[int(0.9 * (len(vs) - 1))] - vs[int(0.1 * (len(vs) - 1))]
        assert middle / (hi - lo) > 0.3, middle / (hi - lo)


def test_the_answer_of_diagnose_leads_the_page_when_the_result_has_one(demo):
    """A diagnose result with its `answer` block (answer.answer of the demo result: 'at risk', 0.79% outside, one
    change in phantomclip's own flags) puts that answer above the summary, in the terminal's words
    (answer.answer_lines); the demo files, written before the block existed, draw no answer box."""
    from phantomclip.answer.decide import answer, answer_lines
    from phantomclip.report.page import render

    assert 'id="answer"' not in render(demo)
    given = copy.copy(demo)
    result = copy.deepcopy(demo.diagnose[-1])
    result["answer"] = answer(result)
    result["answer"]["changes"].append({"setting": "<b>x</b>", "effect": "a & b"})  # data, escaped as text
    given.diagnose = [*demo.diagnose[:-1], result]
    text = render(given)
    box = text.split('<section class="answer" id="answer">')[1].split("</section>")[0]
    assert text.index('id="answer"') < text.index('id="summary"')
    lines = answer_lines(result["answer"])  # the terminal's lines: 'answer: AT RISK: <reason>', ...
    assert lines[0].startswith("answer: AT RISK: ") and "AT RISK" in box
    assert html.escape(lines[0].split("AT RISK: ")[1], quote=False) in box
    for ch in result["answer"]["changes"]:
        assert (f"<td><pre><code>{html.escape(ch['setting'])}</code></pre></td><td>{html.escape(ch['effect'])}</td>"
                in box)
    assert "What to change (phantomclip flags), fewest tokens touched first" in box and "<b>x</b>" not in box
    assert "ε 0.2/0.2" in box and "fp32 trainer against a bf16 local engine" in box


def test_titles_are_short_captions_say_the_rest_and_every_table_names_its_data(demo):
    """A reader's pass: every figure's title has at most 15 words (they ran to 67) and the rest is its caption; the
    per-step figures tick whole steps only; every table of the page is followed by its Data: line (the file, the
    engine or runs, the model, the machine); and a lead-in that ends in ':' goes with its figure when the data is
    missing ('How the share ... depends on ε:' dangled over a note on a small page)."""
    import re

    from phantomclip.report import ReportData, render
    from phantomclip.report.page import FIGURES, USER_ONLY
    from phantomclip.report.plots import TITLE_WORDS

    for name, (draw, _) in FIGURES.items():
        fig = draw(demo)
        if name in USER_ONLY:  # only a reader's own data draws it (tests/test_rollouts.py draws a post-mortem)
            assert fig is None
            continue
        assert len(fig["title"].split()) <= TITLE_WORDS == 15 and fig["caption"], (name, fig["title"])
        if fig["layout"]["xaxis"]["title"]["text"] == "step":
            axis = fig["layout"]["xaxis"]
            assert axis["tickformat"] == "d" and axis["dtick"] == int(axis["dtick"]) >= 1, (name, axis)
    text = re.sub(r"<script>.*?</script>", "", render(demo), flags=re.S)  # the page's HTML, not its JavaScript
    tables = [m.start() for m in re.finditer(r"<table", text)]
    assert len(tables) == 6  # sanity, growth, FP8, route split, moe-r3, your framework
    for start in tables:
        rest = text[start:]
        ends = [i for i in (rest.find("<h2", 1), rest.find("<table", 1), rest.find('<figure', 1)) if i > 0]
        assert '<p class="source">Data: ' in rest[: min(ends, default=len(rest))], rest[:200]
    lead = "How the share of tokens outside the trust region depends on ε:"
    assert lead in html.unescape(text)
    alone = ReportData(runs=demo.runs)  # no diagnose JSON: the figure is a note, and its lead-in goes with it
    page = html.unescape(render(alone))
    assert lead not in page and "phantomclip diagnose --json diagnose.json" in page


LEAD_INS = ("Mean |β| by the engine's probability of the token:",
            "with the trust region shaded:",
            "How the share of tokens outside the trust region depends on ε:",
            "Per token of the first steps of a run, α against β",
            "Per step, the mean α against the mean β of each run:",
            "Each arm against the baseline, seed by seed:",
            "Each arm against the bf16 engine, seed by seed:",
            "Per step, drawn as in section 5")
"""sentences that describe the figure or table after them: on a page without its data they would dangle over the
note that names the missing command."""


def test_no_lead_in_dangles_over_a_note_and_the_theory_stays(demo):
    """The demo page keeps every lead-in; a page with no data, and one with a reader's single run, keep none whose
    figure is a note (the paragraph before each note is prose that stands alone, never one ending in ':'), while the
    sections' explanations stay."""
    import re

    from phantomclip.report import ReportData, render

    full = html.unescape(render(demo))
    assert all(lead in full for lead in LEAD_INS)
    for data in (ReportData(), ReportData(runs=demo.runs[:1])):
        page = html.unescape(render(data))
        notes = [m.start() for m in re.finditer(r'<p class="missing"', page)]
        assert notes
        for at in notes:
            before = re.findall(r"<p>((?:(?!<p>).)*?)</p>\s*$", page[:at], flags=re.S)
            assert not before or not before[-1].rstrip().endswith(":"), before[-1][-200:]
        shown = [lead for lead in LEAD_INS if lead in page]
        # a single run draws the closed loop's per-step α-β figure: its lead-in stays, the others go with their notes
        assert shown == (["Per step, the mean α against the mean β of each run:"] if data.runs else []), shown
        assert "So the rare tokens should carry the large ratios." in page  # section 3's reasoning needs no data
        assert "does not mean there is none" not in page  # the interval rule goes with the table it reads
