import json
import math
import re
import subprocess
import sys

import pytest
import torch

from conftest import as_written_before_run_ids, bad_cli, eps, fp32_forward_noise, offline, over
from phantomclip.answer.decide import LEVELS, ranking
from phantomclip.cli.main import main

TINY = ["diagnose", "--model", "tiny-random:0", "--n", "6", "--max-tokens", "12"]


def test_diagnose_end_to_end_on_tiny(tmp_path, capsys):
    out = tmp_path / "sub" / "d.json"
    assert main(TINY + ["--trainer", "fp32,bf16,fp16", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for word in ("beta_abs_mean", "outside_trust_region", "kl_k3", "ess_token", "verdict:", "fp16"):
        assert word in printed
    d = json.loads(out.read_text())
    assert list(d["recipes"]) == ["fp32", "bf16", "fp16"]
    assert (d["config"]["epsilon"] == 0.2 and d["config"]["seed"] == 0
            and d["config"]["trainer"] == ["fp32", "bf16", "fp16"])
    assert {"torch", "transformers", "phantomclip"} <= set(d["versions"])
    n = d["engine"]["tokens"]
    assert 6 <= n <= 6 * 12 and d["engine"]["dtype"] == "bf16"
    tok = d["tokens"]
    assert len(tok["sequence"]) == len(tok["position"]) == len(tok["logp_engine"]) == n
    assert sorted(set(tok["sequence"])) == list(range(6)) and min(tok["position"]) == 0
    for name, stats in d["recipes"].items():
        assert stats["tokens"] == n and stats["nonfinite"] == 0
        beta = tok["per_recipe"][name]["beta"]
        assert len(beta) == n and len(tok["per_recipe"][name]["entropy"]) == n
        # the summary figures are the per-token arrays, summarised: the JSON rounds each value to 6 decimals
        # (<= 5e-7), the per-token values are fp32 differences (<= eps_fp32 / 2 * |β| apart from float64 ones), and
        # the mean sums n float64 values (2 eps_fp64 * max|β| * sqrt(n))
        big = max(abs(b) for b in beta)
        tol = 5e-7 + eps(torch.float32) / 2 * big + 2 * eps(torch.float64) * big * n**0.5
        assert abs(stats["beta_mean"] - sum(beta) / n) <= tol, (name, stats["beta_mean"], sum(beta) / n)
        assert abs(stats["beta_abs_max"] - big) <= tol, (name, stats["beta_abs_max"], big)
        outside = sum(b < math.log(0.8) or b > math.log(1.2) for b in beta) / n
        assert stats["outside_trust_region"] == pytest.approx(outside)
    # a bf16 trainer against a bf16 engine sees a much smaller gap than fp32 does (tiny model: kernels agree)
    assert d["recipes"]["bf16"]["beta_abs_mean"] < d["recipes"]["fp32"]["beta_abs_mean"] / 3
    # the ranking puts bf16 first when it has fewer tokens outside, or as many and a smaller mean |β|
    # (answer/changes.kernel_rule: bf16's body runs the local engine's own kernels, so the verdict leaves it out)
    assert ranking(d)[0] != "bf16" or "; bf16 left out: its body runs the local engine's own kernels" in d["verdict"]
    assert d["answer"]["contract"]["trainer"] == "fp32" and d["answer"]["level"] == LEVELS[d["answer"]["status"]]


def test_fp32_engine_against_fp32_trainer_is_zero_gap(tmp_path, capsys, tiny, tiny_prompts):
    out = tmp_path / "d.json"
    assert main(TINY + ["--trainer", "fp32", "--engine-dtype", "fp32", "--json", str(out)]) == 0
    stats = json.loads(out.read_text())["recipes"]["fp32"]
    # fp32 decode against fp32 prefill: every reduction reordered, no precision gap (was < 1e-4; measured ~2e-5)
    noise = fp32_forward_noise(tiny.model, max(len(p) for p in tiny_prompts) + 12)
    assert stats["beta_abs_max"] <= noise and stats["outside_trust_region"] == 0, (stats["beta_abs_max"], noise)
    printed = " ".join(capsys.readouterr().out.split())  # undo the console's word wrap
    assert "Your fp32 trainer pushes no measured token outside the trust region" in printed
    # the answer comes first, and judges nothing here: the trainer is the local engine's own recipe, whose near-zero
    # gap is a property of the stand-in (it shares the trainer's kernels), not of the user's engine
    assert printed.startswith("answer: NOT JUDGED: your fp32 trainer's body runs the local engine's own kernels")


def test_bad_inputs_exit_2_with_one_line(tmp_path, capsys):
    assert "unknown recipe 'int8'" in bad_cli(TINY + ["--trainer", "fp32,int8"], capsys)
    assert "unknown dtype 'fp8'" in bad_cli(TINY + ["--engine-dtype", "fp8"], capsys)
    assert "--epsilon must be a finite number > 0 and < 1" in bad_cli(TINY + ["--epsilon", "1.5"], capsys)
    assert "--epsilon must be a finite number > 0 and < 1" in bad_cli(TINY + ["--epsilon", "0"], capsys)
    assert "--n must be a whole number >= 1" in bad_cli(over(TINY, "--n", "0"), capsys)
    assert "does not exist" in bad_cli(["diagnose", "--model", str(tmp_path / "missing")], capsys)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert "is empty" in bad_cli(TINY + ["--prompts", str(empty)], capsys)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "x"}\n{oops\n')
    assert "not valid JSON" in bad_cli(TINY + ["--prompts", str(broken)], capsys)
    long = tmp_path / "long.txt"
    long.write_text("x" * 600 + "\n")  # 600 byte tokens > the tiny model's 512 positions
    assert "exceeds the model's context of 512" in bad_cli(TINY + ["--prompts", str(long)], capsys)


def test_vocab_mismatch_and_offline_hub_id(tmp_path, capsys, monkeypatch, tiny):
    from phantomclip.models.load import tiny_tokenizer

    tiny.model.save_pretrained(tmp_path)
    tok = tiny_tokenizer()
    tok.add_tokens([f"<x{i}>" for i in range(80)])
    tok.save_pretrained(tmp_path)
    assert "tokens but the model embeds only 320" in bad_cli(["diagnose", "--model", str(tmp_path)], capsys)
    offline(monkeypatch)
    assert "cannot load model" in bad_cli(["diagnose", "--model", "nobody-xyz/none"], capsys)


def test_real_process_bad_input_has_no_traceback():
    p = subprocess.run([sys.executable, "-m", "phantomclip.cli.main", "diagnose", "--epsilon", "2"],
                       capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.strip() == "phantomclip diagnose: error: --epsilon must be a finite number > 0 and < 1, got 2.0"



def test_more_bad_inputs(tmp_path, capsys):
    assert "--temperature must be a finite number > 0, got 0.0" in bad_cli(TINY + ["--temperature", "0"], capsys)
    assert "top_p must be in (0, 1]" in bad_cli(TINY + ["--top-p", "2"], capsys)
    assert "--batch-size must be a whole number >= 1" in bad_cli(TINY + ["--batch-size", "0"], capsys)
    assert "--seed must be a whole number >= 0 and <= 4294967295" in bad_cli(TINY + ["--seed", str(10**23)], capsys)
    assert "is a directory" in bad_cli(TINY + ["--json", str(tmp_path)], capsys)
    assert "is a directory" in bad_cli(TINY + ["--prompts", str(tmp_path)], capsys)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9\n".encode("latin-1"))
    assert "is not UTF-8" in bad_cli(TINY + ["--prompts", str(latin)], capsys)
    assert "0 < INIT_STD <= 1" in bad_cli(["diagnose", "--model", "tiny-random:0:20"], capsys)
    broken = tmp_path / "model"
    broken.mkdir()
    (broken / "config.json").write_text("[]")
    assert "cannot load model" in bad_cli(["diagnose", "--model", str(broken)], capsys)


def test_bom_jsonl_prompts_and_positions(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('\ufeff{"prompt": "hello there"}\n{"prompt": "count to three"}\n', encoding="utf-8")
    out = tmp_path / "d.json"
    assert main(TINY[:-4] + ["--n", "2", "--max-tokens", "10", "--trainer", "fp32", "--prompts", str(prompts),
                             "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    seqs, pos = d["tokens"]["sequence"], d["tokens"]["position"]
    for s in set(seqs):  # positions run 0..len-1 inside each completion
        assert [p for q, p in zip(seqs, pos) if q == s] == list(range(seqs.count(s)))
    ent = d["tokens"]["per_recipe"]["fp32"]["entropy"]
    assert all(0 < e < math.log(320) for e in ent)  # a 320-token vocabulary bounds the entropy


def test_nonfinite_logprobs_are_counted_not_fatal(tmp_path, capsys, monkeypatch):
    """An fp16 overflow (simulated: inf on the first scored token of each row) is reported, and JSON stays strict."""
    import torch

    import phantomclip.diagnose.job as diag

    real_score = diag.score

    def overflowing(model, recipe, *args, **kw):
        s = real_score(model, recipe, *args, **kw)
        if recipe.name == "fp16":
            first = s.mask.float().argmax(-1)
            s.logp[torch.arange(len(first)), first] = float("inf")
        return s

    monkeypatch.setattr(diag, "score", overflowing)
    out = tmp_path / "d.json"
    assert main(TINY + ["--trainer", "fp32,fp16", "--json", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    text = out.read_text()
    assert "NaN" not in text and "Infinity" not in text
    d = json.loads(text)
    assert d["recipes"]["fp16"]["nonfinite"] == 6 and d["recipes"]["fp32"]["nonfinite"] == 0
    assert d["recipes"]["fp16"]["tokens"] == d["recipes"]["fp32"]["tokens"] - 6
    assert d["tokens"]["per_recipe"]["fp16"]["beta"].count(None) == 6
    assert "Non-finite log-probs (overflow) in: fp16 (6)" in printed


def test_diagnose_flags_are_the_config_fields():
    """The parser is built from DiagnoseConfig: every field a flag with the field's default, plus --json,
    --from-trl-config, --from-verl-config and --fail-if; an unknown --engine, --logprobs-mode or --matmul is one
    line, exit 2 (no choices list needed). --max-tokens parses to None when not given (a config file's completion
    length may fill it; _apply_config_file falls back to the field's default)."""
    import argparse
    import dataclasses

    from phantomclip.cli.main import _diagnose_parser
    from phantomclip.diagnose.job import DiagnoseConfig

    sub = argparse.ArgumentParser().add_subparsers()
    _diagnose_parser(sub)
    args = vars(sub.choices["diagnose"].parse_args([]))
    assert args.pop("json") is None and args.pop("from_trl_config") is None and args.pop("fail_if") is None
    assert args.pop("from_verl_config") is None and args.pop("from_verl_log") is None and args.pop("max_tokens") is None
    assert args.pop("n") is None  # None: 64 when sampling, every record with --rollouts (cli.sources)
    defaults = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
                for f in dataclasses.fields(DiagnoseConfig)}
    defaults["trainer"] = ",".join(defaults["trainer"])
    defaults["framework"] = ",".join(defaults["framework"])
    defaults.pop("max_tokens"), defaults.pop("n")
    for name in ("unmapped", "recorded_notes", "typed_flags", "checkpoint_lag", "rollouts_part"):  # not flags
        defaults.pop(name)
    assert args == defaults


def test_diagnose_refuses_unknown_names_in_one_line(capsys):
    assert "--engine 'sglang': use one of local, vllm" in bad_cli(TINY + ["--engine", "sglang"], capsys)
    assert "--logprobs-mode 'full': use one of raw, processed" in bad_cli(TINY + ["--logprobs-mode", "full"], capsys)
    assert "--matmul: unknown matmul mode 'fast'" in bad_cli(TINY + ["--matmul", "fast"], capsys)


def test_resume_takes_the_runs_own_settings(tmp_path, capsys):
    """`train --resume DIR` needs no flag again: every setting is the run's (config.json); a typed flag that differs
    from the run's is refused naming the key, one a resume may change (--steps) is taken."""
    out = tmp_path / "run"
    flags = ["--model", "tiny-random:0", "--group-size", "2", "--max-tokens", "4", "--lr", "1e-4"]
    assert main(["train", *flags, "--steps", "1", "--out", str(out)]) == 0
    assert main(["train", "--resume", str(out), "--steps", "2"]) == 0  # the model, group, length and lr: the run's
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and json.loads((out / "config.json").read_text())["lr"] == 1e-4
    capsys.readouterr()  # the two runs' progress
    line = bad_cli(["train", "--resume", str(out), "--steps", "3", "--lr", "2e-4"], capsys)
    assert line.endswith(f"--lr 0.0002: the run in {out} has 0.0001 (config.json); drop --lr to continue it, or start "
                         "a new run with another --out")
    assert "no config.json there" in bad_cli(["train", "--resume", str(tmp_path / "none")], capsys)
    assert "name two runs" in bad_cli(["train", "--resume", str(out), "--out", str(tmp_path / "b")], capsys)


def test_a_configs_length_and_the_cost_are_said_before_the_work(tmp_path, capsys):
    """A TRL config's max_completion_length is said with the run's size before sampling, with the flag that samples
    shorter; after the first recipe is scored, one line gives the time spent and the time to go."""
    config = tmp_path / "grpo.yaml"
    config.write_text("model_name_or_path: tiny-random:0\nmax_completion_length: 64\n")
    assert main(["diagnose", "--from-trl-config", str(config), "--n", "2", "--trainer", "fp32"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert ("this run samples 2 completions of up to 64 tokens (the config's length) and scores them under 2 recipes; "
            "--max-tokens 48 samples shorter, and the knob advice is still judged at 64 tokens") in err
    assert re.search(r"cost: sampled \d+ tokens in \d+ s; scored recipe 1 of 2 in \d+ s, about \d+ s to go", err)


def test_a_run_from_before_a_plan_key_was_added_resumes(tmp_path):
    """The plan gained `routes` (expert routing replay); a run whose config.json lacks it reads it as its default
    (training.config.ADDED_SINCE_SCHEMA_1, merged one level into the plan) and resumes."""
    out = tmp_path / "run"
    assert main(["train", "--model", "tiny-random:0", "--group-size", "2", "--max-tokens", "4", "--steps", "1",
                 "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    del config["plan"]["routes"]
    (out / "config.json").write_text(json.dumps(config))
    as_written_before_run_ids(out)  # nor did its rows carry run/id
    assert main(["train", "--resume", str(out), "--steps", "2"]) == 0


def test_version(capsys):
    """`phantomclip --version`: the package's version on stdout, exit 0, before any command."""
    from phantomclip import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"phantomclip {__version__}\n"


def test_help_texts_show_no_escaped_percent(capsys):
    """argparse %-formats a help (one '%%' prints '%') but prints a description as written: '95%%' in a description
    showed literally. Every command's and subcommand's help, walked."""
    commands = [[], ["diagnose"], ["train"], ["experiment"], ["trace"], ["engines"], ["report"],
                *(["experiment", name] for name in ("sanity", "epsilon", "fp8"))]
    for argv in commands:
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        printed = capsys.readouterr().out
        assert "usage:" in printed and "%%" not in printed, argv


def test_batch_invariance_help_counts_what_the_code_scores(capsys):
    """--help states the code's count of sequences scored alone (diagnose.job.BATCH_INVARIANCE_SEQUENCES) and no
    other count, and a measured cost, not an estimate."""
    from phantomclip.diagnose.job import BATCH_INVARIANCE_SEQUENCES

    with pytest.raises(SystemExit):
        main(["diagnose", "--help"])
    printed = " ".join(capsys.readouterr().out.split())
    said = printed[printed.index("--batch-invariance, --no-batch-invariance"):printed.index("--matmul MATMUL ")]
    counts = {int(m) for m in re.findall(r"(\d+) (?:single-sequence forwards|sequences)", said)}
    assert counts == {BATCH_INVARIANCE_SEQUENCES}, said
    assert "not measured" not in said and "bench/benchmarks/bench_batch_invariance.py" in said
