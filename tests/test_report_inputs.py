"""`phantomclip report` on hostile input: every file named on the command line is used or refused by name (one line,
exit 2, no traceback); files found by searching a directory may be skipped, with a warning that names them."""

import collections
import html
import html.parser
import json
import os
import re
import shutil
import warnings
from pathlib import Path

from conftest import bad_cli
from phantomclip.cli.main import main
from phantomclip.report import build, demo_sources
from phantomclip.report.plots import plotly_text

DEMO = demo_sources()[0]


def _good(tmp_path):
    shutil.copyfile(DEMO / "diagnose.json", tmp_path / "good.json")
    return tmp_path / "good.json"


def test_a_named_file_that_is_not_json_is_refused_by_name(capsys, tmp_path):
    good = _good(tmp_path)
    (tmp_path / "malformed.json").write_text('{"recipes": {')
    out = str(tmp_path / "r")
    line = bad_cli(["report", "--from", str(good), str(tmp_path / "malformed.json"), "--out", out], capsys)
    assert "malformed.json: is not valid JSON" in line, line  # not dropped in silence beside the good file
    line = bad_cli(["report", "--from", str(tmp_path / "malformed.json"), "--out", out], capsys)
    assert "malformed.json: is not valid JSON" in line and "found no" not in line, line
    (tmp_path / "list.json").write_text("[1, 2]")
    assert "holds a JSON list" in bad_cli(["report", "--from", str(tmp_path / "list.json"), "--out", out], capsys)
    (tmp_path / "other.json").write_text('{"name": "not ours"}')
    line = bad_cli(["report", "--from", str(good), str(tmp_path / "other.json"), "--out", out], capsys)
    assert "other.json: is none of diagnose, trace" in line, line


def test_files_found_in_a_directory_are_skipped_with_a_warning(capsys, tmp_path):
    _good(tmp_path)
    (tmp_path / "torn.json").write_text('{"recipes": ')
    (tmp_path / "list.json").write_text("[]")
    assert main(["report", "--from", str(tmp_path), "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("phantomclip report: warning: "), err
    assert "skipped 2 files" in err[0] and "list.json holds a JSON list" in err[0]
    assert "torn.json is not valid JSON" in err[0]
    assert (tmp_path / "r" / "index.html").exists()


def test_python_limits_are_one_line_naming_the_file(capsys, tmp_path):
    """A JSON integer of 5,000 digits (past int()'s 4,300-digit limit) and nesting 100,000 deep (past the recursion
    limit) are input like any other, not tracebacks."""
    out = str(tmp_path / "r")
    big = tmp_path / "big.json"
    big.write_text('{"schema": ' + "9" * 5000 + "}")
    line = bad_cli(["report", "--from", str(big), "--out", out], capsys)
    assert "big.json: is not valid JSON (holds an integer of more than 4300 digits)" in line, line
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    line = bad_cli(["report", "--from", str(deep), "--out", out], capsys)
    assert "deep.json: is not valid JSON for phantomclip (nested too deep to read)" in line, line
    run = tmp_path / "run"  # the same integer inside a run's metrics.jsonl
    shutil.copytree(DEMO / "sanity" / "none" / "seed-0", run)
    (run / "metrics.jsonl").write_text('{"step": ' + "1" * 5000 + "}\n" + '{"step": 2}\n')
    line = bad_cli(["report", "--from", str(run), "--out", out], capsys)
    assert "metrics.jsonl: a line is not valid JSON" in line, line
    (run / "metrics.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n" + '{"step": 2}\n')
    line = bad_cli(["report", "--from", str(run), "--out", out], capsys)
    assert "metrics.jsonl: a line is nested too deep to read" in line, line


def test_a_diagnose_json_missing_a_key_says_which(capsys, tmp_path):
    doc = json.loads((DEMO / "diagnose.json").read_text())
    assert doc["schema"] == 2
    del doc["recipes"]
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps(doc))
    line = bad_cli(["report", "--from", str(cut), "--out", str(tmp_path / "r")], capsys)
    assert line.endswith(f'{cut}: looks like a diagnose JSON but has no "recipes": the file was cut, edited or is '
                         "not one phantomclip wrote"), line
    assert "newer" not in line and "upgrade" not in line
    summary = json.loads((DEMO / "sanity" / "summary.json").read_text())
    del summary["runs"]
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    line = bad_cli(["report", "--from", str(tmp_path / "summary.json"), "--out", str(tmp_path / "r")], capsys)
    assert 'looks like an experiment summary but has no "runs"' in line, line


def test_report_without_from_draws_the_demo(capsys, tmp_path):
    assert main(["report", "--out", str(tmp_path / "r")]) == 0
    assert "no --from: drawing the bundled demo data" in capsys.readouterr().err
    assert "In short" in (tmp_path / "r" / "index.html").read_text()


HOSTILE = ("</script><script>window.__pwned = 1</script>", "<!--<script>", "a\u2028b\u2029c", "lone \ud800 \udfff",
           "<img src=x onerror=window.__pwned=1>", "'\"><svg onload=window.__pwned=1>", "]]>&amp;&#x3c;</SCRIPT ")
"""strings that end a <script> block, open a comment or an element, break an older JavaScript string literal, or have
no UTF-8 form (lone surrogates)."""
RENAMED = {"tis": HOSTILE[0], "icepop": HOSTILE[1], "mis": HOSTILE[2], "fp32-head": HOSTILE[3],
           "smollm2-135m": HOSTILE[4], "local": HOSTILE[5], "trust_region": "trust_region"}
"""string in the demo's files (an arm and its runs' intervention, a diagnose recipe, the model, the engine kind) ->
the hostile string put in its place, as a key and as a value, wherever it occurs."""
DIRECTORIES = {"tis": "a<!--<script>\udc80", "icepop": "x<img src=x onerror=window.__pwned=1>"}
"""arm directories renamed (a '/' cannot be in a name; \\udc80 is the byte 0x80, a name that is not UTF-8)."""


def _rename(x, renamed: dict, run_prefix: str):
    if isinstance(x, dict):
        return {renamed.get(k, k): _rename(v, renamed, run_prefix) for k, v in x.items()}
    if isinstance(x, list):
        return [_rename(v, renamed, run_prefix) for v in x]
    if isinstance(x, str) and x.startswith("/work/growth-runs2/"):  # trace --run's run path: a hostile run name
        return "/w/" + run_prefix + x.rsplit("/", 1)[1]
    return renamed.get(x, x) if isinstance(x, str) else x


def renamed_demo(root, renamed: dict, directories: dict, run_prefix: str) -> Path:
    """A copy of the demo data at root/demo with every string of `renamed` (as a key and as a value) replaced, the
    sanity arms' directories of `directories` renamed, and trace --run's runs named with `run_prefix`."""
    demo = root / "demo"
    shutil.copytree(DEMO, demo)
    for f in [*demo.rglob("*.json"), *demo.rglob("*.jsonl")]:
        lines = f.read_text(encoding="utf-8").splitlines() if f.suffix == ".jsonl" else [f.read_text("utf-8")]
        f.write_text("\n".join(json.dumps(_rename(json.loads(line), renamed, run_prefix)) for line in lines if line)
                     + "\n")
    for old, new in directories.items():
        (demo / "sanity" / old).rename(demo / "sanity" / new)
    return demo


def hostile_demo(root) -> list:
    """The demo data with hostile strings in every kind of field that reaches the page, and a run directory of its
    own with a hostile name; returns the --from sources."""
    demo = renamed_demo(root, RENAMED, DIRECTORIES, HOSTILE[1])
    alone = root / "run <!--<script>\udcff"
    shutil.copytree(demo / "sanity" / "none" / "seed-0", alone)
    return [demo, alone]


BIG = '<span style="font-size:60px">BIG</span>'
"""Plotly markup: drawn as markup it writes 60-px text in a legend, a hover, a tick label or an annotation."""
MARKUP = {"tis": BIG + " tis", "local": BIG + " local", "fp32": BIG + " fp32", "fp32-head": "<b>" + BIG + "</b>",
          "trust_region": "trust_region"}
"""an arm (a legend entry), the engine kind (a tick label of the split figure), the first trainer recipe (legends and
the notes drawn on three figures) and another recipe and arm, each renamed to Plotly markup."""


def markup_demo(root) -> list:
    """The demo with Plotly markup in every field that reaches a figure: MARKUP's names, a sanity arm's directory
    and every trace --run run (legend, hover and the split figure's tick labels)."""
    return [renamed_demo(root, MARKUP, {"icepop": '<span style="font-size:60px">BIG dir'}, BIG.replace("/", "|"))]


class _Tags(html.parser.HTMLParser):
    """The page's structure: every start tag with its attribute names, and its comments."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags, self.comments, self.scripts, self.inside = collections.Counter(), 0, [], False

    def handle_starttag(self, tag, attrs):
        self.tags[(tag, tuple(sorted(name for name, _ in attrs)))] += 1
        self.inside = tag == "script"

    def handle_endtag(self, tag):
        self.inside = False

    def handle_comment(self, data):
        self.comments += 1

    def handle_data(self, data):
        if self.inside:
            self.scripts.append(data)


def _structure(text: str) -> _Tags:
    parser = _Tags()
    parser.feed(text)
    parser.close()
    return parser


def test_escaping_functions_round_trip_every_hostile_string():
    """script_json: JSON.parse (json.loads here, the same grammar) reads back exactly what went in, and the text holds
    nothing the HTML tokenizer acts on inside a <script> block; html_text: no markup, and the text is shown as is."""
    from phantomclip.report.escape import html_text, script_json

    for s in HOSTILE:
        for x in (s, {s: [s, 1.5, None]}, [{"name": s}]):
            text = script_json(x)
            assert json.loads(text) == x
            assert not set(text) & {"<", ">", "&", "\u2028", "\u2029"} and text.isascii(), text
        shown = html_text(s)
        assert not set(shown) & {"<", ">", '"', "'"} and shown.encode("utf-8")
        assert html.unescape(shown) == s.encode("utf-8", "backslashreplace").decode("utf-8")  # lone surrogates: \ud800


def test_hostile_names_reach_the_page_as_text_never_as_markup(tmp_path):
    """Every field that reaches the page (arm names, the runs' intervention, a diagnose recipe, the model, the engine
    kind, run directory names, trace --run's run) holds a hostile string: the page has exactly the elements,
    attributes, comments and script blocks of the demo page, its data block parses back with the strings intact, and
    no block holds `</script` or `<!--`."""
    clean = build(demo_sources(), tmp_path / "clean").read_text(encoding="utf-8")
    page = build(hostile_demo(tmp_path), tmp_path / "hostile").read_text(encoding="utf-8")
    a, b = _structure(clean), _structure(page)
    assert b.comments == a.comments and len(b.scripts) == len(a.scripts) == 2
    tags = {k: v for k, v in b.tags.items() if k[0] not in ("li", "details", "summary", "pre", "a", "b")}
    assert tags == {k: v for k, v in a.tags.items() if k[0] not in ("li", "details", "summary", "pre", "a", "b")}
    assert page.count("<li><b>run ") == clean.count("<li><b>run ") + 1  # the appendix: the lone run directory
    for block in b.scripts:
        assert "</script" not in block.lower() and "<!--" not in block and "\u2028" not in block
    figures = json.loads(re.search(r"const FIGURES = (\{.*?\});\nconst PALETTE", page, re.S).group(1))
    names = {t.get("name", "") for fig in figures.values() for t in fig["data"]}
    # the arms' lines, named as the directories name them (the demo's sanity runs are in no experiment: their group is
    # the directory, sources.seed_group), as Plotly text (plots.plotly_text)
    for s in DIRECTORIES.values():
        assert any(n.startswith(plotly_text(s)) for n in names), s
    text = html.unescape(page)
    assert HOSTILE[4] in text and "a<!--<script>\\x80/seed-0" in text and "run <!--<script>\\xff" in text


def _null_figures(x, keys: tuple[str, ...], seeds_left: int | None):
    """An experiment summary as one where `keys` were never measured (null in every arm and run), and, with
    `seeds_left`, where each arm's interval is unknown (one seed: low and high null)."""
    if isinstance(x, dict):
        out = {k: None if k in keys and not isinstance(v, dict) else _null_figures(v, keys, seeds_left)
               for k, v in x.items()}
        if k_in := [k for k in keys if isinstance(out.get(k), dict)]:
            for k in k_in:
                out[k] = {"mean": None, "low": None, "high": None, "n": 0}
        if seeds_left is not None and {"mean", "low", "high", "n"} <= set(out):
            out.update(low=None, high=None, n=seeds_left)
        return out
    if isinstance(x, list):
        return [_null_figures(v, keys, seeds_left) for v in x]
    return x


def test_a_finished_or_unfinished_experiment_always_draws(tmp_path):
    """An experiment whose baseline clipped no token (no phantom share: null), one of a single seed (no interval:
    null), and one still being written (a run with its config but no row yet, a run cut mid-line, no summary for
    them) each draw a page; a summary line whose figure is null is left out, not filled in."""
    from phantomclip.report.summary import html_summary

    summary = json.loads((DEMO / "sanity" / "summary.json").read_text())
    cases = {"no clip": _null_figures(summary, ("phantom_share_of_clipped", "phantom_adv_share"), None),
             "one seed": _null_figures(summary, (), 1),
             "no beta": _null_figures(summary, ("beta_abs_mean_start", "beta_abs_mean_end"), None)}
    diagnose = [json.loads((DEMO / "diagnose.json").read_text())]
    for name, doc in cases.items():
        text = html_summary(diagnose, [doc])
        # gap, training (none without a phantom share), interventions (none without intervals) and their note
        assert text.count("<li>") == (3 if name == "no clip" else 4 if name == "no beta" else 2), (name, text)
        exp = tmp_path / name.replace(" ", "-")
        shutil.copytree(DEMO / "sanity", exp)
        (exp / "summary.json").write_text(json.dumps(doc))
        assert build([exp, DEMO / "diagnose.json"], tmp_path / f"r-{exp.name}").exists()
    writing = tmp_path / "writing"  # an experiment being written: runs beyond the summary, one with no row yet
    shutil.copytree(DEMO / "sanity", writing)
    shutil.copytree(writing / "tis" / "seed-0", writing / "tis" / "seed-3")
    (writing / "tis" / "seed-3" / "metrics.jsonl").write_text("")
    shutil.copytree(writing / "mis" / "seed-0", writing / "mis" / "seed-3")
    rows = (writing / "mis" / "seed-3" / "metrics.jsonl").read_text().splitlines()
    (writing / "mis" / "seed-3" / "metrics.jsonl").write_text("\n".join(rows[:2]) + "\n" + rows[2][:40])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the torn last line's warning
        assert build([writing], tmp_path / "r-writing").exists()


def test_a_report_inside_its_from_directory_does_not_read_its_own_copies(tmp_path, capsys):
    """report --from DIR --out DIR/report, run twice: the second run read the first page's data copies as data
    (01-data-00-...json); the report's own --out is not searched."""
    _good(tmp_path)
    for _ in range(2):
        assert main(["report", "--from", str(tmp_path), "--out", str(tmp_path / "report")]) == 0
    assert sorted(p.name for p in (tmp_path / "report" / "data").iterdir()) == [f"00-{tmp_path.name}-good.json"]


def test_serve_removes_its_temporary_directory_on_ctrl_c(tmp_path, capsys, monkeypatch):
    import http.server
    import tempfile

    made = []
    real = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kw: made.append(real(dir=tmp_path, **kw)) or made[-1])

    def ctrl_c(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(http.server.ThreadingHTTPServer, "serve_forever", ctrl_c)
    assert main(["report", "--from", str(_good(tmp_path)), "--serve", "--port", "0"]) == 0
    assert len(made) == 1 and not os.path.exists(made[0])


def test_the_training_panel_places_rows_by_their_step():
    """Rows in another order than their steps (a file edited, concatenated) are drawn at their steps."""
    from phantomclip.report.training_panel import step_values

    rows = [{"step": s, "x": float(s)} for s in (1, 2, 3, 4)]
    shuffled = [rows[2], rows[0], rows[3], rows[1]]
    assert step_values([shuffled], "x", carry=False) == [[1.0], [2.0], [3.0], [4.0]]
    # a run that stopped at step 2 carries its step-2 value, wherever that row sits in the file
    assert step_values([[rows[1], rows[0]], rows], "x", carry=True) == [[1.0, 1.0], [2.0, 2.0], [2.0, 3.0], [2.0, 4.0]]


def _strings(x, key: str = ""):
    """(key, string) of every string in a figure's data or layout, with the key it sits under."""
    if isinstance(x, str):
        yield key, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _strings(v, k)
    elif isinstance(x, list):
        for v in x:
            yield from _strings(v, key)


def test_plotly_gets_names_as_text_in_every_field(tmp_path):
    """Plotly renders a subset of HTML in legends, hover text, tick labels and annotations: with MARKUP's names in
    the data, no string of any figure but our own hover templates holds a '<' (each reaches Plotly with &lt; and
    &gt;, which it turns back into the characters after reading its tags), and the escaped names are there in each
    kind of field: a legend entry (trace name), hover text, a tick label (the split figure's engine) and a note
    drawn on a figure."""
    page = build(markup_demo(tmp_path), tmp_path / "report").read_text(encoding="utf-8")
    figures = json.loads(re.search(r"const FIGURES = (\{.*?\});\nconst PALETTE", page, re.S).group(1))
    found: dict[str, set[str]] = {}
    for name, fig in figures.items():
        for key, text in _strings(fig):
            if key == "hovertemplate":
                assert "BIG" not in text, (name, text)  # data never inside a template
                continue
            assert "<" not in text and ">" not in text, (name, key, text)
            if "&lt;span style=" in text:
                found.setdefault(key, set()).add(name)
    assert {"name", "text", "x"} <= set(found), found
    assert "beta_by_prob" in found["name"] and "training" in found["name"] and "growth" in found["name"]
    notes = [a["text"] for fig in figures.values() for a in fig["layout"].get("annotations", [])]
    assert any(t.startswith(plotly_text(BIG + " fp32") + ":") for t in notes), notes
