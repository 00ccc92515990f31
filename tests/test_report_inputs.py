"""`phantomclip report` on hostile input: every file named on the command line is used or refused by name (one line,
exit 2, no traceback); files found by searching a directory may be skipped, with a warning that names them."""

import json
import shutil

from conftest import bad_cli
from phantomclip.cli import main
from phantomclip.report import demo_sources

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
