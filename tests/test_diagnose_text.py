"""The verdict's thresholds at their edges, and rendering from the result dict alone."""

import io

import pytest

from phantomclip.answer.verdict_text import (
    ANTI_CORRELATED,
    SAME_GAP_SPREAD,
    SMALL_GAIN,
    _advice,
    _split_verdict,
    verdict,
)
from phantomclip.diagnose.text import render_diagnose


def _result(**gaps):
    """A result with one recipe per gap (the first is the user's), a bf16 local engine, ε 0.2 and a clip keep of ε_low
    0.3, ε_high 0.4 (wider than now: the ε advice is to widen)."""
    recs = {name: {"beta_abs_mean": g, "beta_abs_max": 0.5} for name, g in gaps.items()}
    return {"recipes": recs, "engine": {"dtype": "bf16", "kind": "local"},
            "trust_region": {"epsilon_low": 0.2, "epsilon_high": 0.2},
            "knobs": {"keep_share": 0.99, "clip": {"setting": {"epsilon_low": 0.2, "epsilon_high": 0.2},
                                                   "keep": {"epsilon_low": 0.3, "epsilon_high": 0.4}}}}


def test_same_gap_spread():
    """Recipes within SAME_GAP_SPREAD of each other are one gap (the engine's noise); the change sentence is the
    answer's own (status and changes, in its order), never the verdict's."""
    assert SAME_GAP_SPREAD == 1.25
    ok = {"status": "ok", "reasons": ["x"], "changes": []}
    r = _result(fp32=0.04, bf16=0.0496)
    one_gap = _advice(r, r["recipes"], ok)  # 0.0496 / 0.04 = 1.24
    assert one_gap.startswith("No trainer recipe removes the gap: all 2 are within 24% of each other, bf16 included")
    assert one_gap.endswith("As the answer above says (OK): nothing to change.")
    r = _result(bf16=0.0501, fp32=0.04)  # 1.2525: not one gap
    at_risk = {"status": "at risk", "reasons": ["x"], "changes": [
        {"setting": "model_init_kwargs:\n  dtype: bfloat16\nbf16: false", "effect": "0.70% outside vs yours 1.50%",
         "fields": {"model_init_kwargs.dtype": "bfloat16", "bf16": False}, "config": "GRPOConfig"},
        {"setting": "with_async_shadow_ratio(AsyncGRPOTrainer)", "effect": "β leaves the clip", "fields": None}]}
    assert _advice(r, r["recipes"], at_risk) == (
        "As the answer above says (AT RISK), change, fewest tokens touched first: model_init_kwargs.dtype: bfloat16, "
        "bf16: false (0.70% outside vs yours 1.50%); with_async_shadow_ratio(AsyncGRPOTrainer) (β leaves the clip).")
    none = {"status": "at risk", "changes": [], "reasons": ["x", "no measured change passes the sign test (p < 0.025)"]}
    assert _advice(r, r["recipes"], none).endswith("none measured passes the sign test on these tokens (sample "
                                                   "more: --n).")


def _split(now, prec, kern, corr):
    split = {"precision": {"beta_abs_mean": prec}, "kernel": {"beta_abs_mean": kern}, "correlation": corr}
    return {"recipes": {"fp32": {"beta_abs_mean": now, "split": split}}, "shadow": {"recipe": "bf16"},
            "engine": {"kind": "local", "dtype": "bf16"}}


def test_anti_correlated_and_small_gain():
    assert "anti-correlated (-0.31)" in _split_verdict(_split(0.04, 0.01, 0.05, ANTI_CORRELATED - 0.01), "fp32")
    assert "anti-correlated" not in _split_verdict(_split(0.04, 0.01, 0.05, ANTI_CORRELATED + 0.01), "fp32")
    # matching the kernels leaves β_precision: 0.0321 of 0.04 is just over SMALL_GAIN (0.8): "only a little"
    assert SMALL_GAIN == 0.8
    assert "would shrink it only a little" in _split_verdict(_split(0.04, 0.0321, 0.05, 0.0), "fp32")
    assert "is the bigger lever (mean |β| 0.0400 -> 0.0319)" in _split_verdict(_split(0.04, 0.0319, 0.05, 0.0), "fp32")
    # smaller than now, but not at the 4 decimals printed: no "shrink" from 0.0352 to 0.0352 (seen on the bundled model)
    assert "Neither lever alone shrinks the gap (matching the kernels would leave 0.0352" in _split_verdict(
        _split(0.03521, 0.03519, 0.05, 0.0), "fp32")


def test_an_fp8_engines_split_verdict_counts_beta_quant():
    """An FP8 engine: β = β_precision + β_quant + β_kernel. Matching the kernels leaves β_precision + β_quant (the
    recipe against the FP8 shadow, fp8.recipes_fp8_shadow: 0.177 here, the issue's bundled-model figure), not
    β_precision alone (0.0300): matching the precision (0.0351 left) is then the bigger lever, and the verdict says
    what the other leaves. The table's title names the plain shadow and the quant part."""
    r = _split(0.1904, 0.0300, 0.0351, 0.0)
    r["recipes"]["fp32"]["split"]["quant"] = {"beta_abs_mean": 0.1700}
    r["fp8"] = {"plain_recipe": "bf16", "engine_recipe": "bf16+fp8-w8a8",
                "recipes_fp8_shadow": {"fp32": {"beta_abs_mean": 0.1770}}}
    text = _split_verdict(r, "fp32")
    assert text.startswith("β = β_precision + β_quant + β_kernel: for fp32 (mean |β| 0.1904), β_precision (fp32 "
                           "against the plain bf16 shadow) has mean |·| 0.0300, β_quant (that shadow against the "
                           "bf16+fp8-w8a8 shadow: the quantisers alone, emulated) 0.1700")
    assert "Matching the precision is the bigger lever (mean |β| 0.1904 -> 0.0351); matching the kernels alone " \
           "would leave 0.1770." in text
    assert "-> 0.0300" not in text


@pytest.fixture(scope="module")
def result():
    from phantomclip.diagnose.job import DiagnoseConfig, run_diagnose

    return run_diagnose(DiagnoseConfig(model="tiny-random:0", trainer=["fp32", "bf16"], n=3, max_tokens=4))


def test_render_reads_only_the_dict(result):
    """A bare run_diagnose result renders (its verdict computed on the way); every recipe gets a row."""
    from rich.console import Console

    out = io.StringIO()
    render_diagnose(dict(result), Console(file=out, width=400))
    text = out.getvalue()
    assert "phantomclip diagnose tiny-random:0: 3 completions" in text and "verdict:" in text
    assert " ".join(verdict(result).split()) in " ".join(text.split())
    narrow = io.StringIO()
    render_diagnose(dict(result), Console(file=narrow, width=60))  # too narrow for a row per recipe: one row per figure
    assert "beta_abs_mean" in narrow.getvalue() and "fp32" in narrow.getvalue()


def test_piped_output_breaks_no_word(monkeypatch):
    """Piped (stdout not a terminal, no COLUMNS), the console lays out PIPED_WIDTH columns with no hard wrap: the
    tables take their one-row-per-recipe layout and no recipe name is folded mid-word (Rich's default 80 columns
    printed 'bf16-autoc' / 'ast'); a terminal keeps its own width."""
    import json
    import sys
    from importlib.resources import files

    from phantomclip.base.console import PIPED_WIDTH, stdout_console

    monkeypatch.delenv("COLUMNS", raising=False)
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)  # a StringIO is no terminal
    console = stdout_console()
    assert console.width == PIPED_WIDTH and console.soft_wrap
    demo = json.loads(files("phantomclip.report").joinpath("demo/diagnose.json").read_text())
    render_diagnose(demo, console)
    printed = out.getvalue()
    names = list(demo["recipes"])
    assert "bf16-autocast" in names
    for line in printed.splitlines():
        for word in line.split():  # every piece of a recipe name is the whole name
            assert not any(n.startswith(word) and word != n and len(word) > 4 for n in names), (word, line)
