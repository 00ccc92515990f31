"""The adversarial audit (issue 18) as a test: every bad input of every command on the tiny model ends in exit 2 and
one line on stderr naming what is wrong, never a traceback; and the stateful misuses (a changed input on resume, an
orphan metrics file, a continued experiment with other settings, NaN weights) are refused or counted, not ignored.

`bad_cli` (conftest) runs the CLI in-process and asserts exit 2, one stderr line and no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import bad_cli
from phantomclip.cli import main

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
    (["experiment", "sanity", "--only", ""], "--only is empty: name the arms to run"),
    (["train", "--intervention", "epsilon=5"], "epsilon=X: X must be a finite number > 0 and < 1, got 5"),
    (["train", "--intervention", "epsilon=0"], "epsilon=X: X must be a finite number > 0 and < 1, got 0"),
    (["experiment", "sanity", "--only", " , "], "--only is empty: name the arms to run"),
    (["report", "--serve", "--port", "99999"], "--port: '99999' is not a port"),
    (["report", "--serve", "--port", "-1"], "--port: '-1' is not a port"),
]


def _no_model_work(monkeypatch):
    """Make any model load fail loudly (every loader ends in models.check_vocab): a case that passes refused its
    input before loading anything."""
    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr("phantomclip.models.check_vocab", loaded)


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
        m.setattr("phantomclip.prompts.encode_prompts", lambda *a: pytest.fail("the huge prompt was tokenized"))
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
    line = bad_cli([*T, "--prompts", str(prompts), "--out", out, "--resume", "--steps", "3"], capsys)
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
    assert "already has 2 steps, more than --steps 1" in bad_cli([*T, "--out", out, "--resume", "--steps", "1"],
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
    from phantomclip.models import tiny_tokenizer
    from phantomclip.trainer import NONFINITE_STOP

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
    from phantomclip.diagnose_text import verdict

    result = {"engine": {"dtype": "bf16", "nonfinite_logprobs": 96}, "config": {"epsilon": 0.2, "epsilon_high": 0.2},
              "recipes": {"fp32": {"tokens": 0, "nonfinite": 96}}}
    text = verdict(result)
    assert text.startswith("No β could be measured: 96 completion tokens were sampled but their log-probs are not")
    result["engine"]["nonfinite_logprobs"], result["recipes"]["fp32"]["nonfinite"] = 0, 0
    assert verdict(result) == "No completion tokens were scored: raise --max-tokens or --n."


def test_a_failed_resume_releases_the_lock_and_rewrites_nothing(tmp_path, capsys):
    """A checkpoint without the trainer's state (or with a step past --steps) is refused before any file is
    rewritten, and the refusal releases the directory: the same process can try again and gets the same line."""
    from phantomclip.runs import jsonl_line

    out = tmp_path / "run"
    assert main([*T, "--out", str(out)]) == 0
    capsys.readouterr()
    metrics = (out / "metrics.jsonl").read_text()
    torch.save({"step": 1}, out / "checkpoint.pt")
    for _ in range(2):
        assert "checkpoint.pt is not a checkpoint this tool wrote (no master, optimizer, scaler, snapshots)" in bad_cli(
            [*T, "--out", str(out), "--resume", "--steps", "3"], capsys)
    torch.save({"step": 5, "master": {}, "optimizer": {}, "scaler": {}, "snapshots": {}}, out / "checkpoint.pt")
    assert "already has 5 steps, more than --steps 3" in bad_cli([*T, "--out", str(out), "--resume", "--steps", "3"],
                                                                 capsys)
    assert (out / "metrics.jsonl").read_text() == metrics and jsonl_line({"x": float("nan")}) == '{"x": null}\n'


def test_a_run_made_before_input_hashes_still_resumes(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\n")
    out = tmp_path / "run"
    assert main([*T, "--prompts", str(prompts), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    del config["inputs"]  # as runs written before this version
    (out / "config.json").write_text(json.dumps(config))
    assert main([*T, "--prompts", str(prompts), "--out", str(out), "--resume", "--steps", "3"]) == 0


def test_experiment_continuation_and_seeds_are_checked_before_any_run(tmp_path, capsys):
    args = ["experiment", "sanity", *TINY, "--only", "none", "--seeds", "1", "--steps", "1", "--group-size", "2",
            "--max-tokens", "4", "--out", str(tmp_path / "e")]
    assert main(args) == 0
    capsys.readouterr()
    assert "--reward 'nosuch.sub:f': cannot import nosuch.sub" in bad_cli([*args, "--reward", "nosuch.sub:f"], capsys)
    assert "prompts file" in bad_cli([*args, "--prompts", str(tmp_path / "missing.txt")], capsys)
    line = bad_cli([*args[:-2], "--out", str(tmp_path / "f"), "--seed", "4294967295", "--seeds", "2"], capsys)
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
    from phantomclip.loss import KNOBS

    _no_model_work(monkeypatch)
    lines = [bad_cli(["train", train_flag, value], capsys),
             bad_cli(["experiment", "sanity", train_flag, value], capsys),
             bad_cli(["diagnose", diagnose_flag, value], capsys)]
    ranges = {line.split(" must be ")[1].split(", got")[0] for line in lines}
    assert len(ranges) == 1, lines
    knob = KNOBS[{"--correction-cap": "cap"}.get(train_flag, train_flag[2:].replace("-", "_"))]
    assert ranges.pop().startswith(f"a finite number {'>' if knob.low_open else '>='} {knob.low:g}"), lines
    # a value at the edge of every range (1 for the caps and IcePop's bounds, a ratio of 1 is never cut) is accepted
    from phantomclip.diagnose import DiagnoseConfig
    from phantomclip.trainer import TrainConfig

    TrainConfig(correction_cap=1.0, icepop_low=1.0, icepop_high=1.0, epsilon_high=1.5).validate()
    DiagnoseConfig(token_cap=1.0, seq_mask_cap=1.0, icepop_low=1.0, icepop_high=1.0, epsilon_high=1.5).validate()


@pytest.mark.parametrize("spec", ["tiny-random:4294967296", "tiny-random:99999999999999999999", "tiny-random:-1"])
def test_a_model_seed_follows_the_seed_rule(spec, capsys):
    """`tiny-random:2**32` was `tiny-random:0` (torch's seed wraps), a 20-digit seed a traceback: --seed's rule."""
    line = bad_cli(["diagnose", "--model", spec, "--n", "2"], capsys)
    assert "its SEED must be a whole number from 0 to 4294967295" in line, line


def _resumable(tmp_path, capsys) -> Path:
    out = tmp_path / "run"
    assert main([*T, "--steps", "3", "--out", str(out)]) == 0  # a checkpoint at every step
    capsys.readouterr()
    return out


@pytest.mark.parametrize("damage,fragment", [
    ("append-old", "line 4: step 2 where a step after 3 (the checkpoint's) belongs"),
    ("drop-middle", "line 2: step 3 where step 2 belongs"),
    ("swap", "line 1: step 2 where step 1 belongs"),
    ("no-checkpoint", "has 3 logged steps but no checkpoint.pt to continue from"),
])
def test_resume_refuses_damaged_rows_and_a_missing_checkpoint(tmp_path, capsys, damage, fragment):
    """Resume continues only from rows 1..k in order and the checkpoint of step k: a duplicated, missing or reordered
    row, or a deleted checkpoint, is one line naming the file (and line), and nothing is rewritten."""
    out = _resumable(tmp_path, capsys)
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    if damage == "append-old":
        metrics.write_text("".join(lines) + lines[1])
    elif damage == "drop-middle":
        metrics.write_text(lines[0] + lines[2])
    elif damage == "swap":
        metrics.write_text(lines[1] + lines[0] + lines[2])
    else:
        (out / "checkpoint.pt").unlink()
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.suffix == ".jsonl"}
    line = bad_cli([*T, "--steps", "4", "--out", str(out), "--resume"], capsys)
    assert fragment in line, line
    assert before == {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.suffix == ".jsonl"}
