"""The adversarial audit as a test: every bad input of every command on the tiny model ends in exit 2 and
one line on stderr naming what is wrong, never a traceback; and the stateful misuses (a changed input on resume, an
orphan metrics file, a continued experiment with other settings, NaN weights) are refused or counted, not ignored.

`bad_cli` (conftest) runs the CLI in-process and asserts exit 2, one stderr line and no traceback."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import as_written_before_run_ids, bad_cli, over
from phantomclip.cli.main import main

TINY = ["--model", "tiny-random"]
T = ["train", *TINY, "--steps", "2", "--group-size", "2", "--max-tokens", "4", "--checkpoint-every", "1"]
SEED_OUT_OF_RANGE = str(10**20)


# (argv, a fragment the one line must hold): the audit's one-shot cases that must fail before any heavy work
ONE_LINE = [
    (["train", "--lr", "inf"], "--lr must be a finite number > 0 and <= 1, got inf"),
    (["train", "--lr", "1e308"], "--lr must be a finite number > 0 and <= 1"),
    (["train", "--lr", "nan"], "--lr must be a finite number"),
    (["train", "--max-grad-norm", "nan"], "--max-grad-norm must be a finite number > 0"),
    (["train", "--max-grad-norm", "-1"], "--max-grad-norm must be a finite number > 0"),
    (["train", "--max-grad-norm", "0"], "--max-grad-norm must be a finite number > 0"),
    (["train", "--correction-cap", "nan"], "--correction-cap must be a finite number >= 1"),
    (["train", "--correction-cap", "-5"], "--correction-cap must be a finite number >= 1"),
    (["train", "--temperature", "inf"], "--temperature must be a finite number > 0"),
    (["train", "--samples-per-step", "-3"], "--samples-per-step must be a whole number >= 0"),
    (["train", "--seed", "-1"], "--seed must be a whole number >= 0 and <= 4294967295, got -1"),
    (["train", "--seed", SEED_OUT_OF_RANGE], "--seed must be a whole number >= 0"),
    (["train", "--epsilon", "nan"], "--epsilon must be a finite number > 0 and < 1"),
    (["train", "--icepop-high", "inf"], "--icepop-high must be a finite number >= 1"),
    (["train", "--steps", "x"], "argument --steps: invalid int value: 'x' (see `phantomclip train --help`)"),
    (["train", "--bogus"], "unrecognized arguments: --bogus (see `phantomclip train --help`)"),
    (["diagnose", "--seq-mask-cap", "nan"], "--seq-mask-cap must be a finite number >= 1"),
    (["diagnose", "--temperature", "inf"], "--temperature must be a finite number > 0"),
    (["diagnose", "--seed", "-1"], "--seed must be a whole number >= 0"),
    (["trace", "--seed", "-1"], "--seed must be a whole number >= 0"),
    (["trace", "--seed", SEED_OUT_OF_RANGE], "--seed must be a whole number >= 0"),
    (["trace", "--epsilon", "nan"], "--epsilon must be a finite number"),
    (["engines", "--engines", "local", "--seed", "-1"], "--seed must be a whole number >= 0"),
    (["engines", "--engines", "local", "--n", "0"], "--n must be a whole number >= 1"),
    (["experiment", "sanity", "--seeds", "0"], "--seeds: must be a whole number >= 1, got 0"),
    (["experiment", "sanity", "--lr", "inf"], "--lr must be a finite number"),
    (["experiment", "sanity", "--only", ""], "--only is empty: give a value, or drop --only"),
    (["train", "--intervention", "epsilon=5"], "epsilon=X: X must be a finite number > 0 and < 1, got 5"),
    (["train", "--intervention", "epsilon=0"], "epsilon=X: X must be a finite number > 0 and < 1, got 0"),
    (["experiment", "sanity", "--only", " , "], "--only is empty: name the arms to run"),
    (["report", "--serve", "--port", "99999"], "--port: '99999' is not a port"),
    (["report", "--serve", "--port", "-1"], "--port: '-1' is not a port"),
    # an empty value (an unset shell variable) is refused, never the default: every flag that stores a value
    *[([*cmd, flag, value], f"{flag} is empty: give a value, or drop {flag} for its default")
      for cmd, flag in ((["diagnose"], "--json"), (["train"], "--prompts"), (["diagnose"], "--from-trl-config"),
                        (["diagnose"], "--from-verl-config"), (["train"], "--reward"), (["trace"], "--run"),
                        (["report"], "--from"), (["experiment", "sanity"], "--out"), (["report"], "--out"),
                        (["engines"], "--json"), (["train"], "--out"), (["train"], "--model"),
                        (["diagnose"], "--trainer"), (["experiment", "epsilon"], "--prompts"))
      for value in ("", " ")],
    (["report", "--from", "a.json", ""], "--from is empty"),
    (["train", "--resume", ""], "--resume is empty"),
    # a single-value flag given twice: the first was silently dropped
    *[([*cmd, flag, "a", flag, "b"], f"{flag} is given twice: give it once")
      for cmd, flag in ((["report"], "--from"), (["diagnose"], "--json"), (["train"], "--out"),
                        (["trace"], "--model"), (["experiment", "sanity"], "--only"), (["engines"], "--json"))],
    (["train", "--steps", "2", "--steps", "3"], "--steps is given twice"),
    # trace --run reads the model and settings from the run: one typed beside it would be ignored
    (["trace", "--run", "no-such-run", "--model", "tiny-random"], "--model with --run: trace --run takes the model"),
    (["trace", "--run", "no-such-run", "--n", "4"], "--n with --run"),
    # digits int() refuses where str.isdigit takes them (a ValueError traceback)
    (["diagnose", "--device", "cuda:²"], "use auto, cpu, cuda or cuda:N"),
    (["train", "--device", "cuda:١"], "use auto, cpu, cuda or cuda:N"),
    # sizes bounded before anything is allocated or drawn (errors.LENGTH_LIMIT, STEPS_LIMIT, SEEDS_LIMIT)
    (["diagnose", "--knob-length", str(10**30)], "--knob-length must be a whole number >= 0 and <= 16777216"),
    (["diagnose", "--max-tokens", str(2**24 + 1)], "--max-tokens must be a whole number >= 1 and <= 16777216"),
    (["train", "--max-tokens", str(10**12)], "--max-tokens must be a whole number >= 1 and <= 16777216"),
    (["train", "--steps", str(10**12)], "--steps must be a whole number >= 1 and <= 100000"),
    (["experiment", "sanity", "--steps", str(100_001)], "--steps must be a whole number >= 1 and <= 100000"),
    (["experiment", "epsilon", "--seeds", str(10**8)], "--seeds must be a whole number >= 1 and <= 1000"),
]


def _no_model_work(monkeypatch):
    """Make any model load fail loudly (every loader ends in models.check_vocab): a case that passes refused its
    input before loading anything."""
    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr("phantomclip.models.load.check_vocab", loaded)


@pytest.mark.parametrize("argv,fragment", ONE_LINE, ids=[" ".join(a) for a, _ in ONE_LINE])
def test_bad_flag_is_one_line(argv, fragment, capsys, monkeypatch):
    _no_model_work(monkeypatch)
    assert fragment in bad_cli(argv, capsys)


def test_prompts_beyond_the_context_are_refused_before_work(tmp_path, capsys, monkeypatch):
    """tiny-random has 512 positions: a 2,000-token prompt, a 5M-character line (refused before tokenizing, which
    alone would take minutes) and --max-tokens past the context all fail with one line and no run directory."""
    long = tmp_path / "long.txt"
    long.write_text("ab " * 700 + "\n")
    huge = tmp_path / "huge.txt"
    huge.write_text("x" * 5_000_000 + "\n")
    out = tmp_path / "run"
    assert "exceeds the model's context of 512" in bad_cli([*T, "--prompts", str(long), "--out", str(out)], capsys)
    with monkeypatch.context() as m:  # the 5M-character line is refused without tokenizing it
        m.setattr("phantomclip.models.prompts.encode_prompts", lambda *a: pytest.fail("the huge prompt was tokenized"))
        assert "5,000,000 characters" in bad_cli([*T, "--prompts", str(huge), "--out", str(out)], capsys)
    assert not out.exists()
    assert "exceeds the model's context of 512" in bad_cli(
        ["engines", *TINY, "--engines", "local", "--max-tokens", "100000000"], capsys)
    assert "exceeds the model's context of 512" in bad_cli(["train", *TINY, "--max-tokens", "600"], capsys)


def test_resume_refuses_a_changed_prompts_file(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\n")
    out = str(tmp_path / "run")
    assert main([*T, "--prompts", str(prompts), "--out", out]) == 0
    prompts.write_text("one\nthree\n")  # same path, new content
    capsys.readouterr()
    line = bad_cli(over(T, "--prompts", str(prompts), "--out", out, "--resume", "--steps", "3"), capsys)
    assert f"other input files: prompts {prompts} changed" in line
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert set(config["inputs"]) == {"prompts"} and len(config["inputs"]["prompts"]["sha256"]) == 64


def test_fresh_run_refuses_orphan_files_and_resume_below_its_steps(tmp_path, capsys):
    orphan = tmp_path / "orphan"
    orphan.mkdir()
    (orphan / "metrics.jsonl").write_text('{"step": 1}\n')
    assert "holds run files (metrics.jsonl) but no config.json" in bad_cli([*T, "--out", str(orphan)], capsys)
    out = str(tmp_path / "run")
    assert main([*T, "--out", out]) == 0
    capsys.readouterr()
    assert "already has 2 steps, more than --steps 1" in bad_cli(over(T, "--out", out, "--resume", "--steps", "1"),
                                                                 capsys)


def test_experiment_refuses_to_file_old_runs_under_new_settings(tmp_path, capsys):
    args = ["experiment", "sanity", *TINY, "--only", "none", "--seeds", "1", "--steps", "1", "--group-size", "2",
            "--max-tokens", "4", "--out", str(tmp_path / "e")]
    assert main(args) == 0
    capsys.readouterr()
    line = bad_cli([*args, "--lr", "1e-3"], capsys)
    assert "none/seed-0 was made with a different configuration: lr: 3e-05 -> 0.001" in line
    assert json.loads((tmp_path / "e" / "summary.json").read_text())["base_config"]["lr"] == 3e-5


def test_nan_weights_are_counted_skipped_and_stop_the_run(tmp_path, capsys, tiny):
    """A NaN in the weights: every log-prob is non-finite. Each step counts them (mismatch/nonfinite), skips its
    update, and the run stops with one line after NONFINITE_STOP steps; metrics.jsonl stays strict JSON."""
    from phantomclip.models.load import tiny_tokenizer
    from phantomclip.training.trainer import NONFINITE_STOP

    model_dir = tmp_path / "nan-model"
    with torch.no_grad():
        state = {k: v.clone() for k, v in tiny.model.state_dict().items()}
        tiny.model.model.norm.weight[0] = float("nan")
    try:
        tiny.model.save_pretrained(model_dir)
    finally:
        tiny.model.load_state_dict(state)
    tiny_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "run"
    line = bad_cli(["train", "--model", str(model_dir), "--steps", "6", "--group-size", "2", "--max-tokens", "4",
                    "--out", str(out)], capsys, after_progress=True)
    assert f"steps 1-{NONFINITE_STOP} skipped their update: the loss or the gradient was not finite" in line
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]  # strict JSON: no bare NaN
    assert len(rows) == NONFINITE_STOP
    for r in rows:
        assert r["train/skipped"] is True and r["train/loss"] is None
        assert r["mismatch/nonfinite"] == 2 * 4 and r["mismatch/tokens"] == 0  # all 8 completion tokens
    assert "NaN" not in (out / "metrics.jsonl").read_text()


def test_diagnose_says_what_happened_when_no_log_prob_is_finite():
    from phantomclip.answer.verdict_text import verdict

    result = {"engine": {"dtype": "bf16", "nonfinite_logprobs": 96}, "config": {"epsilon": 0.2, "epsilon_high": 0.2},
              "recipes": {"fp32": {"tokens": 0, "nonfinite": 96}}}
    text = verdict(result)
    assert text.startswith("No β could be measured: 96 completion tokens were sampled but their log-probs are not")
    result["engine"]["nonfinite_logprobs"], result["recipes"]["fp32"]["nonfinite"] = 0, 0
    assert verdict(result) == "No completion tokens were scored: raise --max-tokens or --n."


def test_a_failed_resume_releases_the_lock_and_rewrites_nothing(tmp_path, capsys):
    """A checkpoint without the trainer's state (or with a step past --steps) is refused before any file is
    rewritten, and the refusal releases the directory: the same process can try again and gets the same line."""
    from phantomclip.runs.rundir import jsonl_line

    out = tmp_path / "run"
    assert main([*T, "--out", str(out)]) == 0
    capsys.readouterr()
    metrics = (out / "metrics.jsonl").read_text()
    torch.save({"step": 1}, out / "checkpoint.pt")
    for _ in range(2):
        assert "checkpoint.pt is not a checkpoint this tool wrote (no master, optimizer, scaler, snapshots)" in bad_cli(
            over(T, "--out", str(out), "--resume", "--steps", "3"), capsys)
    torch.save({"step": 5, "master": {}, "optimizer": {}, "scaler": {}, "snapshots": {}}, out / "checkpoint.pt")
    line = bad_cli(over(T, "--out", str(out), "--resume", "--steps", "3"), capsys)
    assert "already has 5 steps, more than --steps 3" in line
    assert (out / "metrics.jsonl").read_text() == metrics and jsonl_line({"x": float("nan")}) == '{"x": null}\n'


def test_a_run_made_before_input_hashes_still_resumes(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\n")
    out = tmp_path / "run"
    assert main([*T, "--prompts", str(prompts), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    del config["inputs"]  # as runs written before this version, whose rows carried no run/id either
    (out / "config.json").write_text(json.dumps(config))
    as_written_before_run_ids(out)
    assert main(over(T, "--prompts", str(prompts), "--out", str(out), "--resume", "--steps", "3")) == 0


def test_experiment_continuation_and_seeds_are_checked_before_any_run(tmp_path, capsys):
    args = ["experiment", "sanity", *TINY, "--only", "none", "--seeds", "1", "--steps", "1", "--group-size", "2",
            "--max-tokens", "4", "--out", str(tmp_path / "e")]
    assert main(args) == 0
    capsys.readouterr()
    assert "--reward 'nosuch.sub:f': cannot import nosuch.sub" in bad_cli([*args, "--reward", "nosuch.sub:f"], capsys)
    assert "prompts file" in bad_cli([*args, "--prompts", str(tmp_path / "missing.txt")], capsys)
    line = bad_cli(over(args, "--out", str(tmp_path / "f"), "--seed", "4294967295", "--seeds", "2"), capsys)
    assert "runs seeds up to 4294967296, past the largest seed 4294967295" in line
    assert not (tmp_path / "f" / "none").exists()


KNOB_CASES = [  # (flag of train / experiment, flag of diagnose, a value outside the knob's range)
    ("--epsilon", "--epsilon", "1"),
    ("--epsilon-high", "--epsilon-high", "0"),
    ("--correction-cap", "--token-cap", "0.5"),
    ("--correction-cap", "--seq-mask-cap", "nan"),
    ("--icepop-low", "--icepop-low", "1.5"),
    ("--icepop-low", "--icepop-low", "-0.1"),
    ("--icepop-high", "--icepop-high", "0.9"),
]


@pytest.mark.parametrize("train_flag,diagnose_flag,value", KNOB_CASES)
def test_a_knob_means_the_same_in_every_command(train_flag, diagnose_flag, value, capsys, monkeypatch):
    """One definition per knob (loss.KNOBS): the same out-of-range value is refused by train, experiment and
    diagnose with the same range in the same words (only the flag's name differs where the commands name it so).
    Before, --icepop-low 1 was refused by train and accepted by diagnose, --epsilon-high 1.5 the other way round."""
    from phantomclip.maths.loss import KNOBS

    _no_model_work(monkeypatch)
    lines = [bad_cli(["train", train_flag, value], capsys),
             bad_cli(["experiment", "sanity", train_flag, value], capsys),
             bad_cli(["diagnose", diagnose_flag, value], capsys)]
    ranges = {line.split(" must be ")[1].split(", got")[0] for line in lines}
    assert len(ranges) == 1, lines
    knob = KNOBS[{"--correction-cap": "cap"}.get(train_flag, train_flag[2:].replace("-", "_"))]
    assert ranges.pop().startswith(f"a finite number {'>' if knob.low_open else '>='} {knob.low:g}"), lines
    # a value at the edge of every range (1 for the caps and IcePop's bounds, a ratio of 1 is never cut) is accepted
    from phantomclip.diagnose.job import DiagnoseConfig
    from phantomclip.training.trainer import TrainConfig

    TrainConfig(correction_cap=1.0, icepop_low=1.0, icepop_high=1.0, epsilon_high=1.5).validate()
    DiagnoseConfig(token_cap=1.0, seq_mask_cap=1.0, icepop_low=1.0, icepop_high=1.0, epsilon_high=1.5).validate()


@pytest.mark.parametrize("spec", ["tiny-random:4294967296", "tiny-random:99999999999999999999", "tiny-random:-1"])
def test_a_model_seed_follows_the_seed_rule(spec, capsys):
    """`tiny-random:2**32` was `tiny-random:0` (torch's seed wraps), a 20-digit seed a traceback: --seed's rule."""
    line = bad_cli(["diagnose", "--model", spec, "--n", "2"], capsys)
    assert "its SEED must be a whole number from 0 to 4294967295" in line, line


def _resumable(tmp_path, capsys) -> Path:
    out = tmp_path / "run"
    assert main(over(T, "--steps", "3", "--out", str(out))) == 0  # a checkpoint at every step
    capsys.readouterr()
    return out


@pytest.mark.parametrize("damage,fragment", [
    ("append-old", "line 4: step 2 where a step after 3 (the checkpoint's) belongs"),
    ("drop-middle", "line 2: step 3 where step 2 belongs"),
    ("swap", "line 1: step 2 where step 1 belongs"),
])
def test_resume_refuses_damaged_rows(tmp_path, capsys, damage, fragment):
    """Resume continues only from rows 1..k in order and the checkpoint of step k: a duplicated, missing or reordered
    row is one line naming the file and line, and nothing is rewritten."""
    out = _resumable(tmp_path, capsys)
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    if damage == "append-old":
        metrics.write_text("".join(lines) + lines[1])
    elif damage == "drop-middle":
        metrics.write_text(lines[0] + lines[2])
    elif damage == "swap":
        metrics.write_text(lines[1] + lines[0] + lines[2])
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.suffix == ".jsonl"}
    line = bad_cli(over(T, "--steps", "4", "--out", str(out), "--resume"), capsys)
    assert fragment in line, line
    assert before == {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.suffix == ".jsonl"}


def _figures(path: Path) -> list[dict]:
    """A run file's rows without their clock readings (the only figures a rerun does not repeat)."""
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


def test_rows_without_a_checkpoint_are_recomputed_from_step_zero(tmp_path, capsys):
    """A run killed after logging rows but before its first checkpoint (checkpoint.pt absent, rows 1..k) continues:
    its rows are a function of its config and seed, so resume recomputes them from step 0 (a warning says so) and they
    equal the uninterrupted run's. Shown inside an experiment, whose reruns it blocked: an experiment removes its
    runs' checkpoints once they finish, so a run cut back to its first row is that state."""
    exp = tmp_path / "exp"
    flags = ["experiment", "sanity", *TINY, "--steps", "2", "--group-size", "2", "--max-tokens", "4", "--seeds", "1",
             "--only", "none", "--out", str(exp)]
    assert main(flags) == 0
    run = exp / "none" / "seed-0"
    full = {name: _figures(run / name) for name in ("metrics.jsonl", "samples.jsonl")}
    for name in full:
        (run / name).write_text((run / name).read_text().splitlines(keepends=True)[0])
    assert not (run / "checkpoint.pt").exists()
    capsys.readouterr()
    assert main(flags) == 0
    assert "has 1 logged steps but no checkpoint.pt: recomputing them from step 0" in capsys.readouterr().err
    assert {name: _figures(run / name) for name in full} == full


# ------------------------------------------------------------------------ resume continues only its own checkpoint

def test_resume_refuses_another_runs_checkpoint_copied_or_linked(tmp_path, capsys):
    """checkpoint.pt replaced by (a link to) a run made with another model spec and seed: resume wrote rows that were
    a hybrid of two runs. The checkpoint carries its run's configuration; the keys that differ are named (a link is
    refused as one before it is read), nothing is rewritten, and the other run's checkpoint is left as it was."""
    own, other = tmp_path / "own", tmp_path / "other"
    assert main([*T, "--out", str(own)]) == 0
    assert main(over(T, "--model", "tiny-random:1", "--seed", "1", "--out", str(other))) == 0
    capsys.readouterr()
    theirs = (other / "checkpoint.pt").read_bytes()
    before = {p.name: p.read_bytes() for p in own.iterdir() if p.is_file()}
    for how in ("copy", "link"):
        (own / "checkpoint.pt").unlink()
        if how == "copy":
            (own / "checkpoint.pt").write_bytes(theirs)
        else:
            (own / "checkpoint.pt").symlink_to(other / "checkpoint.pt")
        line = bad_cli(over(T, "--out", str(own), "--resume", "--steps", "3"), capsys)
        said = ("checkpoint.pt was written by another run (model: 'tiny-random:1' -> 'tiny-random'; seed: 1 -> 0)"
                if how == "copy" else "checkpoint.pt: is a symbolic link: phantomclip reads no link inside")
        assert said in line, line
        assert (own / "metrics.jsonl").read_bytes() == before["metrics.jsonl"]
    assert (other / "checkpoint.pt").read_bytes() == theirs


def test_a_checkpoint_without_its_configuration_still_resumes(tmp_path, capsys):
    """A checkpoint written before checkpoints carried their run's configuration resumes as before; a configuration
    that is not a mapping is damage."""
    out = tmp_path / "run"
    assert main([*T, "--out", str(out)]) == 0
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["config"]["model"] == "tiny-random" and ckpt["config"]["inputs"] == {}
    torch.save({**ckpt, "config": ["not", "a", "mapping"]}, out / "checkpoint.pt")
    capsys.readouterr()
    assert "its configuration is a list" in bad_cli(over(T, "--out", str(out), "--resume", "--steps", "3"), capsys)
    torch.save({k: v for k, v in ckpt.items() if k != "config"}, out / "checkpoint.pt")
    assert main(over(T, "--out", str(out), "--resume", "--steps", "3")) == 0
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


# ------------------------------------------------------------------------ user code: every way it can fail

USER_FAILURES = {  # name -> (the statement that fails, the fragment the one line holds)
    "exception": ("raise RuntimeError('bad reward')", "RuntimeError: bad reward"),
    "exit-0": ("sys.exit(0)", "SystemExit: 0"),
    "exit-1": ("sys.exit(1)", "SystemExit: 1"),
    "exit-text": ("sys.exit('bye')", "SystemExit: bye"),
    "exit-none": ("sys.exit()", "SystemExit"),
    "multi-line": ("raise ValueError('first\\nsecond\\nthird')", "ValueError: first (+2 more lines)"),
    "base-exception": ("raise GeneratorExit('odd')", "GeneratorExit: odd"),
}


def _user_module(tmp_path, monkeypatch, name: str, source: str) -> str:
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


@pytest.mark.parametrize("failure", list(USER_FAILURES))
def test_user_code_failing_at_import_is_one_line(failure, tmp_path, capsys, monkeypatch):
    """A reward module that raises (SystemExit(0) included: it ended the command with success and no run) is one
    line naming the module, exit 2, before any model loads or any directory is made."""
    _no_model_work(monkeypatch)
    statement, fragment = USER_FAILURES[failure]
    module = _user_module(tmp_path, monkeypatch, f"reward_import_{failure.replace('-', '_')}",
                          f"import sys\n{statement}\n")
    out = tmp_path / "run"
    line = bad_cli([*T, "--reward", f"{module}:score", "--out", str(out)], capsys)
    assert f"--reward '{module}:score': cannot import {module} ({fragment}" in line, line
    assert not out.exists()


@pytest.mark.parametrize("failure", ["exception", "exit-0", "exit-1", "multi-line"])
def test_user_code_failing_in_a_step_is_one_line_and_keeps_the_checkpoint(failure, tmp_path, capsys, monkeypatch):
    """A reward that fails at step 2 (sys.exit(0) there also ended the command as a success): one line naming the
    function and its module, exit 2; step 1's row and checkpoint stay, and the run resumes from them."""
    statement, fragment = USER_FAILURES[failure]
    module = _user_module(tmp_path, monkeypatch, f"reward_step_{failure.replace('-', '_')}",
                          "import sys\ncalls = []\n\ndef score(prompts, completions, ids):\n    calls.append(1)\n"
                          f"    if len(calls) == 2:\n        {statement}\n    return [0.0] * len(completions)\n")
    out = tmp_path / "run"
    line = bad_cli([*T, "--reward", f"{module}:score", "--out", str(out)], capsys, after_progress=True)
    assert f"reward function {module}.score raised {fragment}" in line, line
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 1


def test_a_keyboard_interrupt_from_user_code_is_ctrl_c(tmp_path, capsys, monkeypatch):
    """KeyboardInterrupt is what Ctrl-C raises wherever the program is: from a reward module's import it is read as
    Ctrl-C (exit 130, 'interrupted'), not as the module's fault."""
    module = _user_module(tmp_path, monkeypatch, "reward_ctrl_c", "raise KeyboardInterrupt\n")
    assert main([*T, "--reward", f"{module}:score", "--out", str(tmp_path / "run")]) == 130
    assert capsys.readouterr().err.strip() == "phantomclip train: interrupted"


@pytest.mark.parametrize("values,flags", [
    ("[1e308, -1e308]", []),  # inf in float32
    ("[3.0e38, -3.0e38, -3.0e38]", ["--group-size", "3", "--no-scale-rewards"]),  # each fits; r - mean does not
])
def test_rewards_past_float32_are_one_line_not_a_silent_step(values, flags, tmp_path, capsys, monkeypatch):
    """A reward finite in Python but not in float32, where the loss uses it, or whose advantages overflow there,
    made a step with reward/mean null and zero advantages that learned nothing, exit 0. Now one line, exit 2."""
    module = _user_module(tmp_path, monkeypatch, f"reward_huge_{len(flags)}",
                          f"def score(prompts, completions, ids):\n    v = {values}\n"
                          "    return [v[i % len(v)] for i in range(len(completions))]\n")
    line = bad_cli(over(T, *flags, "--reward", f"{module}:score", "--out", str(tmp_path / "run")), capsys,
                   after_progress=True)
    assert f"reward function {module}.score returned rewards that overflow float32" in line, line


# ------------------------------------------------------------------------ trainer config files, both readers

TRL_BAD = [  # (YAML text, the fragment after '--from-trl-config FILE: ' or in the line)
    ("max_completion_length: -5", "max_completion_length must be a whole number >= 1 and <= 16777216, got -5"),
    ("max_completion_length: 0", "max_completion_length must be a whole number >= 1 and <= 16777216, got 0"),
    ("max_completion_length: 4.5", "max_completion_length is 4.5, not a whole number"),
    ("max_completion_length: true", "max_completion_length is True, not a number"),
    ("max_completion_length: [8]", "max_completion_length is [8], not a number"),
    ("temperature: 0", "temperature must be a finite number > 0, got 0.0"),
    ("temperature: hot", "temperature is 'hot', not a number"),
    ("temperature: .nan", "temperature is nan, not a finite number"),
    ("top_p: 2", "top_p must be a finite number > 0 and <= 1, got 2.0"),
    ("top_k: -3", "top_k must be a whole number >= -1, got -3"),
    ("epsilon: '0.1x'", "epsilon is '0.1x', not a number"),
    ("fp16: maybe", "fp16 is 'maybe', not a boolean"),
    ("vllm_importance_sampling_clip_max: {a: 1}", "vllm_importance_sampling_clip_max is {'a': 1}, not a number"),
    ("max_completion_length: 1000000000000", "max_completion_length must be a whole number >= 1 and <= 16777216"),
]
VERL_BAD = [
    ("data: {max_response_length: -5}", "data.max_response_length must be a whole number >= 1 and <= "
     "16777216, got -5"),
    ("data: {max_response_length: 2.5}", "data.max_response_length is 2.5, not a whole number"),
    ("data: {max_response_length: 100000000000}", "data.max_response_length must be a whole number >= 1 and <= "
     "16777216"),
    ("actor_rollout_ref: {rollout: {temperature: 0}}", "actor_rollout_ref.rollout.temperature must be a finite "
     "number > 0, got 0.0"),
    ("actor_rollout_ref: {rollout: {top_p: 1.5}}", "actor_rollout_ref.rollout.top_p must be a finite number > 0 and "
     "<= 1, got 1.5"),
    ("actor_rollout_ref: {rollout: {temperature: false}}", "actor_rollout_ref.rollout.temperature is False, not a "
     "number"),
    ("actor_rollout_ref: {actor: {clip_ratio: abc}}", "actor_rollout_ref.actor.clip_ratio is 'abc', not a number"),
    # a bound of 0 in any spelling (1 / 0 was a ZeroDivisionError traceback)
    *[(f"algorithm: {{rollout_correction: {{rollout_rs: token_k1, rollout_rs_threshold: {spec}}}}}",
       "algorithm.rollout_correction.rollout_rs_threshold") for spec in ("0", '"0.0"', '"0_2"', '"0.5_0"', "-0.0")],
]


@pytest.mark.parametrize("flag,text,fragment", [("--from-trl-config", t, f) for t, f in TRL_BAD]
                         + [("--from-verl-config", t, f) for t, f in VERL_BAD])
def test_config_values_of_each_wrong_type_and_spelling(flag, text, fragment, tmp_path, capsys, monkeypatch):
    """Each wrong value in a trainer config is refused in the config's words, naming the file and the key
    (max_completion_length: -5 was an error about --knob-length, a flag the user never typed)."""
    _no_model_work(monkeypatch)
    path = tmp_path / "config.yaml"
    path.write_text(text + "\n")
    line = bad_cli(["diagnose", *TINY, "--n", "2", flag, str(path)], capsys)
    assert line == f"phantomclip diagnose: error: {flag} {path}: {fragment}" or (
        line.startswith(f"phantomclip diagnose: error: {flag} {path}: {fragment}")), line


@pytest.mark.parametrize("flag", ["--from-trl-config", "--from-verl-config"])
def test_a_value_the_config_gives_that_diagnose_refuses_names_the_config(flag, tmp_path, capsys, monkeypatch):
    _no_model_work(monkeypatch)
    path = tmp_path / "config.yaml"
    path.write_text("epsilon: 7\n" if "trl" in flag else "actor_rollout_ref: {actor: {clip_ratio: 7}}\n")
    line = bad_cli(["diagnose", *TINY, "--n", "2", flag, str(path)], capsys)
    field = "epsilon" if "trl" in flag else "actor_rollout_ref.actor.clip_ratio"
    assert line == f"phantomclip diagnose: error: {flag} {path}: {field} must be a finite number > 0 and < 1, got 7.0"


@pytest.mark.parametrize("suffix", ["yaml", "json"])
@pytest.mark.parametrize("flag", ["--from-trl-config", "--from-verl-config"])
def test_a_config_nested_100000_deep_is_one_line(flag, suffix, tmp_path, capsys, monkeypatch):
    _no_model_work(monkeypatch)
    path = tmp_path / f"deep.{suffix}"
    path.write_text("[" * 100_000 + "]" * 100_000 if suffix == "json" else "a: " + "[" * 100_000 + "]" * 100_000)
    assert f"{flag} {path}: nested too deep" in bad_cli(["diagnose", *TINY, flag, str(path)], capsys)


@pytest.mark.parametrize("suffix", ["yaml", "json"])
@pytest.mark.parametrize("flag", ["--from-trl-config", "--from-verl-config", "--prompts"])
def test_a_number_past_ints_digit_limit_is_one_line(flag, suffix, tmp_path, capsys, monkeypatch):
    """5,000 digits: int() refuses more than 4,300, a ValueError that is neither YAML's nor the JSON decoder's own."""
    _no_model_work(monkeypatch)
    big = "1" * 5000
    path = tmp_path / f"big.{suffix}"
    if flag == "--prompts":
        path.write_text(f'{{"prompt": "hi", "n": {big}}}\n')
    else:
        json_text = f'{{"data": {{"max_response_length": {big}}}}}'
        path.write_text(json_text if suffix == "json" else f"temperature: {big}\n")
    line = bad_cli(["diagnose", *TINY, "--n", "2", flag, str(path)], capsys)
    assert "holds an integer of more than" in line and str(path) in line, line


def test_typed_flags_win_over_the_config(tmp_path, capsys):
    """model_name_or_path replaced a typed --model (and the help did not say so): a flag the user typed, also as an
    abbreviation argparse accepts, wins; an untyped one is the config's."""
    path = tmp_path / "trl.yaml"
    path.write_text("model_name_or_path: tiny-random:2\nmax_completion_length: 3\n")
    base = ["diagnose", "--n", "2", "--trainer", "fp32", "--no-batch-invariance", "--from-trl-config", str(path)]
    models = {}
    for typed in (["--model", "tiny-random"], ["--mod", "tiny-random"], ["--model=tiny-random"], []):
        out = tmp_path / f"r{len(models)}.json"
        assert main([*base, *typed, "--json", str(out)]) == 0
        models[" ".join(typed)] = json.loads(out.read_text())["config"]
        err = capsys.readouterr().err
        assert ("kept the flags you gave over the config's values: --model" in err) == bool(typed), err
    assert {k: v["model"] for k, v in models.items()} == {"--model tiny-random": "tiny-random",
                                                         "--mod tiny-random": "tiny-random",
                                                         "--model=tiny-random": "tiny-random", "": "tiny-random:2"}
    assert all(v["max_tokens"] == 3 for v in models.values())


# ------------------------------------------------------------------------ trace --run on a damaged run

def test_trace_run_names_the_damaged_file_and_key(tmp_path, capsys):
    """config.json lacking keys or holding wrong types, a snapshot's tokens file lacking fields, holding other
    values or another model's token ids: one line naming the file and key (a KeyError or TypeError before)."""
    out = tmp_path / "run"
    assert main(over(T, "--steps", "1", "--keep-snapshots", "1", "--out", str(out))) == 0
    config_path, tokens_path = out / "config.json", out / "snapshots" / "step-000000.tokens.json"
    config, tokens = json.loads(config_path.read_text()), json.loads(tokens_path.read_text())
    config_cases = [
        (lambda c: c.pop("model"), "config.json: model is missing, not a string"),
        (lambda c: c.update(model=5), "config.json: model is 5, not a string"),
        (lambda c: c.update(temperature="hot"), "config.json: temperature is 'hot', not a number > 0"),
        (lambda c: c.update(temperature=True), "config.json: temperature is True, not a number > 0"),
        (lambda c: c.pop("plan"), "config.json: plan is missing, not a mapping"),
        (lambda c: c["plan"].pop("engine_recipe"), "config.json: plan.engine_recipe is missing, not one of fp32"),
        (lambda c: c["plan"].update(trainer_recipe=["fp32"]), "config.json: plan.trainer_recipe is ['fp32'], not one"),
    ]
    token_cases = [
        (lambda t: t.pop("prompt_ids"), "prompt_ids is missing or not rows of token ids"),
        (lambda t: t.update(completion_ids=[[1.5]] * len(t["prompt_ids"])), "completion_ids is missing or not rows"),
        (lambda t: t.update(completion_ids=[[1]]), "completion_ids is missing or not rows"),
        (lambda t: t.update(completion_ids=[[-1]] * len(t["prompt_ids"])), "completion_ids is missing or not rows"),
        (lambda t: t.update(completion_ids=[[10**6]] * len(t["prompt_ids"])), "token id 1000000 is past tiny-random"),
    ]
    for path, original, cases in ((config_path, config, config_cases), (tokens_path, tokens, token_cases)):
        for damage, fragment in cases:
            doc = json.loads(json.dumps(original))
            damage(doc)
            path.write_text(json.dumps(doc))
            line = bad_cli(["trace", "--run", str(out)], capsys, after_progress=True)
            assert fragment in line, line
        path.write_text(json.dumps(original))
    tokens_path.write_text('{"prompt_ids": [[1')
    assert "step-000000.tokens.json is not readable JSON" in bad_cli(["trace", "--run", str(out)], capsys)


# ------------------------------------------------------------------------ the API's configs, each field

def _configs():
    from phantomclip.diagnose.config import DiagnoseConfig
    from phantomclip.engines.compare import CompareConfig
    from phantomclip.trace.job import TraceConfig
    from phantomclip.training.config import TrainConfig

    return (TrainConfig, DiagnoseConfig, TraceConfig, CompareConfig)


WRONG_TYPES = [None, "x", 1.5, 7, True, [], {}, [1]]


@pytest.mark.parametrize("cls", _configs(), ids=lambda c: c.__name__)
def test_every_config_field_of_a_wrong_type_is_one_line(cls, monkeypatch):
    """Each field of each job's config, given each value of a type its annotation does not allow, is refused by
    validate() with a PhantomclipError naming the flag (a TypeError or AttributeError from inside validate before:
    DiagnoseConfig(trainer=5), TrainConfig(intervention=None), TraceConfig(keep_fp32=None), CompareConfig(dtypes=5))."""
    import dataclasses

    from phantomclip.base.errors import FIELD_KINDS, PhantomclipError

    _no_model_work(monkeypatch)
    refused = 0
    for f in dataclasses.fields(cls):
        kinds = tuple(k for part in str(f.type).split("|") for k in FIELD_KINDS[part.strip()][0])
        for value in WRONG_TYPES:
            try:
                cfg = cls(**{f.name: value})
            except PhantomclipError:
                continue
            fits = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds) and not (
                isinstance(value, list) and not all(isinstance(v, str) for v in value))
            if fits or (isinstance(value, str) and list in kinds):  # a comma-separated string is a list's spelling
                continue
            with pytest.raises(PhantomclipError, match=f"^--{f.name.replace('_', '-')} must be "):
                cfg.validate()
            refused += 1
    assert refused >= 3 * len(dataclasses.fields(cls))


# ------------------------------------------------------------------------ what the lines say

def test_seeds_past_the_range_say_which_flag_to_lower(capsys, monkeypatch):
    _no_model_work(monkeypatch)
    line = bad_cli(["experiment", "sanity", "--seeds", str(10**20)], capsys)  # errors.SEEDS_LIMIT comes first
    assert line.endswith(f"--seeds must be a whole number >= 1 and <= 1000, got {10**20}"), line
    line = bad_cli(["experiment", "sanity", "--seed", "4294967000", "--seeds", "1000"], capsys)
    assert line.endswith("past the largest seed 4294967295: lower --seeds to 296 or less or --seed"), line
    line = bad_cli(["experiment", "sanity", "--seed", "4294967295", "--seeds", "2"], capsys)
    assert line.endswith("lower --seeds to 1 or less or --seed"), line


def test_the_whole_run_line_prints_no_nan():
    """A temperature of 1e-30 samples the argmax: no step has any β, and its growth (0 / 0) printed 'x nan'."""
    from phantomclip.cli.main import whole_run_line

    summary = {"phantom_rate": 0.0, "phantom_rate_last": 0.0, "phantom_share_of_clipped": float("nan"),
               "phantom_adv_share": float("nan"), "beta_abs_mean_start": 0.0, "beta_abs_mean_end": 0.0,
               "beta_growth": float("nan"), "beta_outside_end": 0.0}
    line = whole_run_line(summary)
    assert "nan" not in line.lower() and "0.0000 (last 5), x -;" in line, line
    assert "x2.00;" in whole_run_line({**summary, "beta_abs_mean_start": 0.1, "beta_abs_mean_end": 0.2,
                                       "beta_growth": 2.0})


def test_digits_python_reads_as_digits_but_int_refuses():
    """'²' passes str.isdigit and fails int(): errors.ascii_digits is the one test before int() on part of a key or a
    name (--fail-if's list indices, a snapshot's step), and a snapshot named other than snapshot_path names it (step-2
    beside step-000002) is not read as a second copy of its step."""
    from phantomclip.base.errors import ascii_digits
    from phantomclip.diagnose.gates import _walk
    from phantomclip.runs.rundir import RunDir

    assert [ascii_digits(t) for t in ("12", "²", "١", "", "1a", "007")] == [True, False, False, False, False, True]
    summary = {"tokens": {"sequence": [5, 6]}}
    assert _walk(summary, "tokens.sequence.1") == 6 and _walk(summary, "tokens.sequence.²") is _walk(summary, "no")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        run = RunDir(Path(d))
        run.snapshots_path.mkdir()
        for name in ("step-000002", "step-2", "step-²", "step-0000002", "step-000010"):
            (run.snapshots_path / f"{name}.safetensors").write_bytes(b"")
        assert run.snapshot_steps() == [2, 10]


def test_names_that_are_not_utf8_are_printed_not_a_traceback(tmp_path, capsys):
    """A --from directory, a file in it and an --out whose names hold bytes that are not UTF-8 (Python holds them as
    lone surrogates): the warning, the error and the 'wrote' line name them with \\xNN, never a UnicodeEncodeError."""
    import os
    import shutil

    from phantomclip.report import demo_sources

    src = Path(os.fsdecode(bytes(tmp_path) + b"/d\xff"))
    src.mkdir()
    shutil.copyfile(demo_sources()[0] / "diagnose.json", src / "diagnose.json")
    (src / "x\udcfe.json").write_text("{}")
    out = Path(os.fsdecode(bytes(tmp_path) + b"/r\xfd"))
    assert main(["report", "--from", str(src), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "x\\xfe.json is none of" in captured.err and "r\\xfd/index.html" in captured.out, captured
    line = bad_cli(["report", "--from", str(src / "x\udcfe.json"), "--out", str(out)], capsys)
    assert "d\\xff/x\\xfe.json: is none of" in line and line.encode("utf-8"), line


# ------------------------------------------------------------------------ one validator of run files

ROW_DAMAGE = {  # name -> (the damaged second row, from the good one; the fragment of the one line)
    "empty": (lambda r: {}, 'line 2: no "step"'),
    "no figures": (lambda r: {"step": r["step"]}, 'line 2: no "completion/length_mean" (and 6 more)'),
    "no clock": (lambda r: {k: v for k, v in r.items() if k != "time/step_s"}, 'line 2: no "time/step_s"'),
    "a string": (lambda r: {**r, "reward/mean": "high"}, "line 2: reward/mean is 'high', not a number"),
    "a list": (lambda r: {**r, "clip/rate": [0.1]}, "line 2: clip/rate is '[0.1]', not a number"),
    "step 0": (lambda r: {**r, "step": 0}, "line 2: step 0 is not a whole number >= 1"),
}


@pytest.mark.parametrize("damage", list(ROW_DAMAGE))
def test_a_damaged_metrics_row_is_one_line_for_every_reader(damage, tmp_path, capsys):
    """runs.checks.check_metrics_rows is every reader's check of metrics.jsonl: resume, an experiment's rerun and
    report --from each refuse the same damaged row in one line naming the file, the line and the key (a row {} was a
    KeyError, a row of no figures accepted, a string a TypeError)."""
    out = _resumable(tmp_path, capsys)
    metrics = out / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    make, fragment = ROW_DAMAGE[damage]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in [rows[0], make(rows[1]), rows[2]]))
    before = metrics.read_bytes()
    for argv in (over(T, "--out", str(out), "--resume", "--steps", "4"),
                 ["report", "--from", str(out), "--out", str(tmp_path / "r")]):
        line = bad_cli(argv, capsys)
        assert f"metrics.jsonl, {fragment}" in line, line
    assert metrics.read_bytes() == before
    from phantomclip.runs.checks import RunFileError
    from phantomclip.runs.rundir import RunDir

    with pytest.raises(RunFileError) as e:
        RunDir(out).metrics()  # what an experiment's rerun reads a finished run with
    assert fragment in str(e.value)


CHECKPOINT_DAMAGE = {  # name -> (the damaged checkpoint, from the good one; the fragment)
    "snapshots a list": (lambda c: {**c, "snapshots": list(c["snapshots"].values())}, "snapshots is a list"),
    "snapshots empty": (lambda c: {**c, "snapshots": {}}, "holds weight versions [], where step 3 at staleness 1 "
                                                          "needs [2]"),
    "fp16 master": (lambda c: {**c, "master": {k: v.half() for k, v in c["master"].items()}},
                    "is torch.float16, not the fp32 master weights"),
    "version of another shape": (lambda c: {**c, "snapshots": {2: {k: v[:1] for k, v in c["master"].items()}}},
                                 "weight version 2 is not the master's fp32 tensors"),
}


@pytest.mark.parametrize("damage", list(CHECKPOINT_DAMAGE))
def test_a_damaged_checkpoint_is_one_line(damage, tmp_path, capsys):
    """A checkpoint whose snapshots are a list (an IndexError) or empty (the producer waited for ever), or whose
    master weights are fp16 (accepted): one line naming the file, before any step."""
    out = _resumable(tmp_path, capsys)
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    make, fragment = CHECKPOINT_DAMAGE[damage]
    torch.save(make(ckpt), out / "checkpoint.pt")
    line = bad_cli(over(T, "--out", str(out), "--resume", "--steps", "4"), capsys)
    assert "checkpoint.pt: " in line and fragment in line, line


def test_a_damaged_snapshot_is_one_line_for_trace_run(tmp_path, capsys):
    """trace --run: a snapshot holding 1 of the model's tensors, or int64 tensors, was read as if whole."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "run"
    assert main(over(T, "--steps", "1", "--keep-snapshots", "1", "--out", str(out))) == 0
    path = out / "snapshots" / "step-000001.safetensors"
    weights = load_file(str(path))
    first = sorted(weights)[0]
    save_file({first: weights[first]}, str(path))
    line = bad_cli(["trace", "--run", str(out)], capsys, after_progress=True)
    assert f"holds 1 of the model's {len(weights)} tensors" in line, line
    save_file({k: v.long() for k, v in weights.items()}, str(path))
    line = bad_cli(["trace", "--run", str(out)], capsys, after_progress=True)
    assert "is torch.int64, not the fp32 weights train writes" in line, line


def test_a_model_larger_than_memory_is_refused_before_it_is_built(tmp_path, capsys, tiny):
    """A model directory whose config.json says num_hidden_layers: 10**9 had the process killed while transformers
    built the layers; the size its config describes is checked against the machine's memory first."""
    tiny.model.save_pretrained(tmp_path / "m")
    tiny.tokenizer.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**9}))
    line = bad_cli(["diagnose", "--model", str(tmp_path / "m"), "--n", "2"], capsys)
    assert "config.json describes at least" in line and "more than this machine's" in line, line
