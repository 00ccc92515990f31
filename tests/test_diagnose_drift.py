"""diagnose --drift: the same weights pushed K times into the engine, the same tokens read after
each push (engines/drift.py). Unchanged weights leave the local engine bit-identical; a weight changed between
pushes shows as a gap, so the measurement can fail; the gap gates the exit code."""

import json
import math

import pytest
import torch

from conftest import bad_cli
from phantomclip.base.errors import ConfigError
from phantomclip.cli.main import main
from phantomclip.diagnose.job import DiagnoseConfig
from phantomclip.engines.drift import first_rows, measure_drift, reading_gap
from phantomclip.engines.local import LocalEngine, Rollout, SamplingParams

TINY = ["diagnose", "--model", "tiny-random:0", "--n", "4", "--max-tokens", "6", "--trainer", "fp32",
        "--no-batch-invariance"]
PARAMS = SamplingParams(max_tokens=8, seed=3)


def _sampled(tiny, tiny_prompts) -> tuple[LocalEngine, Rollout]:
    engine = LocalEngine(tiny.model, torch.bfloat16)
    return engine, engine.generate(tiny_prompts[:4], PARAMS)


def test_unchanged_weights_pushed_three_times_leave_the_local_engine_bit_identical(tiny, tiny_prompts):
    engine, rollout = _sampled(tiny, tiny_prompts)
    drift = measure_drift(engine, tiny.model, rollout, PARAMS, syncs=3)
    assert drift.method == "rescore" and drift.sequences == 4
    assert drift.tokens == sum(len(c) for c in rollout.completion_ids) > 0
    assert [s.sync for s in drift.steps] == [1, 2, 3]
    for step in drift.steps:  # exactly zero: the same bf16 weights and the same decode give the same bits
        assert (step.max_abs, step.changed_share, step.token_changed_share, step.weights_changed_share) == (0, 0, 0, 0)
    assert drift.max_abs == 0.0 and not drift.moving
    block = drift.as_dict()
    assert (block["syncs"], block["max_abs"], block["moving"]) == (3, 0.0, False) and len(block["steps"]) == 3


def test_a_weight_changed_between_pushes_shows_as_a_gap(tiny, tiny_prompts):
    """The measurement can fail: push 2 carries a changed final-norm weight (every logit moves), push 3 the original
    weights again. Push 1 is bit-identical, push 2 moves, push 3 is back to the reference exactly."""
    engine, rollout = _sampled(tiny, tiny_prompts)
    real_load = engine.load_weights
    pushes = []

    def load_with_a_defect(weights, count_changes=True):
        pushes.append(1)
        state = dict(weights.state_dict())
        if len(pushes) == 2:
            state["model.norm.weight"] = state["model.norm.weight"] * 1.5
        return real_load(state, count_changes)

    engine.load_weights = load_with_a_defect
    drift = measure_drift(engine, tiny.model, rollout, PARAMS, syncs=3)
    first, second, third = drift.steps
    assert first.max_abs == 0 and third.max_abs == 0 and third.weights_changed_share > 0  # back to the original
    assert second.max_abs > 0.01 and second.changed_share > 0.5 and second.weights_changed_share > 0
    assert second.token_changed_share == 0  # forced tokens: only their log-probs can move
    assert drift.moving and drift.max_abs == second.max_abs


def test_reading_gap_hand_worked():
    """Two readings of two sequences. Sequence 0: the same tokens, the second log-prob moved by 0.5. Sequence 1: the
    second token differs (5 -> 6) and the new reading is one token longer, so only its first token is compared and
    2 of its 3 positions are lost. Compared 3 + 1 = 4 tokens, 1 of them moved: changed 1/4; lost 2 of 3 + 3
    positions: 1/3. The processed column is NaN on both sides (not reported): no gap."""
    nan = math.nan
    ref = Rollout([[9], [9]], [[1, 2, 3], [4, 5]], [[-1.0, -2.0, -3.0], [-0.5, -0.25]], [[nan] * 3, [nan] * 2])
    now = Rollout([[9], [9]], [[1, 2, 3], [4, 6, 7]], [[-1.0, -2.5, -3.0], [-0.5, -9.0, -9.0]],
                  [[nan] * 3, [nan] * 3])
    gap = reading_gap(ref, now)
    assert (gap.max_abs, gap.changed_share, gap.token_changed_share, gap.tokens) == (0.5, 0.25, 1 / 3, 4)
    assert reading_gap(ref, ref) == type(gap)(0.0, 0.0, 0.0, 5)
    # a log-prob that became NaN on one side only is an infinite gap, not a silent skip
    lost = Rollout([[9]], [[1]], [[nan]], [[nan]])
    assert reading_gap(Rollout([[9]], [[1]], [[-1.0]], [[nan]]), lost).max_abs == math.inf


class _ResamplingEngine:
    """An engine without teacher forcing (as vLLM behind our interface): generate returns fixed tokens and
    log-probs, which from the `defect_from`-th load on differ at the second position."""

    def __init__(self, defect_from: int):
        self.loads, self.defect_from = 0, defect_from

    def load_weights(self, weights, count_changes=True) -> float:
        self.loads += 1
        return 0.0

    def generate(self, prompts, params):
        moved = self.loads >= self.defect_from
        ids = [[1, 8 if moved else 2, 3] for _ in prompts]
        logps = [[-1.0, -0.7 if moved else -2.0, -3.0] for _ in prompts]
        return Rollout([list(p) for p in prompts], ids, logps, logps)


def test_an_engine_without_rescore_is_resampled_and_a_changed_token_counts():
    fixed = Rollout([[5], [6]], [[1, 2, 3], [1, 2, 3]], [[-1.0, -2.0, -3.0]] * 2, [[-1.0, -2.0, -3.0]] * 2)
    steady = measure_drift(_ResamplingEngine(defect_from=99), {}, fixed, PARAMS, syncs=2)
    assert steady.method == "resample" and not steady.moving and steady.max_abs == 0
    drift = measure_drift(_ResamplingEngine(defect_from=2), {}, fixed, PARAMS, syncs=2)
    # push 2: the second token differs in both sequences; the first token is compared (unchanged), the rest lost
    assert drift.steps[0].token_changed_share == 0 and drift.steps[1].token_changed_share == pytest.approx(2 / 3)
    assert drift.steps[1].max_abs == 0 and drift.moving


def test_first_rows_keeps_the_first_sequences():
    r = Rollout([[1], [2], [3]], [[4], [5], [6]], [[-1.0], [-2.0], [-3.0]], [[-1.0], [-2.0], [-3.0]], [True] * 3)
    assert first_rows(r, 2) == Rollout([[1], [2]], [[4], [5]], [[-1.0], [-2.0]], [[-1.0], [-2.0]], [True] * 2)


def test_drift_zero_or_negative_is_one_line_exit_2(capsys):
    for bad in ("0", "-1", "two"):
        line = bad_cli(TINY + ["--drift", bad], capsys)
        assert "--drift" in line and "whole number >= 1" in line, line
    with pytest.raises(ConfigError, match=r"--drift must be a whole number >= 1, got 0"):
        DiagnoseConfig(model="tiny-random:0", drift=0).validate()


def test_diagnose_drift_end_to_end(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert main(TINY + ["--drift", "2", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    d = json.loads(out.read_text())
    assert d["schema"] == 2 and d["config"]["drift"] == 2
    drift = d["drift"]
    assert (drift["syncs"], drift["method"], drift["max_abs"], drift["moving"]) == (2, "rescore", 0.0, False)
    assert drift["tokens"] == d["engine"]["tokens"] and drift["seconds"] > 0  # n 4 < 16: every sequence is read
    assert "drift: 2 pushes of unchanged weights" in captured.out and "push 2: max |Δ logp| 0," in captured.out
    assert "bit-identical" in d["verdict"]
    assert "all 1 --fail-if gates hold" in captured.err  # --drift's own gate, drift.max_abs>0
    assert "drift" not in json.loads(_run_plain(tmp_path, capsys))  # opt-in: no block without --drift


def _run_plain(tmp_path, capsys) -> str:
    out = tmp_path / "plain.json"
    assert main(TINY + ["--json", str(out)]) == 0
    capsys.readouterr()
    return out.read_text()


def test_a_moving_gap_fails_the_gate_unless_the_user_sets_their_own(tmp_path, capsys, monkeypatch):
    real_load = LocalEngine.load_weights

    def drifting_load(self, weights, count_changes=True):  # every push nudges the final norm: a defective sync
        state = dict(weights.state_dict())
        state["model.norm.weight"] = state["model.norm.weight"] * 1.25
        return real_load(self, state, count_changes)

    monkeypatch.setattr(LocalEngine, "load_weights", drifting_load)
    out = tmp_path / "d.json"
    assert main(TINY + ["--drift", "2", "--json", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    d = json.loads(out.read_text())
    assert d["drift"]["moving"] and d["drift"]["max_abs"] > 0
    assert err[-1] == f"phantomclip diagnose: gate failed: drift.max_abs = {d['drift']['max_abs']:g}, bound: > 0"
    assert "Engine defect" in d["verdict"]
    # a gate of the user's own on a drift key replaces --drift's: here a tolerance the gap stays under
    assert main(TINY + ["--drift", "1", "--fail-if", "drift.max_abs>1e9"]) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == "phantomclip diagnose: all 1 --fail-if gates hold"
