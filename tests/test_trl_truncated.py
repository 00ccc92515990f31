"""TRL under truncated sampling: TRL's IS figures compare its trainer's log-probs (temperature, full
vocabulary) with vLLM's processed ones (renormalised over top-p's kept tokens: trl 1.16 asks vLLM for
logprobs_mode='processed_logprobs'), so what phantomclip says TRL would log is computed on that pair, and the
`--setup trl-grpo` answer names the down-weighting it brings.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import eps
from phantomclip.cli.main import main
from phantomclip.maths.frameworks import TRL_IS_CAP

TINY = ["--model", "tiny-random:0", "--trainer", "fp32,bf16"]


def _diagnose(tmp_path: Path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    assert main(["diagnose", *TINY, "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def truncated(tmp_path_factory):
    """The local engine at temperature 0.8, top-p 0.9: its processed log-probs saved (what TRL's recorder writes),
    then read back under --setup trl-grpo."""
    tmp = tmp_path_factory.mktemp("trl")
    path = tmp / "r.jsonl"
    _diagnose(tmp, "sampled", "--n", "8", "--max-tokens", "12", "--temperature", "0.8", "--top-p", "0.9",
              "--save-rollouts", str(path))
    return _diagnose(tmp, "recorded", "--rollouts", str(path), "--setup", "trl-grpo")


def _by_hand(result: dict, engine_key: str) -> tuple[float, float]:
    """(mean |ℓ| over tokens, mean IS weight over sequences) as TRL 1.16 grpo_trainer.py computes them (sequence_mask:
    ρ_s = exp(Σ_t ℓ_t), 0 above C_max = 3), with ℓ = the fp32 trainer's log-prob (β + the full engine column) minus
    the column `engine_key`, from the per-token arrays."""
    tok = result["tokens"]
    logp = [b + e for b, e in zip(tok["per_recipe"]["fp32"]["beta"], tok["logp_engine"])]
    lr = [lp - e for lp, e in zip(logp, tok[engine_key])]
    sums: dict[int, float] = {}
    for s, v in zip(tok["sequence"], lr):
        sums[s] = sums.get(s, 0.0) + v
    weights = [0.0 if math.exp(v) > TRL_IS_CAP else math.exp(v) for v in sums.values()]
    return sum(abs(v) for v in lr) / len(lr), sum(weights) / len(weights)


def test_trl_figures_are_taken_against_the_processed_log_probs(truncated):
    """TRL's logged figures equal the hand computation against the processed column, and differ from the full-
    vocabulary reading by the kept mass: every ℓ is lower by −log S > 0, so the IS weight falls. Tolerance: the per-
    token arrays are rounded to 1e-6 (three of them per ℓ), summed over at most 12 tokens a sequence, plus fp32's
    epsilon on |ℓ| < 1; exp of a sum below log 3 moves by at most 3x that."""
    trl = truncated["recipes"]["fp32"]["frameworks"]["trl"]
    diff, weight = _by_hand(truncated, "logp_engine_processed")
    tol = 3 * 12 * (3 * 0.5e-6 + eps(torch.float32))
    assert trl["sampling/sampling_logp_difference/mean"] == pytest.approx(diff, abs=tol)
    assert trl["sampling/importance_sampling_ratio/mean"] == pytest.approx(weight, abs=tol)
    full_diff, full_weight = _by_hand(truncated, "logp_engine")
    assert weight < full_weight - 10 * tol and diff > full_diff + 10 * tol


def test_the_trl_grpo_answer_names_the_down_weighting(truncated):
    weight = truncated["recipes"]["fp32"]["frameworks"]["trl"]["sampling/importance_sampling_ratio/mean"]
    line = (f"  TRL down-weights every sequence by about {weight:.2f} (its mean IS weight, against vLLM's log-probs "
            "renormalised over top-p's kept tokens)")
    assert weight < 0.8 and line in truncated["answer"]["reasons"], truncated["answer"]["reasons"]
