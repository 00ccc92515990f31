"""diagnose end to end on tiny-random:0: the knob advice (JSON `knobs`, the printed
"for your config" block) and batch invariance (`recipes.<r>.split.batch`: the run's batch against each sequence
scored alone), with --no-batch-invariance and --keep-share."""

import json
import math
import re

import pytest
import torch

from conftest import assert_close_eps, bad_cli, forward_terms, fp32_forward_noise, logit_bound
from phantomclip.answer.verdict_text import _batch_verdict
from phantomclip.base.console import progress_bar
from phantomclip.cli.main import main
from phantomclip.diagnose.job import (
    BATCH_INVARIANCE_SEQUENCES,
    SPLIT_KEYS,
    DiagnoseConfig,
    alone_rows,
    figures,
    prepare,
    reference,
    run_diagnose,
    sample,
    score_recipe,
)
from phantomclip.diagnose.knobs import KnobSettings, knob_figures
from phantomclip.diagnose.text import KNOB_LABELS, _bound, knob_lines

TINY = ["diagnose", "--model", "tiny-random:0", "--max-tokens", "6", "--trainer", "fp32,bf16"]
QUIET = lambda *a, **k: None  # noqa: E731


def test_a_batch_of_one_sequence_is_its_own_alone_score():
    """--n 1 --batch-size 1: the batch is the sequence alone, unpadded, scored by the same call: β_batch is 0 exactly,
    for every recipe (the shadow's own dtype included)."""
    d = run_diagnose(DiagnoseConfig(model="tiny-random:0", trainer=["fp32", "bf16", "fp32-head"], n=1, batch_size=1,
                                    max_tokens=6))
    for name, stats in d["recipes"].items():
        batch = stats["split"]["batch"]
        assert list(batch) == list(SPLIT_KEYS), name
        assert batch["tokens"] == stats["tokens"] > 0, name
        assert batch["beta_abs_max"] == batch["beta_mean"] == batch["outside_trust_region"] == 0.0, name
        assert stats["seconds_alone"] > 0


def test_a_padded_batch_differs_by_fp32_rounding_only(tiny):
    """--batch-size 4, 8 sequences of different lengths: in the batch each row is padded (prompts left, completions
    right) and runs in [4, T] matmuls and attention over T positions; alone it runs [1, L_b]. Padding is masked out
    exactly (exp(−inf) = 0), so what is left is the order of the fp32 reductions: the bound of two fp32 forwards that
    reorder every reduction, 2 eps_fp32 · max|logit| · sqrt(rounding events on the path to a logit), with max|logit|
    bounded by the weights (conftest.logit_bound) and the context the longest row (conftest.forward_terms).
    |Δ log p| ≤ 2 max|Δz| would double it; the factor 2 of the bound already covers two computations each off by
    eps · scale · sqrt(terms), and real kernels stay far below (the printed margin)."""
    cfg = DiagnoseConfig(model="tiny-random:0", trainer=["fp32"], n=8, batch_size=4, max_tokens=8)
    prep = prepare(cfg, QUIET)
    with progress_bar(None) as bar:
        sampled = sample(cfg, prep, bar, QUIET)
        scored = {"bf16": score_recipe(cfg, prep, sampled, "bf16", True, bar),
                  "fp32": score_recipe(cfg, prep, sampled, "fp32", False, bar)}
    assert scored["bf16"].logp_alone is None  # the shadow is not a trainer recipe here: not scored alone
    fp32, mask = scored["fp32"], sampled.mask  # [n, T]
    context = max(int(p["attention_mask"].sum(-1).max()) for p in sampled.packed)
    padded = any(bool((p["attention_mask"] == 0).any()) for p in sampled.packed)
    assert padded and cfg.n <= BATCH_INVARIANCE_SEQUENCES  # every row padded somewhere and scored alone
    assert_close_eps(fp32.logp[mask], fp32.logp_alone[mask], torch.float32, scale=logit_bound(tiny.model),
                     terms=forward_terms(tiny.model.config, context), factor=2, name="fp32 batch vs alone")
    ref = reference(sampled, scored["bf16"], "bf16")
    batch = figures(cfg, scored, ref, mask).recipes["fp32"]["split"]["batch"]
    assert batch["tokens"] == int(mask.sum()) and batch["beta_abs_max"] <= fp32_forward_noise(tiny.model, context)


def test_alone_rows_spread_over_the_run():
    assert alone_rows(5) == [0, 1, 2, 3, 4] and alone_rows(BATCH_INVARIANCE_SEQUENCES) == list(range(12))
    # 64 rows, 12 alone: row i * 64 // 12 = 0, 5.33 -> 5, 10.67 -> 10, 16, 21, 26, 32, 37, 42, 48, 53, 58
    assert alone_rows(64) == [0, 5, 10, 16, 21, 26, 32, 37, 42, 48, 53, 58]
    rows = alone_rows(20)  # i * 20 // 12: ..., 11 * 20 // 12 = 18
    assert len(set(rows)) == 12 and rows[0] == 0 and rows[-1] == 18


def test_json_and_tables_hold_the_batch_part_and_the_knobs(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert main(TINY + ["--n", "3", "--json", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())  # undo the console's wrap
    d = json.loads(out.read_text())
    for stats in d["recipes"].values():
        assert list(stats["split"]) == ["precision", "kernel", "batch", "correlation"]
        assert stats["split"]["batch"]["tokens"] == stats["tokens"] and stats["seconds_alone"] > 0
    assert "batch |β|" in printed and "batch out" in printed and "β_batch (the run's batch" in printed
    k, fp32 = d["knobs"], d["recipes"]["fp32"]
    assert k["recipe"] == "fp32" and k["keep_share"] == 0.99 and set(KNOB_LABELS) <= set(k)
    # the same definitions as the recipe's own figures, on the same β
    assert k["beta"]["tokens"] == fp32["tokens"] and k["beta"]["sequences"] == fp32["sequences"]
    assert k["clip"]["tokens"] == fp32["outside_trust_region"]
    assert k["sequence_mask"]["sequences"] == fp32["seq_mask_drop_share"]
    assert k["geo_mask"]["sequences"] == fp32["seq_geo_outside_trust_region"]
    # tiny-random rarely stops early: the mean length is near --max-tokens, nothing is extrapolated
    assert not k["length"]["extrapolated"] and all(k[name]["at_length"] is None for name in KNOB_LABELS)
    assert re.search(r"for your config \(fp32 trainer's β on the sampled completions, mean \d+ tokens; every "
                     r"figure: JSON knobs\):", " ".join(printed.split()))
    lines = knob_lines(k)
    assert len(lines) == len(KNOB_LABELS)
    for line in lines:
        assert " ".join(line.split()) in printed
    assert lines[0].startswith("PPO clip ε 0.2/0.2: clips ") and "99% of tokens untouched" in lines[0]


def test_keep_share_moves_the_advice_not_the_shares():
    base = dict(model="tiny-random:0", trainer=["fp32"], n=3, max_tokens=6, batch_invariance=False)
    a, b = run_diagnose(DiagnoseConfig(**base))["knobs"], run_diagnose(DiagnoseConfig(**base, keep_share=0.5))["knobs"]
    assert a["clip"]["tokens"] == b["clip"]["tokens"]
    assert b["clip"]["keep"]["epsilon_high"] <= a["clip"]["keep"]["epsilon_high"]
    assert b["token_mask"]["keep"]["cap"] <= a["token_mask"]["keep"]["cap"]


def test_no_batch_invariance_removes_it(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert main(TINY + ["--n", "2", "--no-batch-invariance", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    d = json.loads(out.read_text())
    assert d["config"]["batch_invariance"] is False
    for stats in d["recipes"].values():
        assert "batch" not in stats["split"] and "seconds_alone" not in stats
    assert "batch |β|" not in printed and "for your config" in printed


@pytest.mark.parametrize("value", ["0", "1", "nan"])
def test_bad_keep_share_is_one_line(value, capsys):
    line = bad_cli(TINY + ["--keep-share", value], capsys)
    want = f"--keep-share must be a finite number > 0 and < 1, got {float(value)!r}"
    assert line == f"phantomclip diagnose: error: {want}"


def test_batch_verdict_only_when_batch_layout_beats_precision():
    def result(batch, precision):
        split = {"precision": {"outside_trust_region": precision}, "batch": {"outside_trust_region": batch}}
        return {"config": {"batch_size": 64}, "recipes": {"fp32": {"split": split}}}

    said = _batch_verdict(result(0.002, 0.001), "fp32")
    assert said.startswith("Batch layout alone puts 0.20% of fp32's tokens outside the trust region (fp32 in the run's "
                           "padded batch of 64 against the same sequences scored one at a time), more than "
                           "β_precision does (0.10%)")
    assert _batch_verdict(result(0.001, 0.001), "fp32") == ""
    assert _batch_verdict(result(None, 0.0), "fp32") == ""  # JSON null: nothing scored alone
    assert _batch_verdict(result(math.nan, 0.0), "fp32") == ""
    assert _batch_verdict({"config": {}, "recipes": {"fp32": {"split": {"precision": {}}}}}, "fp32") == ""


def test_knob_lines_mark_the_extrapolated_figures():
    """tests/test_knobs.py's extrapolation table: β = [[0, 0.2], [0.2, 0.2]] sampled at length 2, told at 4 tokens.
    clip: the three 0.2 are above log 1.2 (75% of tokens, both sequences; 1 − 0.25^4 = 99.61% of 4-token ones),
    ε_high ≥ e^0.2 − 1 = 0.2214 printed rounded up, ε_low the current 0.2 (never narrower than now);
    sequence_mask at C = e^0.7: S = [0.2, 0.4] drops nothing; at the sampled length (2 tokens) 99% of the two
    sequences untouched needs C ≥ e^0.4 = 1.4918, printed rounded up as 1.5; P(S_4 > 0.7) = 22.66%, C ≥ 2.4848
    printed as 2.49 for 4-token ones: each figure names its length."""
    beta = torch.tensor([[0.0, 0.2], [0.2, 0.2]])
    knobs = knob_figures(beta, torch.ones(2, 2, dtype=torch.bool), KnobSettings(seq_mask_cap=math.exp(0.7)), 0.99, 4)
    lines = dict(zip(KNOB_LABELS, knob_lines(knobs)))
    assert lines["clip"] == ("PPO clip ε 0.2/0.2: clips 75.00% of tokens, 100.00% of sequences; 99.61% of 4-token ones "
                             "(extrapolated) -> ε_low ≥ 0.2, ε_high ≥ 0.222 for 99% of tokens untouched")
    assert lines["sequence_mask"] == ("sequence_mask C = 2.01375: drops 0.00% of sequences (0.00% of tokens); 22.66% "
                                      "of 4-token ones (extrapolated) -> C ≥ 1.5 for 99% of sequences untouched "
                                      "at the sampled length (mean 2 tokens); C ≥ 2.49 for 99% of 4-token ones "
                                      "(extrapolated)")


def test_bound_rounds_outward():
    assert (_bound(0.15301, True), _bound(0.8412, False), _bound(1.0, True), _bound(2.4848, True)) == (
        "0.154", "0.841", "1", "2.49")
    assert (_bound(None, True), _bound(math.nan, True), _bound(math.inf, True), _bound(0.0, True)) == (
        "n/a", "n/a", "inf", "0")
