"""Section 8 of the article, FP8 rollouts, from the bundled FP8 experiment (`experiment fp8 --seeds 3`, 7 arms x 3
seeds on the bundled model, copied from results/fp8-bundled into the demo by scripts/make_demo_data.py --fp8): its
summary is its own kind, its runs stay out of section 5, its table's cells are the summary's numbers, and its
sentence says only what the intervals allow."""

import copy
import html
import json
import shutil
from pathlib import Path

import pytest

from phantomclip.report import ReportData, collect, demo_sources, render
from phantomclip.report.interventions_table import html_fp8_table
from phantomclip.report.page import FIGURES
from phantomclip.report.plots import arm_colour
from phantomclip.report.prose import fp8_result
from phantomclip.report.sources import kind_of
from phantomclip.report.training_panel import FP8_SHOWN_ARMS

RESULTS = Path(__file__).resolve().parents[1] / "results" / "fp8-bundled"
ARMS = ["none", "fp8", "fp8,tis", "fp8,mis", "fp8,icepop", "fp8,shadow-ratio", "fp8,force-r1"]


@pytest.fixture(scope="module")
def demo():
    return collect(demo_sources())


def _arm(summary: dict, run: str) -> dict:
    return next(a for a in summary["arms"] if a["run"] == run)


def test_the_fp8_summary_is_its_own_kind_and_its_runs_are_kept_apart(demo):
    """The demo holds the sanity experiment (12 arms) and the FP8 one (7): the FP8 summary is filed as 'fp8', not
    drawn as the interventions table; its 21 runs are named by their arm there ('fp8,tis', whose intervention is
    'tis', and 'fp8', whose intervention is 'none') and none of them is among section 5's 36."""
    assert len(demo.sanity) == 1 and demo.sanity[0]["experiment"] == "sanity"
    assert len(demo.fp8) == 1 and [a["run"] for a in demo.fp8[0]["arms"]] == ARMS
    assert len(demo.runs) == 36 and len(demo.fp8_runs) == 21
    assert [r["arm"] for r in demo.fp8_runs] == [a for a in ARMS for _ in range(3)]  # the experiment's order
    assert all(Path(r["_path"]).parts[-3] == "fp8" for r in demo.fp8_runs)
    assert not any(Path(r["_path"]).parts[-3] == "fp8" for r in demo.runs)
    summary = {k: v for k, v in demo.fp8[0].items() if k != "_path"}
    assert kind_of(Path("s.json"), summary) == "fp8"
    assert kind_of(Path("s.json"), {**summary, "experiment": "sanity"}) == "sanity"
    assert kind_of(Path("s.json"), {**summary, "experiment": "epsilon"}) == "sanity"  # an ε sweep: section 7's


def test_the_demo_is_the_bundled_experiment(demo):
    """The demo's FP8 summary is results/fp8-bundled's, figure for figure (make_demo_data recomputes it from the
    same runs: equal, not close)."""
    if not (RESULTS / "summary.json").exists():
        pytest.skip("results/fp8-bundled is not in this checkout")
    bundled = json.loads((RESULTS / "summary.json").read_text())
    assert {k: v for k, v in demo.fp8[0].items() if k != "_path"} == bundled


def test_the_fp8_table_shows_the_summarys_numbers(demo):
    """Cells hand-checked against summary.md of results/fp8-bundled: fp8's phantom-clip difference +0.0707
    [+0.0316, +0.11] is +7.07 [+3.16, +10.98] pp (the table's two decimals of 100 x summary.json's 0.070678,
    0.031605, 0.109751); fp8,tis's final length +2.4 [-8.1, 12.9] tokens; none's final length 20.8, its seeds
    21.55, 17.8 and 23.1 in brackets."""
    summary = demo.fp8[0]
    table = html_fp8_table(demo)
    assert table.startswith('<table class="arms" id="fp8-table">')
    assert table.count('<tr class="sub">') == 7
    fp8 = _arm(summary, "fp8")["vs_baseline"]["phantom_rate"]
    assert (round(100 * fp8["mean"], 2), round(100 * fp8["low"], 2), round(100 * fp8["high"], 2)) == (7.07, 3.16, 10.98)
    assert "<td>+7.07 <small>[+3.16, +10.98]</small></td>" in table
    assert "<td>+2.4 <small>[-8.1, +12.9]</small></td>" in table
    finals = sorted(r["final_length"] for r in summary["runs"] if r["run"] == "none")
    assert f"<td>20.8 <small>({finals[0]:.1f}–{finals[-1]:.1f})</small></td>" in table
    assert (finals[0], finals[-1]) == pytest.approx((17.8, 23.1), abs=0.05)
    assert "the bf16 engine, nothing corrected (the baseline)" in table
    assert "the emulated FP8 engine, with token-level truncated importance sampling" in table
    assert "6 arms are compared here, and no correction for the number of comparisons" in table
    # provenance: the FP8 row and the Data: line say the engine is emulated on a CPU, not an FP8 GPU
    fp8_row = table.split("<b>fp8</b>")[1].split("</tbody>")[0]
    assert "the engine samples in FP8, emulated on a CPU by phantomclip&#x27;s local engine" in fp8_row
    page = render(demo)  # the page puts the table's Data: line under it
    source = page.split('id="fp8-table"')[1].split('<p class="source">')[1].split("</p>")[0]
    assert source.startswith("Data: fp8/summary.json, the summary of experiment fp8; demo/fp8: 21 runs")  # no roots
    assert "fp8-w8a8, emulated on a CPU" in source and "CPU (torch" in source
    # fewer phantom clips by construction is said apart, not as a detected difference
    for arm, why in (("fp8,shadow-ratio", "it clips on α alone"), ("fp8,force-r1", "its ratio is 1, never clipped")):
        row = table.split(f"<b>{arm}</b>")[1].split("</tbody>")[0]
        assert "phantom-clip rate" not in row.split("Against the baseline:</b>")[1].split("; no phantom")[0]
        assert f"no phantom clips by construction ({why})" in row and "-1.10 <small>by construction</small>" in row
    # an arm none of whose intervals excludes zero is said to show no detectable difference, never a direction
    altered = copy.deepcopy(demo)
    tis = _arm(altered.fp8[0], "fp8,tis")
    tis["vs_baseline"]["phantom_rate"].update({"mean": 0.01, "low": -0.02, "high": 0.04})
    row = html_fp8_table(altered).split("<b>fp8,tis</b>")[1].split("</tbody>")[0]
    assert "Against the baseline:</b> no detectable difference from none at 3 seeds." in row


def test_the_sentence_follows_the_intervals(demo):
    """In the demo, fp8, fp8,tis and fp8,mis have final-length intervals that include zero (no detectable
    difference), icepop, shadow ratio and force r = 1 intervals below zero (shorter); moving tis's interval below
    zero moves tis to 'ended shorter', and one seed gives no direction at all. The intervals' terms are said."""
    text = fp8_result(demo)
    length, phantom = text.split(" in final length, ")[1].split(". In phantom-clip rate, ")
    shorter, same = length.split(" ended shorter; ")
    assert "fp8,icepop (-6.0 [-9.8, -2.2] tokens)" in shorter and "fp8,force-r1 (-19.1 [-25.3, -12.8] tokens)" in \
        shorter and "fp8,tis" not in shorter
    assert same.startswith("fp8, fp8,tis and fp8,mis showed no detectable difference")
    assert "restore" not in text
    assert phantom.startswith("fp8 (+7.07 [+3.16, +10.98] pp)") and "were below" not in phantom
    assert ("fp8,shadow-ratio and fp8,force-r1 have no phantom clip by construction (fp8,shadow-ratio: it clips on α "
            "alone; fp8,force-r1: its ratio is 1, never clipped), so theirs is not a comparison") in phantom
    assert "paired by seed over 3 seeds" in text and "no correction for the 10 comparisons" in text
    assert "against 7 here" in text  # 3 shorter + 4 above in phantom-clip rate; 2 by construction not counted
    beta = (_arm(demo.fp8[0], "fp8")["beta_abs_mean_start"]["mean"],
            _arm(demo.fp8[0], "none")["beta_abs_mean_start"]["mean"])
    assert f"mean |β| of {beta[0]:.3f} against the bf16 engine's {beta[1]:.3f} ({beta[0] / beta[1]:.1f} times" in text
    assert html.escape(text) in render(demo)

    altered = copy.deepcopy(demo)
    _arm(altered.fp8[0], "fp8,tis")["vs_baseline"]["final_length"].update({"mean": -5.0, "low": -9.0, "high": -1.0})
    shorter, same = fp8_result(altered).split(" in final length, ")[1].split(" ended shorter; ")
    assert "fp8,tis (-5.0 [-9.0, -1.0] tokens)" in shorter and same.startswith("fp8 and fp8,mis showed no")

    one = copy.deepcopy(demo)
    for a in one.fp8[0]["arms"]:
        for d in a.get("vs_baseline", {}).values():
            d.update({"n": 1, "low": None, "high": None})
    text = fp8_result(one)
    assert text.startswith("Each arm has one seed here") and "shorter" not in text


def _fp8_line(text: str) -> str:
    return next((li for li in text.split("<li>") if li.startswith("Against the bf16 engine, the emulated FP8")), "")


def test_the_summary_line_follows_the_intervals(demo):
    """'In short' has one FP8 line, by the rule of section 8's sentence (fp8_verdicts): the arms whose final-length
    interval lies below zero (icepop, shadow ratio, force r = 1) and those whose phantom-clip rate lies above (fp8,
    tis, mis, icepop); shadow ratio's and force r = 1's lower phantom-clip rate is 0 by construction and is not
    said. With every final-length difference negated (mean -> -mean, [low, high] -> [-high, -low]) the three end
    longer instead; with tis's interval moved below zero one more is detected (11 -> 12 of the 21 comparisons);
    with one seed, or with no FP8 summary, there is no FP8 line."""
    from phantomclip.report.summary import html_summary

    text = html_summary(demo.diagnose, demo.sanity, demo.fp8)
    line = _fp8_line(text)
    assert line == ("Against the bf16 engine, the emulated FP8 engine ended shorter with <b>fp8,icepop, "
                    "fp8,shadow-ratio, fp8,force-r1</b>; had more phantom clips with <b>fp8, fp8,tis, fp8,mis, "
                    "fp8,icepop</b> (section 8).</li>")
    assert "21 intervals" in text and "; 11 do." in text

    flipped = copy.deepcopy(demo.fp8)
    for a in flipped[0]["arms"]:
        d = a.get("vs_baseline", {}).get("final_length")
        if d:
            d.update({"mean": -d["mean"], "low": -d["high"], "high": -d["low"]})
    line = _fp8_line(html_summary(demo.diagnose, demo.sanity, flipped))
    assert line.startswith("Against the bf16 engine, the emulated FP8 engine ended longer with <b>fp8,icepop, "
                           "fp8,shadow-ratio, fp8,force-r1</b>;") and "ended shorter" not in line

    moved = copy.deepcopy(demo.fp8)
    _arm(moved[0], "fp8,tis")["vs_baseline"]["final_length"].update({"mean": -5.0, "low": -9.0, "high": -1.0})
    text = html_summary(demo.diagnose, demo.sanity, moved)
    assert "ended shorter with <b>fp8,tis, fp8,icepop," in _fp8_line(text) and "; 12 do." in text

    one = copy.deepcopy(demo.fp8)
    for a in one[0]["arms"]:
        for d in a.get("vs_baseline", {}).values():
            d.update({"n": 1, "low": None, "high": None})
    for fp8 in (one, []):
        text = html_summary(demo.diagnose, demo.sanity, fp8)
        assert not _fp8_line(text) and text.count("<li>") == 4
        assert "These 11 intervals" in text  # the note counts section 7's alone
    alone = html_summary([], [], demo.fp8)  # FP8 data only: its line and a note counting its own 10 comparisons
    assert alone.count("<li>") == 2 and "These 10 intervals" in alone and "; 7 do." in alone


def test_the_per_step_figures_draw_the_fp8_runs(demo):
    """The length figure's line of the bf16 engine at step 10 is the mean of its 3 seeds' lengths there (the
    seeds' metrics.jsonl, read here directly); each arm keeps one colour, the correction's own where it has one,
    and the arms shown on opening are FP8_SHOWN_ARMS."""
    fig = FIGURES["fp8_training"][0](demo)
    lines = {t["name"]: t for t in fig["data"] if "name" in t}
    assert list(lines) == [f"{a} (3 seeds)" for a in ARMS]
    rows = [json.loads(line) for r in ("seed-0", "seed-1", "seed-2")
            for line in (demo_sources()[0] / "fp8" / "none" / r / "metrics.jsonl").read_text().splitlines()]
    at10 = [m["completion/length_mean"] for m in rows if m["step"] == 10]
    assert len(at10) == 3 and lines["none (3 seeds)"]["y"][9] == pytest.approx(sum(at10) / 3, rel=1e-12)
    shown = [a for a in ARMS if lines[f"{a} (3 seeds)"]["visible"] is True]
    assert shown == list(FP8_SHOWN_ARMS)
    colours = [arm_colour(a, ARMS) for a in ARMS]
    assert len(set(colours)) == 7 and arm_colour("fp8,tis", ARMS) == arm_colour("tis", ["tis"])
    assert lines["fp8,tis (3 seeds)"]["line"]["color"] == colours[2]
    phantom = FIGURES["fp8_phantom_steps"][0](demo)
    assert phantom["title"] == "Phantom-clipped tokens per step, bf16 and emulated FP8 engines"
    assert fig["source"][1] == demo.fp8_runs and phantom["source"][1] == demo.fp8_runs


def test_without_an_fp8_experiment_the_section_names_the_command(demo):
    """Section 7 drawn and section 8 a single note naming `experiment fp8`, when the FP8 files are absent."""
    data = copy.deepcopy(demo)
    data.fp8, data.fp8_runs = [], []
    text = render(data)
    section = text.split("8. FP8 rollouts")[1].split("9. Expert routing")[0]
    assert section.count('class="missing"') == 1 and 'id="fp8-table"' not in section
    assert "No data for the 3 figures of this section yet. Run <code>phantomclip experiment fp8 --seeds 3 --out " \
           "runs/fp8</code>" in section
    assert 'id="fp8-table"' not in text and 'class="arms"' in text.split("7. Interventions")[1]
    summary = text.split('id="summary">')[1].split("</section>")[0]
    assert summary.count("<li>") == 5 and "FP8" not in summary and "section 8" not in summary
    assert fp8_result(ReportData()) == ""


def test_each_experiment_json_is_read_once_per_collect(monkeypatch, tmp_path):
    """The demo's three experiment.json files (sanity: 36 runs, fp8: 21, moe-r3: 9) are each read once per collect, not
    once per
    run directory; a second collect in the same process reads them again, so an edited plan is seen (fp8's arm
    'fp8,tis' renamed: its 3 runs then fall back to their engine's quantiser and intervention, 'fp8-w8a8,tis')."""
    from phantomclip.report import sources

    reads = []
    real = sources.read_json
    monkeypatch.setattr(sources, "read_json", lambda path: reads.append(Path(path)) or real(path))
    data = collect(demo_sources())
    plans = sorted(p.parent.name for p in reads if p.name == "experiment.json")
    assert plans == ["fp8", "moe-r3", "sanity"] and len(data.fp8_runs) == 21 and len(data.runs) == 36
    assert len(data.moe_runs) == 9
    demo = tmp_path / "demo"
    shutil.copytree(demo_sources()[0] / "fp8", demo)
    assert [r["arm"] for r in collect([demo]).fp8_runs].count("fp8,tis") == 3
    plan = json.loads((demo / "experiment.json").read_text())
    plan["arms"] = [a.replace("fp8,tis", "fp8,tis-renamed") for a in plan["arms"]]
    (demo / "experiment.json").write_text(json.dumps(plan))
    reads.clear()
    arms = [r["arm"] for r in collect([demo]).fp8_runs]
    assert "fp8,tis" not in arms and arms.count("fp8-w8a8,tis") == 3
    assert [p.name for p in reads].count("experiment.json") == 1


def test_an_fp8_run_outside_its_experiment_is_still_an_fp8_run(tmp_path):
    """A run copied out of its experiment (no experiment.json two levels up) is named by its engine's quantiser and
    its intervention, and stays out of section 5."""
    src = demo_sources()[0] / "fp8" / "fp8+tis" / "seed-0"
    shutil.copytree(src, tmp_path / "run")
    data = collect([tmp_path / "run"])
    assert not data.runs and [r["arm"] for r in data.fp8_runs] == ["fp8-w8a8,tis"]
