"""Behaviour kept through the house refactor and the three-way split: 3-step tiny runs recorded at 57c664d (before
both) give the same numbers now. The split renamed what the old keys meant: old β = logp − logp_shadow is now
β_precision, and old α = logp_shadow − logp_engine is now α + β_kernel; the optimisation itself (loss, gradient
norm, rewards, lengths) must not move at all. shadow-ratio is left out: it now clips on α alone, by design.
The fp16 file was recorded at 57c664d with `--matmul emulated`: since 9e3e6ef `auto` picks the emulated fp16 kernel on
CPUs without fp16 instructions (this one), so that is the arithmetic the default run does now; engines have run that
kernel on packed fp32 images, and at tiny-random's widths the packed sums equal the file's bit for bit
(checked on a 2-core AVX512-BF16 EPYC, 2026-12-02, without the F.linear override the test held until then).
The AVX2 files were recorded after the split (at ffc0515, before engines packed the emulated kernel, on a 2-core
AVX2-only EPYC), so they hold the split's keys and are compared key for key (SPLIT_KEYS)."""

import json
import math
from pathlib import Path

import pytest

from conftest import cpu_kind
from phantomclip.cli.main import main
from phantomclip.runs.read import nan_for_null

GOLDEN = Path(__file__).parent / "golden" / f"train-tiny-{cpu_kind()}"
ARGS = ["--model", "tiny-random:30", "--steps", "3", "--group-size", "4", "--max-tokens", "8", "--lr", "3e-3"]


SPLIT_KEYS = tuple(f"mismatch/{part}_{stat}" for part in ("alpha", "beta", "beta_kernel", "beta_precision")
                   for stat in ("mean", "abs_mean", "abs_p99", "outside_trust_region")) + ("clip/phantom_rate",
                                                                                             "clip/real_rate")
"""the split's figures, compared as they are where the recording already holds them."""


def _pairs(old: dict, new: dict) -> dict[str, tuple[float, float]]:
    same = {k: (old[k], new[k]) for k in ("reward/mean", "reward/std", "completion/length_mean", "train/loss",
                                          "train/grad_norm", "sync/changed_share", "mismatch/log_ratio_mean",
                                          "clip/rate")}
    if "mismatch/beta_precision_mean" in old:  # recorded after the split
        return {**same, **{k: (old[k], new[k]) for k in SPLIT_KEYS}}
    return {**same,
            "beta_mean -> beta_precision_mean": (old["mismatch/beta_mean"], new["mismatch/beta_precision_mean"]),
            "beta_abs_mean -> beta_precision_abs_mean": (old["mismatch/beta_abs_mean"],
                                                         new["mismatch/beta_precision_abs_mean"]),
            "alpha_mean -> alpha_mean + beta_kernel_mean": (
                old["mismatch/alpha_mean"], new["mismatch/alpha_mean"] + new["mismatch/beta_kernel_mean"])}


@pytest.mark.skipif(not GOLDEN.exists(), reason=f"no golden recorded for this CPU kind ({cpu_kind()})")
@pytest.mark.parametrize("intervention", ["none", "recompute-old", "fp16", "tis"])
def test_three_step_train_matches_the_recorded_run(tmp_path, intervention):
    name = "train3" if intervention == "none" else f"train3-{intervention}"
    assert main(["train", *ARGS, "--intervention", intervention, "--out", str(tmp_path / "run")]) == 0
    # the recordings hold bare NaN/Infinity, runs now write null (strict JSON): both read back as NaN, so a non-finite
    # value must stay non-finite (an fp16 overflow's inf gradient norm now reads as NaN)
    old = [nan_for_null(json.loads(line)) for line in (GOLDEN / f"{name}.jsonl").read_text().splitlines()]
    new = [nan_for_null(json.loads(line)) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(old) == len(new) == 3
    # 1e-12: the same fp32 computations in the same order give the same bits; the only new arithmetic is the float64
    # sum α + β_kernel of means of ~30 values of size <= 1 (rounding ~30 · 2^-53 ≈ 3e-15).
    bad = [f"step {o['step']} {k}: {a!r} -> {b!r}" for o, n in zip(old, new) for k, (a, b) in _pairs(o, n).items()
           if not (a == b or (a is None and b is None)
                   or (isinstance(a, float) and not math.isfinite(a) and math.isnan(b))
                   or abs(a - b) <= 1e-12)]
    assert not bad, "\n".join(bad[:10])
