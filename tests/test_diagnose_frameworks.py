"""`diagnose` with every RL framework's own mismatch figures (maths/frameworks.py) and the `--fail-if` CI gate: the JSON
holds each selected framework's figures per recipe, computed from the very tensors the β figures use; the table
prints the first recipe's; a gate is parsed before any work and judged after the run (exit 0 / 1 / 2)."""

import io
import json
import math
import re

import pytest
import torch

from conftest import bad_cli, over
from phantomclip.cli.main import main
from phantomclip.diagnose.gates import DIAGNOSE_KEYS, GateError, check_gates, lookup, parse_gate
from phantomclip.diagnose.job import DiagnoseConfig, figures, measure
from phantomclip.diagnose.text import FRAMEWORK_HEADLINE, SHAPE_COLUMNS, TOKEN_COLUMNS, framework_rows, render_diagnose
from phantomclip.maths.frameworks import FRAMEWORKS, THRESHOLDS

TINY = ["diagnose", "--model", "tiny-random:0", "--n", "3", "--max-tokens", "6", "--trainer", "fp32,bf16"]


def _tensors(cfg: DiagnoseConfig):
    """diagnose's phases (diagnose.measure), keeping the unrounded tensors: {recipe: logp [n, T]}, the reference
    (the engine's full-vocabulary logp_engine [n, T]), the completion mask [n, T], and the figures phase's records."""
    _, sampled, scored, ref = measure(cfg)
    return {k: s.logp for k, s in scored.items()}, ref, sampled.mask, figures(cfg, scored, ref, sampled.mask)


def test_json_holds_every_framework_computed_from_the_beta_tensors(tmp_path, capsys):
    """Every framework's figures in the JSON are maths/frameworks.py's functions of (logp, logp_engine, completion
    mask), the same full-vocabulary logp_engine as β (TRL's: the processed one TRL itself compares with). Compared
    against the unrounded tensors of an in-process run of the same phases with the same config and seeds, which
    gives bit-identical tensors (the golden test holds whole runs to 1e-12), so the only slack is the JSON's float
    round trip: exact. top-p 0.8 makes the engine's processed column differ from the full one, so a wiring to the
    wrong column (or to the shadow's logp) would show."""
    out = tmp_path / "d.json"
    assert main(TINY + ["--top-p", "0.8", "--json", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())  # undo the console's wrap
    d = json.loads(out.read_text())
    assert d["config"]["framework"] == list(FRAMEWORKS)
    cfg = DiagnoseConfig(model="tiny-random:0", n=3, max_tokens=6, trainer=["fp32", "bf16"], top_p=0.8)
    logp, ref, mask, figs = _tensors(cfg)
    # the JSON's per-token β is the same tensors' (rounded to 6 decimals): the two runs sampled the same tokens
    beta = (logp["fp32"] - ref.logp_engine)[mask]  # [N]
    assert d["tokens"]["per_recipe"]["fp32"]["beta"] == pytest.approx(beta.tolist(), abs=5e-7)
    assert not torch.equal(ref.logp_engine[mask], ref.logp_engine_processed[mask])  # the columns differ
    for recipe in ("fp32", "bf16"):
        got = d["recipes"][recipe]["frameworks"]
        assert list(got) == list(FRAMEWORKS)
        for name, fn in FRAMEWORKS.items():
            # TRL compares its trainer with vLLM's processed log-probs (tests/test_trl_truncated.py), the rest the
            # full-vocabulary column β is taken on
            column = ref.logp_engine_processed if name == "trl" else ref.logp_engine
            want = fn(logp[recipe], column, mask)
            assert list(got[name]) == list(want), (recipe, name)
            for figure, value in want.items():
                # JSON writes NaN/inf as null
                assert got[name][figure] == (value if math.isfinite(value) else None), (recipe, name, figure)
            assert figs.recipes[recipe]["frameworks"][name] == pytest.approx(want, nan_ok=True)
        # against the full column TRL's figures differ: the test can tell the columns apart
        other = FRAMEWORKS["trl"](logp[recipe], ref.logp_engine, mask)
        assert other["sampling/sampling_logp_difference/mean"] != got["trl"]["sampling/sampling_logp_difference/mean"]
    # the printed table: the first recipe's headline and bounded figures, with thresholds and verdicts
    assert "what each framework would log: fp32 trainer against the bf16 local engine" in printed
    for fw, figure in list(FRAMEWORK_HEADLINE.items()) + list(THRESHOLDS):
        assert f"{fw} " in printed and figure in printed, (fw, figure)
    assert "<= 1.05" in printed and "<= 0.001" in printed
    assert "mismatch_kl/all/median" not in printed  # neither a headline nor bounded: JSON only


def test_framework_flag_limits_the_output(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert main(TINY + ["--framework", "slime,verl", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    d = json.loads(out.read_text())
    assert d["config"]["framework"] == ["slime", "verl"]
    for stats in d["recipes"].values():
        assert list(stats["frameworks"]) == ["slime", "verl"]  # in the order given
        assert set(stats["frameworks"]["verl"]) == set(FRAMEWORKS["verl"](*[torch.zeros(1, 1)] * 2,
                                                                           torch.ones(1, 1, dtype=torch.bool)))
    assert "train_rollout_logprob_abs_diff" in printed and "training/rollout_probs_diff_mean" in printed
    assert "token_mult_prob_error" not in printed and "vllm_kl" not in printed


def test_unknown_or_empty_framework_is_one_line(capsys):
    line = bad_cli(TINY + ["--framework", "verl,deepspeed-chat"], capsys)
    assert line == ("phantomclip diagnose: error: --framework deepspeed-chat: unknown; choose from trl, verl, nemo-rl, "
                    "slime, skyrl, prime-rl, openrlhf")
    assert "--framework is empty: give one or more of trl, verl" in bad_cli(TINY + ["--framework", ","], capsys)
    from phantomclip.diagnose.job import DiagnoseConfig

    assert DiagnoseConfig(framework="all").framework == list(FRAMEWORKS)  # the default, spelt out


def test_malformed_gate_exits_2_before_any_work(tmp_path, capsys, monkeypatch):
    import phantomclip.diagnose.job as diag

    def no_work(*a, **k):
        raise AssertionError("diagnose ran despite a malformed --fail-if")

    monkeypatch.setattr(diag, "run_diagnose", no_work)
    monkeypatch.setattr(diag, "load_model", no_work)
    out = tmp_path / "d.json"
    # the second expression is the bad one: every gate is read before anything starts
    line = bad_cli(TINY + ["--json", str(out), "--fail-if", "fp32.tokens<1", "--fail-if", "fp32.kl_k3=0.1"], capsys)
    assert line.startswith("phantomclip diagnose: error: --fail-if 'fp32.kl_k3=0.1': expected KEY OP NUMBER")
    assert "must be a finite number" in bad_cli(TINY + ["--fail-if", "fp32.kl_k3>nan"], capsys)
    # before the config's own checks too
    assert "--fail-if 'x'" in bad_cli(TINY + ["--framework", "nope", "--fail-if", "x"], capsys)
    # a key that cannot start a path in the result (a misspelt recipe) is refused before the run, too
    line = bad_cli(over(TINY, "--trainer", "fp32,bf16", "--fail-if", "fp23.outside_trust_region>0.01"), capsys)
    assert line == ("phantomclip diagnose: error: --fail-if fp23.outside_trust_region: no figure starts with 'fp23'; a "
                    "key starts with a recipe of --trainer (fp32, bf16) or one of " + ", ".join(DIAGNOSE_KEYS))
    assert not out.exists()


PROGRESS = re.compile(r".*: \d+(/\d+)?, \d+ s(; .*)?$")
"""a progress line (console.LineProgress: stderr is no terminal under capsys)."""


def _said(capsys) -> list[str]:
    """stderr's lines less the run's cost line (diagnose.cost_line), its progress lines and blank lines: what the gates
    said."""
    return [line for line in capsys.readouterr().err.strip().splitlines()
            if line and not line.startswith("cost:") and not PROGRESS.match(line)]


def test_unknown_gate_key_exits_2_after_the_json(tmp_path, capsys):
    """A key whose root exists but whose path does not is only known from the result: refused after it is written.
    Every top-level key of a real result is one the pre-run check knows (gates.DIAGNOSE_KEYS)."""
    out = tmp_path / "d.json"
    line = bad_cli(TINY + ["--framework", "verl", "--json", str(out),
                           "--fail-if", "fp32.frameworks.verl.training/rollout_probs_diff_mean>1",
                           "--fail-if", "fp32.frameworks.nemo-rl.gen_kl_error>1e-3"], capsys, after_progress=True)
    assert line.startswith("phantomclip diagnose: error: --fail-if: no figure "
                           "'fp32.frameworks.nemo-rl.gen_kl_error' in the summary; its top-level keys: schema, config")
    assert line.endswith("; under recipes: fp32, bf16")
    result = json.loads(out.read_text())
    assert "frameworks" in result["recipes"]["fp32"]  # written before the gates are judged
    assert set(result) <= set(DIAGNOSE_KEYS)


def test_failed_gate_exits_1_naming_key_value_and_bound(tmp_path, capsys):
    """exp|ℓ| >= 1 per token, > 1 wherever fp32 and the bf16 engine differ (they do: mean |β| > 0), so NeMo-RL's
    mean exceeds 1; the other two gates hold (a count, and a full path under recipes)."""
    out = tmp_path / "d.json"
    code = main(TINY + ["--json", str(out), "--fail-if", "fp32.frameworks.nemo-rl.token_mult_prob_error > 1",
                        "--fail-if", "fp32.tokens<1", "--fail-if", "recipes.bf16.beta_abs_mean>100"])
    err = _said(capsys)
    d = json.loads(out.read_text())
    value = d["recipes"]["fp32"]["frameworks"]["nemo-rl"]["token_mult_prob_error"]
    assert code == 1 and value > 1
    assert err == [f"phantomclip diagnose: gate failed: fp32.frameworks.nemo-rl.token_mult_prob_error = {value:g}, "
                   "bound: > 1"]


def test_gates_that_hold_exit_0(tmp_path, capsys):
    code = main(TINY + ["--framework", "nemo-rl", "--fail-if", "fp32.frameworks.nemo-rl.token_mult_prob_error>100",
                        "--fail-if", "fp32.outside_trust_region>=1.5"])
    assert code == 0
    assert _said(capsys) == ["phantomclip diagnose: all 2 --fail-if gates hold"]


def test_check_gates_nan_warns_and_holds(capsys):
    """A NaN figure (nothing measured; JSON null) satisfies no comparison: the gate holds, with a warning line."""
    result = {"recipes": {"fp32": {"lowp_highp_ratio": math.nan, "tokens": 0, "inf": math.inf}}}
    assert check_gates([parse_gate("fp32.lowp_highp_ratio>1"), parse_gate("fp32.tokens>5")], result) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["phantomclip diagnose: warning: --fail-if fp32.lowp_highp_ratio>1: the figure is NaN (nothing "
                   "measured), so this gate cannot fail",
                   "phantomclip diagnose: all 2 --fail-if gates hold (1 on a NaN figure, which no gate can fail)"]
    assert check_gates([parse_gate("fp32.tokens<1")], result) == 1  # gate on a count to require data
    assert check_gates([parse_gate("fp32.inf>1e300")], result) == 1  # +inf compares as a number
    assert check_gates([], result) == 0


def test_lookup_under_recipes():
    summary = {"engine": {"tokens": 3}, "recipes": {"fp32": {"kl_k3": 0.5}, "engine": {"tokens": 7}}}
    assert lookup(summary, "fp32.kl_k3", ("recipes",)) == 0.5
    assert lookup(summary, "recipes.fp32.kl_k3", ("recipes",)) == 0.5
    assert lookup(summary, "engine.tokens", ("recipes",)) == 3  # the path as given wins
    with pytest.raises(GateError, match="no figure 'fp32.kl_k3'"):
        lookup(summary, "fp32.kl_k3")  # no fallback unless asked
    with pytest.raises(GateError, match=r"top-level keys: engine, recipes; under recipes: fp32, engine$"):
        lookup(summary, "bf16.kl_k3", ("recipes",))


def test_headlines_are_real_figures():
    one = torch.zeros(1, 2), torch.full((1, 2), -0.1), torch.ones(1, 2, dtype=torch.bool)
    assert list(FRAMEWORK_HEADLINE) == list(FRAMEWORKS)
    for fw, figure in FRAMEWORK_HEADLINE.items():
        assert figure in FRAMEWORKS[fw](*one), (fw, figure)


def test_render_table_from_the_dict_alone():
    """Rows for the first recipe only: headline and bounded figures; null values print n/a and are not judged; a
    JSON written before the framework figures renders without the table."""
    from rich.console import Console

    base = {"model": {"name": "m"}, "trust_region": {"epsilon_low": 0.2, "epsilon_high": 0.2},
            "engine": {"kind": "local", "dtype": "bf16", "matmul": "native", "sequences": 1, "tokens": 2,
                       "tokens_per_s": 1.0},
            "shadow": {"recipe": "bf16"}, "verdict": "v"}
    stats = {**dict.fromkeys(TOKEN_COLUMNS + SHAPE_COLUMNS, 0.0), "tokens": 2,
             "split": {p: {"beta_abs_mean": 0.1, "outside_trust_region": 0.0} for p in ("precision", "kernel")}}
    first = {"nemo-rl": {"token_mult_prob_error": 1.2, "gen_kl_error": None}, "prime-rl": {"mismatch_kl/all/max": 3.0}}
    result = {**base, "recipes": {"fp32": {**stats, "frameworks": first},
                                  "bf16": {**stats, "frameworks": {"slime": {"train_rollout_logprob_abs_diff": 0}}}}}
    assert framework_rows(result) == [("nemo-rl", "token_mult_prob_error", 1.2, "<= 1.05", "over"),
                                      ("nemo-rl", "gen_kl_error", None, "<= 0.001", "-")]
    out = io.StringIO()
    render_diagnose(result, Console(file=out, width=120))
    text = " ".join(out.getvalue().split())  # undo the title's wrap
    assert "fp32 trainer against the bf16 local engine" in text and "slime" not in text and "n/a" in text
    old = {**base, "recipes": {"fp32": stats}}
    out = io.StringIO()
    render_diagnose(old, Console(file=out, width=120))
    assert "what each framework would log" not in out.getvalue()
