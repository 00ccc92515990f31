import html
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from conftest import bad_cli
from phantomclip.cli.main import main
from phantomclip.report import (
    FIGURES,
    USER_ONLY,
    WIDGETS,
    ReportData,
    ReportError,
    build,
    collect,
    demo_sources,
    render,
)

DEMO_FIGURES = len(FIGURES) - len(USER_ONLY)
"""the figures the bundled demo draws: all but those only a reader's own data can (report.USER_ONLY)."""

SECTIONS = ["1. BF16 and FP16 arithmetic", "2. The GRPO loss and the importance ratio",
            "3. From logit error to ratio error", "4. Phantom clipping", "5. The closed loop",
            "6. The gap along training", "7. Interventions", "8. FP8 rollouts", "9. Expert routing (MoE)",
            "10. Your framework", "11. Beside the seed article",
            "12. Appendix"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A diagnose JSON, a trace JSON, a sanity experiment of two arms x two seeds, an FP8 experiment of its first
    two arms (the bf16 and the FP8 engine) x one seed (the one-seed page: differences without intervals) and a
    `trace --run` of a run with snapshots, all from the tiny model; a diagnose JSON of the tiny MoE (its route table)
    and the demo's moe-r3 experiment (bench/experiments/exp_moe_r3.py's files, copied: the MoE section)."""
    d = tmp_path_factory.mktemp("src")
    assert main(["diagnose", "--model", "tiny-random:0", "--n", "6", "--max-tokens", "10",
                 "--json", str(d / "diagnose.json")]) == 0
    assert main(["diagnose", "--model", "tiny-moe:0", "--n", "4", "--max-tokens", "8", "--trainer", "fp32",
                 "--no-batch-invariance", "--json", str(d / "diagnose-moe.json")]) == 0
    shutil.copytree(demo_sources()[0] / "moe-r3", d / "moe-r3")
    assert main(["trace", "--model", "tiny-random:0", "--n", "3", "--max-tokens", "6", "--no-what-if",
                 "--json", str(d / "trace.json")]) == 0
    assert main(["experiment", "sanity", "--model", "tiny-random:30", "--max-tokens", "8", "--prompts-per-step", "2",
                 "--lr", "3e-3", "--steps", "3", "--seeds", "2", "--out", str(d / "sanity"),
                 "--only", "none,force-r1"]) == 0
    assert main(["experiment", "fp8", "--model", "tiny-random:30", "--max-tokens", "8", "--prompts-per-step", "2",
                 "--lr", "3e-3", "--steps", "3", "--seeds", "1", "--out", str(d / "fp8"), "--only", "none,fp8"]) == 0
    run = tmp_path_factory.mktemp("snap") / "run"  # outside `d`: only its trace --run JSON is a source
    assert main(["train", "--model", "tiny-random:30", "--steps", "2", "--group-size", "4", "--max-tokens", "8",
                 "--lr", "3e-3", "--keep-snapshots", "1", "--out", str(run)]) == 0
    assert main(["trace", "--run", str(run), "--json", str(d / "growth.json")]) == 0
    return d


def test_collect_classifies_every_source(sources):
    data = collect([sources])
    assert len(data.diagnose) == 2 and len(data.traces) == 1 and len(data.sanity) == 1 and len(data.growths) == 1
    # the MoE model's diagnose first: the sections that read the last diagnose read the dense model's
    assert "routing" in data.diagnose[0] and data.diagnose[-1]["model"]["name"] == "tiny-random:0"
    assert len(data.moe) == 1 and len(data.moe_runs) == 9 and not any("moe-r3" in r["_path"] for r in data.runs)
    assert sorted(r["name"] for r in data.runs) == ["force-r1/seed-0", "force-r1/seed-1", "none/seed-0", "none/seed-1"]
    assert all(len(r["metrics"]) == 3 for r in data.runs)
    # the FP8 experiment's summary is its own kind and its runs stay out of the closed loop's (its 'none' is the
    # bf16 engine of another experiment), each named by its arm there: the FP8 engine's intervention is 'none' too
    assert len(data.fp8) == 1 and data.fp8[0]["experiment"] == "fp8" and data.sanity[0]["experiment"] == "sanity"
    assert [(r["name"], r["arm"]) for r in data.fp8_runs] == [("none/seed-0", "none"), ("fp8/seed-0", "fp8")]
    assert {r["config"]["intervention"] for r in data.fp8_runs} == {"none"}


def test_page_has_every_section_and_figure_offline(sources, tmp_path):
    page = build([sources], tmp_path / "report")
    text = page.read_text()
    for title in SECTIONS:
        assert title in text
    assert "<!-- figure:" not in text  # every marker was replaced
    assert not re.search(r"<script[^>]+src=", text)  # offline: plotly.js is inline, no external scripts
    figures = json.loads(re.search(r"const FIGURES = (\{.*?\});\nconst PALETTE", text, re.S).group(1))
    assert set(figures) == set(FIGURES) - set(USER_ONLY)  # every demo figure drawn: no section is missing data
    assert 'class="missing"' not in text
    assert "Each arm has one seed here: the table gives each difference from the bf16 engine (none) without an " \
           "interval" in html.unescape(text)  # the FP8 experiment's one seed: no interval, no direction said
    data_files = sorted(p.name for p in (tmp_path / "report" / "data").iterdir())
    assert any(n.endswith("diagnose.json") for n in data_files) and any(n.endswith("metrics.jsonl") for n in data_files)
    # the histogram holds every token's β of the first recipe: the figure is drawn from the data, not a sketch
    diag = json.loads((sources / "diagnose.json").read_text())
    first = next(iter(diag["tokens"]["per_recipe"]))
    assert figures["beta_hist"]["data"][0]["x"] == pytest.approx(
        [b for b in diag["tokens"]["per_recipe"][first]["beta"] if b is not None], rel=1e-5)  # 6 significant digits
    # the split figure: total, precision and kernel mean |β| per recipe, straight from the JSON
    total, precision, kernel = (t["y"] for t in figures["beta_split"]["data"])
    assert total == pytest.approx([v["beta_abs_mean"] for v in diag["recipes"].values()], rel=1e-5)
    assert precision == pytest.approx([v["split"]["precision"]["beta_abs_mean"] for v in diag["recipes"].values()],
                                      rel=1e-5)
    assert kernel == pytest.approx([diag["shadow"]["kernel"]["beta_abs_mean"]] * len(diag["recipes"]), rel=1e-5)


def test_missing_data_names_the_command():
    text = render(ReportData())
    assert "phantomclip diagnose --json diagnose.json" in text
    assert "phantomclip experiment sanity --out runs/sanity" in text
    # one note per section without data: 3, 4, 5, 6 (their figures and the growth table), 7 (the sanity table),
    # 8 (the FP8 table and figures), 9 (MoE: two commands, one note), 10 (the "Your framework" panel); section 6's
    # five pieces share one command and one note, and so do section 8's three
    assert text.count('class="missing"') == 8
    assert "No data for the 3 figures of this section yet. Run <code>phantomclip experiment fp8 --seeds 3 --out " \
           "runs/fp8</code>" in text
    assert "No data for the 5 figures of this section yet" in text
    assert 'id="summary"' not in text and "Data: computed when the page was built" in text  # no data: no summary
    assert "phantomclip trace --run runs/r --json growth.json" in text
    for w in WIDGETS:
        assert f'id="{w}"' in text  # widgets need no data


def test_report_bad_input(capsys, tmp_path, sources):
    assert "no such file or directory" in bad_cli(["report", "--from", str(tmp_path / "nope"),
                                                   "--out", str(tmp_path / "r")], capsys)
    (tmp_path / "empty").mkdir()
    assert "found no diagnose JSON" in bad_cli(["report", "--from", str(tmp_path / "empty"),
                                                "--out", str(tmp_path / "r")], capsys)
    (tmp_path / "afile").write_text("x")
    assert "is a file" in bad_cli(["report", "--from", str(sources), "--out", str(tmp_path / "afile")], capsys)
    newer = tmp_path / "newer"
    newer.mkdir()
    diag = json.loads((sources / "diagnose.json").read_text())
    (newer / "d.json").write_text(json.dumps({**diag, "schema": 99}))
    assert "data schema 99, newer than this phantomclip reads (2)" in bad_cli(["report", "--from", str(newer),
                                                                               "--out", str(tmp_path / "r")], capsys)


def test_a_killed_run_is_read_up_to_its_last_complete_line(sources, tmp_path):
    run = tmp_path / "killed"
    shutil.copytree(sources / "sanity" / "none" / "seed-0", run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/me')  # torn by SIGKILL
    with pytest.warns(UserWarning, match=r"the last line \(4\) is incomplete"):
        data = collect([run])
    assert [m["step"] for m in data.runs[0]["metrics"]] == [1, 2, 3]


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_page_in_a_real_browser(sources, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    page_path = build([sources], tmp_path / "report")
    errors = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(Path(page_path).as_uri())
        page.wait_for_function("document.querySelectorAll('.figure .main-svg').length > 0")
        n_drawn = page.evaluate("document.querySelectorAll('.figure .plot-container').length")
        assert n_drawn == DEMO_FIGURES, n_drawn  # every data figure rendered by Plotly
        # the widgets' maths, in the browser: bf16(0.1) = 0.10009765625; bf16 spacing at 1 is 2^-7, so an update
        # of 1e-4 needs ceil(2^-8 / 1e-4) = 40 steps; β = 0.3 with α = 0 and A = 1 is phantom-clipped at ε = 0.2
        assert page.evaluate("toBf16(0.1)") == 0.10009765625
        assert page.evaluate("stepsToCross(1.0, 1e-4)") == 40
        assert page.evaluate("grpoToken(1, 0, 0.3, 0.2).phantom") is True
        assert page.evaluate("grpoToken(1, 0.3, 0, 0.2).phantom") is False  # real clipping: α itself moved
        page.fill("#g-beta", "0.3")
        page.dispatch_event("#g-beta", "input")
        assert page.inner_text("#g-verdict").startswith("Gradient zeroed")  # A = 1 > 0 and r = e^0.3 > 1.2
        assert "phantom clipping" in page.inner_text("#g-verdict")
        page.fill("#g-beta", "0")
        page.dispatch_event("#g-beta", "input")
        assert page.inner_text("#g-verdict") == "Gradient flows."
        before = page.inner_text("#nl-table")
        page.fill("#nl-x", "1.0001")
        page.dispatch_event("#nl-x", "input")
        assert page.inner_text("#nl-table") != before  # the readout follows the input
        table = page.inner_text("#nl-table")
        assert "fp16\t1.0000\t" in table and "bf16\t1.000\t" in table, table  # both round 1.0001 to 1
        artifacts = Path(os.environ.get("PHANTOMCLIP_ARTIFACTS", tmp_path))
        artifacts.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(artifacts / "report-full-page.png"), full_page=True)
        assert (artifacts / "report-full-page.png").stat().st_size > 10_000
        empty = tmp_path / "empty.html"
        empty.write_text(render(ReportData()))
        page.goto(empty.as_uri())
        notes = page.locator(".missing")
        assert (notes.count() == 8  # one note per section without data, as in test_missing_data_names_the_command
                and "phantomclip diagnose --json diagnose.json" in notes.first.inner_text())
        phone = browser.new_page(viewport={"width": 390, "height": 844})
        phone.goto(Path(page_path).as_uri())
        phone.wait_for_function("document.querySelectorAll('.figure .main-svg').length > 0")
        width = phone.evaluate("document.documentElement.scrollWidth")
        assert width <= 390 + 1, width  # nothing forces sideways scrolling on a phone
        browser.close()
    assert not errors, errors


def test_serve_builds_the_demo_and_serves_it(tmp_path):
    """`report --serve` with no --from: the bundled demo data, served on 127.0.0.1 (port 0: a free one)."""
    import os
    import signal
    import subprocess
    import sys
    import urllib.request

    proc = subprocess.Popen([sys.executable, "-m", "phantomclip.cli.main", "report", "--serve", "--port", "0",
                             "--out", str(tmp_path / "r")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            # a test run started as a background job (`cmd &`) hands its children SIGINT ignored, and
                            # then Ctrl-C (the signal below) could not stop the server: give the child the default
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        url = None
        for line in proc.stdout:
            if line.startswith("serving on "):
                url = line.split()[2]
                break
        assert url, proc.stderr.read()
        page = urllib.request.urlopen(url, timeout=30).read().decode()
        assert "Phantom clipping, measured" in page
        assert page.count('class="missing"') < DEMO_FIGURES  # the demo data draws figures
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()  # never leave a server behind
            raise
    assert proc.returncode == 0


def test_arm_bands_are_the_seed_min_max(sources):
    """The length figure's line at a step is the mean of that step's lengths over the arm's seeds and its band their
    min-max; the interventions table carries each arm's seed range, its paired differences and a verdict."""
    from phantomclip.report.interventions_table import html_sanity_table
    from phantomclip.report.training_panel import per_step

    data = collect([sources])
    fig = per_step(data, "completion/length_mean", "t", "tokens", carry=True)
    line = next(t for t in fig["data"] if t.get("name", "").startswith("none"))
    band = next(t for t in fig["data"] if t["legendgroup"] == "none" and t.get("fill") == "toself")
    lengths = [r["metrics"][1]["completion/length_mean"] for r in data.runs if r["name"].startswith("none/")]
    assert len(lengths) == 2  # step 2 of both seeds
    assert line["y"][1] == pytest.approx(sum(lengths) / 2) and line["name"] == "none (2 seeds)"
    # upper edge, then the lower one reversed: 3 steps -> x = 1 2 3 3 2 1
    assert band["x"] == [1, 2, 3, 3, 2, 1]
    assert band["y"][1] == pytest.approx(max(lengths)) and band["y"][-2] == pytest.approx(min(lengths))
    table = html_sanity_table(data)
    summary = data.sanity[0]
    assert "the baseline" in table and table.count('<tr class="sub">') == len(summary["arms"])
    arm = summary["arms"][1]
    finals = [r["final_length"] for r in summary["runs"] if r["run"] == arm["run"]]
    assert f"({min(finals):.1f}–{max(finals):.1f})" in table


def test_your_framework_panel_shows_the_framework_table_and_knob_advice(sources):
    """The panel holds every row of diagnose.text.framework_rows and every line of knob_lines, from the JSON alone."""
    from phantomclip.diagnose.text import framework_rows, knob_lines
    from phantomclip.report.framework_panel import html_framework_panel

    diag = json.loads((sources / "diagnose.json").read_text())
    panel = html_framework_panel([diag])
    rows = framework_rows(diag)
    assert panel.count("<tr><td>") == len(rows) > 0
    for fw, figure, *_ in rows:
        assert f"<td>{fw}</td><td><code>{figure}</code></td>" in panel
    for line in knob_lines(diag["knobs"]):
        assert f"<li>{html.escape(line)}</li>" in panel
    assert "earlier phantomclip" not in panel
    assert html_framework_panel([]) is None


def test_an_old_schema_1_diagnose_json_still_builds_a_report(tmp_path):
    """tests/golden/diagnose-tiny-schema1.json is a real schema-1 file, written before the framework figures and the
    knob advice: it still builds, and the panel says how to produce what it lacks; a diagnose file from a newer schema
    is refused in one line."""
    old = Path(__file__).parent / "golden" / "diagnose-tiny-schema1.json"  # the AVX512-BF16 golden as first recorded
    doc = json.loads(old.read_text())
    assert doc["schema"] == 1 and "knobs" not in doc and "frameworks" not in next(iter(doc["recipes"].values()))
    text = build([old], tmp_path / "report").read_text()
    assert text.count("This diagnose JSON has no") == 2  # framework figures, knob advice
    assert text.count("Rerun <code>phantomclip diagnose --json diagnose.json</code> with this version") == 2
    doc["schema"] = 3
    (tmp_path / "new.json").write_text(json.dumps(doc))
    with pytest.raises(ReportError, match=r"written with data schema 3, newer than this phantomclip reads \(2\)"):
        collect([tmp_path / "new.json"])


def test_why_the_gap_grows_is_drawn_from_the_trace_run_json(sources):
    """The growth figures and table carry the JSON's numbers; the table names the part with the largest share."""
    from phantomclip.report import growth_panel

    data = collect([sources])
    doc = data.growths[0]
    ref = [s for s in doc["snapshots"] if "reference" in s]
    fig = growth_panel.fig_growth(data.growths)
    assert fig["data"][0]["x"] == [s["step"] for s in ref] == [0, 1, 2]
    assert fig["data"][0]["y"] == [s["reference"]["beta_abs_mean"] for s in ref]
    split = growth_panel.fig_growth_split(data.growths)
    last = ref[-1]["reference"]["change_since_first"]
    assert [t["y"][0] for t in split["data"]] == [last["mix"], last["within"], last["interaction"]]
    depth = growth_panel.fig_growth_depth(data.growths)["data"]
    assert depth[-1]["y"] == [d["rel_error"] for d in ref[-1]["reference"]["depth"]]  # the last snapshot's profile
    table = growth_panel.html_growth_table(data.growths)
    part = max(("mix", "within", "interaction"), key=lambda p: abs(last[p]))
    assert f"<td>{part}</td>" in table and "this one run" in table  # one run: no finding claimed
    # two runs that disagree on the dominant part: the page says so instead of naming one
    other = json.loads(json.dumps(doc))
    for s in other["snapshots"]:
        if "reference" in s:
            d = s["reference"]["change_since_first"]
            d.update({"mix": 0.0, "within": 0.0, "interaction": 0.0})
            d["within" if part != "within" else "mix"] = 1.0
    two = growth_panel.html_growth_table([doc, other])
    assert "disagree" in two
    smallest = int(abs(last["mix"]) == min(abs(last[p]) for p in ("mix", "within", "interaction")))
    # `other`: mix 0 (the smallest, tied) unless it was set to 1, which happens when part is 'within'
    assert f"smallest of the three in {smallest + (part != 'within')} of 2 runs" in two
