"""The answer diagnose prints first: status thresholds, the one ε rule, the ranking, and the changes written in the
user's framework, on crafted result dicts (hand-worked) and on the bundled model's demo result."""

import io
import json
from importlib.resources import files

import pytest

from phantomclip.answer import (
    LEVELS,
    OK_SHARE,
    STALL_SHARE,
    answer,
    answer_lines,
    bound,
    changes,
    epsilon_advice,
    ranking,
    recipe_gain,
    sign_test,
    status,
)
from phantomclip.diagnose_text import knob_lines, render_diagnose, verdict


def _rec(outside: float, mean: float = 0.04, tokens: int = 1000) -> dict:
    return {"tokens": tokens, "nonfinite": 0, "beta_abs_mean": mean, "beta_abs_max": 0.5, "lowp_highp_ratio": 10.0,
            "outside_trust_region": outside, "outside_below": outside / 2, "outside_above": outside / 2}


def _result(answer_in: str = "", keep=(0.15, 0.19), engine: str = "vllm", **recs) -> dict:
    """A result whose first recipe is the user's, against a bf16 `engine` (vLLM: a real engine, whose kernel gap every
    recipe's β holds); ε 0.2/0.2; the clip's keep setting `keep` (ε_low, ε_high). Per
    token, each recipe puts its share of the 1000 tokens outside (β = 0.5) from the first token on, so the tokens a
    better recipe keeps inside are all outside under a worse one (the sign test sees only that direction)."""
    clip = {"unit": "token", "setting": {"epsilon_low": 0.2, "epsilon_high": 0.2}, "tokens": 0.0, "sequences": 0.0,
            "keep": {"epsilon_low": keep[0], "epsilon_high": keep[1]}, "at_length": None}
    per = {k: {"beta": [0.5 if i < round(v["outside_trust_region"] * v["tokens"]) else 0.0 for i in range(1000)]}
           for k, v in recs.items()}
    return {"recipes": recs, "engine": {"dtype": "bf16", "kind": engine, "nonfinite_logprobs": 0},
            "trust_region": {"epsilon_low": 0.2, "epsilon_high": 0.2, "log_low": -0.2231, "log_high": 0.1823},
            "config": {"answer_in": answer_in, "epsilon": 0.2, "epsilon_high": 0.2}, "tokens": {"per_recipe": per},
            "knobs": {"keep_share": 0.99, "length": {"target": 48}, "clip": clip}}


@pytest.mark.parametrize("share, word", [
    (0.0, "ok"), (OK_SHARE, "ok"),  # at most 0.1%: ok (the bound is inclusive)
    (0.0011, "at risk"), (STALL_SHARE - 1e-9, "at risk"),
    (STALL_SHARE, "will stall"), (0.5, "will stall"),  # from 10%: a stall is expected
])
def test_status_thresholds(share, word):
    assert (OK_SHARE, STALL_SHARE) == (0.001, 0.10)
    got, reasons = status(_result(fp32=_rec(share)))
    assert got == word and reasons[0].startswith(f"{100 * share:.2f}% of tokens outside [0.8, 1.2] at α = 0")


def test_no_status_for_what_was_not_measured():
    """No token measured: never 'ok'. A config the readers could not map: 'not judged', no level, generic changes."""
    assert status(_result(fp32=_rec(0.0, tokens=0)))[0] == "at risk"
    r = _result("verl", fp32=_rec(0.02), bf16=_rec(0.0))
    r["config"]["unmapped"] = "actor_rollout_ref.actor.strategy 'megatron'"
    ans = answer(r)
    assert ans["status"] == "not judged" and ans["level"] is None and ans["framework"] == ""
    assert "megatron" in ans["reasons"][0]
    assert ans["changes"][0]["setting"] == "--trainer bf16"  # phantomclip's flags, not verl keys


def test_epsilon_rule_is_never_narrower():
    """The ε advice is max(current, knob keep rounded up to 3 digits); None when the current ε keeps the share."""
    r = _result(keep=(0.15195867858211762, 0.20919200670833638), fp32=_rec(0.008))  # the demo's clip keep
    # ε_low: 0.152 < 0.2 keeps the current 0.2; ε_high: 0.20919 rounds up to 0.21 (3 digits: 0.210)
    assert epsilon_advice(r["knobs"]) == {"epsilon_low": 0.2, "epsilon_high": 0.21, "keep_share": 0.99}
    r = _result(keep=(0.15, 0.19), fp32=_rec(0.008))
    assert epsilon_advice(r["knobs"]) is None  # already wide enough on both sides: nothing called "wider"
    assert bound(0.20919200670833638) == 0.21 and bound(0.15195867858211762, up=False) == 0.151


def test_ranking_by_share_outside_then_mean():
    r = _result(fp32=_rec(0.01, 0.03), bf16=_rec(0.002, 0.05), fp16=_rec(0.002, 0.04))
    assert ranking(r) == ["fp16", "bf16", "fp32"]  # fp16 and bf16 tie on 0.2% outside: the smaller mean first
    r["recipes"]["fp16"]["nonfinite"] = 3  # an overflowing recipe goes last, whatever its figures
    assert ranking(r) == ["bf16", "fp32", "fp16"]


@pytest.mark.parametrize("framework, best, setting", [
    ("trl", "fp32-head", "cast_lm_head_to_fp32: true"),
    ("trl", "fp32", "bf16: false"),
    ("verl", "fp32", "actor_rollout_ref.actor.fsdp_config.dtype: float32"),
    ("verl", "fp32-head", "a fp32-head trainer (no verl setting selects it)"),
    ("", "fp16", "--trainer fp16"),
])
def test_changes_in_the_users_framework(framework, best, setting):
    r = _result(framework, keep=(0.3, 0.4), **{"bf16-autocast": _rec(0.015), best: _rec(0.0066)})
    got = changes(r, framework)
    # 15 tokens outside against 7 (0.66% of 1000, rounded): 8 discordant tokens, all one way: p = 2^-8 = 0.0039
    assert got[0].setting == setting and got[0].effect == "0.66% outside vs yours 1.50% (p = 0.004)"
    eps = {"trl": "epsilon: 0.3, epsilon_high: 0.4",
           "verl": "actor_rollout_ref.actor.clip_ratio_low: 0.3, actor_rollout_ref.actor.clip_ratio_high: 0.4",
           "": "--epsilon 0.3 --epsilon-high 0.4"}[framework]
    assert got[1].setting == eps and got[1].effect == "keeps 99% of your tokens inside"
    assert len(got) == (2 if framework == "verl" else 3)  # verl has no hook for the shadow ratio


def test_a_recipe_change_needs_a_detectable_gain():
    """The sign test on the same tokens (McNemar's exact form), Bonferroni over the other recipes measured."""
    r = _result(fp32=_rec(0.020), **{"fp32-head": _rec(0.017)})  # 20 against 17 outside: 3 discordant tokens
    assert recipe_gain(r, "fp32", "fp32-head") == {"worse": 3, "better": 0, "p": 0.125}  # 1/2^3
    assert [c.setting for c in changes(r)][0] != "--trainer fp32-head"  # not detectable: not offered
    r = _result(fp32=_rec(0.020), bf16=_rec(0.025), **{"fp32-head": _rec(0.014)})  # 6 discordant: p = 1/64
    assert recipe_gain(r, "fp32", "fp32-head")["p"] == 1 / 64
    assert changes(r)[0].setting == "--trainer fp32-head"  # 0.0156 < 0.05 / 2 comparisons
    # 12 worse and 9 better, as fp32 against fp32-head on the bundled model: P(X >= 12 | 21, 1/2) = 0.332
    per = r["tokens"]["per_recipe"]
    per["fp32"]["beta"] = [0.5] * 12 + [0.0] * 9 + [0.5] * 8 + [0.0] * 971
    per["fp32-head"]["beta"] = [0.0] * 12 + [0.5] * 9 + [0.5] * 8 + [0.0] * 971
    assert recipe_gain(r, "fp32", "fp32-head")["p"] == pytest.approx(0.3318119, abs=1e-7)


def test_ok_has_no_changes_and_a_worse_recipe_is_never_offered():
    assert changes(_result(fp32=_rec(0.0005), bf16=_rec(0.0))) == []
    r = _result(keep=(0.15, 0.19), fp32=_rec(0.01), bf16=_rec(0.02))  # the user's recipe is already the best
    assert [c.setting for c in changes(r)] == ["train --intervention shadow-ratio"]


@pytest.fixture(scope="module")
def demo() -> dict:
    """The bundled model's diagnose result shipped with the report (fp32 first, five recipes, ε 0.2)."""
    return json.loads(files("phantomclip.report").joinpath("demo/diagnose.json").read_text())


def test_one_rule_on_the_demo(demo):
    """The answer, the verdict and the knob section say the same ε, the same best recipe and speak of the user's
    recipe (fp32, the first measured)."""
    ans = answer(demo)
    eps = epsilon_advice(demo["knobs"])
    # the demo: fp32 has 0.79% outside (at risk), fp32 is also the fewest outside of the five recipes
    assert ans["status"] == "at risk" and ans["level"] == LEVELS["at risk"] == 1
    assert ranking(demo)[0] == "fp32" and ans["contract"]["trainer"] == "fp32"
    assert eps == {"epsilon_low": 0.2, "epsilon_high": 0.21, "keep_share": 0.99}
    said = verdict(demo)
    assert said.startswith("Fewest tokens outside [0.8, 1.2] against the bf16 engine: fp32 (0.79%")
    assert "With your fp32 trainer, 0.79% of tokens" in said and "ε_low 0.2, ε_high 0.21 keep 99%" in said
    clip_line = knob_lines(demo["knobs"])[0]
    assert clip_line.endswith("-> ε_low ≥ 0.2, ε_high ≥ 0.21 for 99% of tokens untouched"), clip_line
    assert [c["setting"] for c in ans["changes"]] == ["--epsilon 0.2 --epsilon-high 0.21",
                                                      "train --intervention shadow-ratio"]


def test_answer_is_printed_first_and_fits_80_columns(demo):
    from rich.console import Console

    out = io.StringIO()
    render_diagnose(dict(demo), Console(file=out, width=80))
    lines = out.getvalue().splitlines()
    first = answer_lines(answer(demo))
    assert lines[: len(first)] == first
    assert lines[0] == "answer: AT RISK: 0.79% of tokens outside [0.8, 1.2] at α = 0 (ok ≤ 0.1%)"
    assert max(map(len, lines)) <= 80, max(lines, key=len)


def test_causes_beyond_precision_name_their_fix():
    """FP8: sampling without the quantisers is offered when they push detectably more tokens out (a sign test on the
    pushed-out and pulled-in counts); routing: replay is offered when β_rest (the engine's routes) has fewer outside."""
    r = _result("verl", fp32=_rec(0.05))
    r["fp8"] = {"engine_recipe": "bf16+fp8-w8a8", "trust_region": {"recipe": "fp32", "outside": 0.05,
                "outside_without_quant": 0.01, "pushed_out": 0.045, "pulled_in": 0.005}}  # 45 out, 5 in of 1000
    got = changes(r, "verl")[0]
    assert got.setting == "actor_rollout_ref.rollout.quantization: null"
    assert got.effect == f"1.00% outside without FP8 (with it: 5.00%; sign test p = {sign_test(45, 5):.1g})"
    assert answer(r)["contract"]["engine_dtype"] == "bf16+fp8-w8a8"
    r["fp8"]["trust_region"].update(pushed_out=0.004, pulled_in=0.002)  # 4 against 2: p = 11/32, not detectable
    assert sign_test(4, 2) == 11 / 32 and all("quantization" not in c.setting for c in changes(r, "verl"))
    r = _result(fp32=_rec(0.0156))
    r["routing"] = {"fp32": {"beta": {"outside_trust_region": 0.0156}, "beta_rest": {"outside_trust_region": 0.0039}}}
    assert changes(r)[0].setting == "train --intervention r3"
    assert changes(r)[0].effect == "0.39% outside with the engine's routes replayed (yours: 1.56%)"
    r["routing"]["fp32"]["beta_rest"]["outside_trust_region"] = 0.0156  # routing puts no token out: no replay
    assert all(c.setting != "train --intervention r3" for c in changes(r))
