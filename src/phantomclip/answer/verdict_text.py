"""The verdict paragraph `diagnose` prints after its tables: what the user's recipe's figures mean for the ratio their
trainer clips (answer/exposure.py), which lever is bigger (precision or kernels), and what to change, in words read from
the result dict alone (a JSON written earlier says the same). The answer's first lines are answer/decide.py's; this
paragraph is the long explanation and never contradicts them.
"""

from __future__ import annotations

import math

from ..base.numerics import parse_dtype
from ..maths.metrics import HIGH_P, LOW_P
from ..precision.recipes import engine_recipe
from .changes import kernel_rule, yaml_value
from .decide import answer, correction_knob, measured_engine, ranking, sampled_mean
from .exposure import exposure, region_text, user_recipe
from .fp8_text import fp8_split_head
from .setups import IN_CLIP, IN_WEIGHT

ANTI_CORRELATED = -0.3
"""a correlation of β_precision and β_kernel below this is told as anti-correlation: 0.3 is Cohen's (1988) "medium"
effect size for r; a weaker one says little about whether the shadow shares the engine's rounding."""
SMALL_GAIN = 0.8
"""a lever that would leave more than this share of today's mean |β| is told as shrinking the gap "only a little":
removing less than a fifth of β is not worth a change of recipe or kernels (a judgement, not a measured bound)."""
SAME_GAP_SPREAD = 1.25
"""recipes whose mean |β| lie within this factor of each other (25%) are told as one gap: no recipe is then a lever
worth a change, β is the engine's own rounding noise (a judgement, the same scale as SMALL_GAIN's fifth)."""


FIXED_FROM = 1e-2
"""figures of this size or more print as 3 significant digits, smaller ones in scientific notation."""

def verdict(result: dict) -> str:
    """One paragraph about the user's recipe (the first measured): how it compares with the best measured one
    (answer.ranking), what its figures mean for PPO clipping, and what to change (answer.epsilon_advice)."""
    lag = result.get("config", {}).get("checkpoint_lag", 0)
    if lag != 0:
        return lagged_verdict(lag)
    recs = result["recipes"]
    usable = {k: v for k, v in recs.items() if v["tokens"] > 0}
    engine_missing = result["engine"].get("nonfinite_logprobs", 0)
    if not usable:
        lost = max([engine_missing, *(v.get("nonfinite", 0) for v in recs.values())])
        if lost:  # tokens were sampled, but no recipe has a finite log-prob for any of them
            return (f"No β could be measured: {lost} completion tokens were sampled but their log-probs are not finite "
                    "(NaN or inf) in the engine or in every trainer recipe. The weights hold NaN/inf, or the dtype "
                    "overflows: check the model, or try a wider engine dtype (bf16 or fp32).")
        return "No completion tokens were scored: raise --max-tokens or --n."

    def overflow(k: str) -> int:  # the recipe's own non-finite log-probs, not the tokens the engine left without one
        return recs[k]["nonfinite"] - engine_missing

    region = region_text(result)
    mine = user_recipe(result)
    ranked = ranking(result)
    best = next((k for k in ranked if k == mine or kernel_rule(result, k)[0]), ranked[0])  # answer/changes.kernel_rule
    b, left_out = usable[best], ranked[:ranked.index(best)]
    parts = [
        f"Fewest tokens outside {region} against the {measured_engine(result)}: {best} "
        f"({100 * b['outside_trust_region']:.2f}%, mean |β| {b['beta_abs_mean']:.4f})"
        + (f"; {', '.join(left_out)} left out: {'its' if len(left_out) == 1 else 'their'} body runs the local "
           "engine's own kernels, so no engine's kernel gap is in that figure." if left_out else ".")
    ]
    w = usable.get(mine)
    if w is not None and w["outside_trust_region"] > 0:
        parts.append(
            f"With your {mine} trainer, {100 * w['outside_trust_region']:.2f}% of tokens leave the trust region before "
            f"the policy has moved ({100 * w['outside_below']:.2f}% below, {100 * w['outside_above']:.2f}% above)"
            + _what_it_costs(result)
            + (f", and low-probability tokens (p < {LOW_P:g}) carry {w['lowp_highp_ratio']:.1f}x the |β| of confident "
               f"ones (p > {HIGH_P:g})." if math.isfinite(w["lowp_highp_ratio"]) else ".")
        )
        parts.append(_advice(result, usable, answer(result)))
    elif w is not None:
        parts.append(f"Your {mine} trainer pushes no measured token outside the trust region {region}: precision "
                     "alone will not cause phantom clipping here.")
    # The split and the truncation bias are told for the user's recipe (for the shadow recipe, whose precision part
    # is zero by definition, the split says all of the gap is kernels).
    told = mine if mine in usable else next(iter(usable))
    parts += [_split_verdict(result, told), _batch_verdict(result, told), _truncation_verdict(result, told),
              _drift_verdict(result)]
    if engine_missing:
        parts.append(f"The engine returned no finite log-prob for {engine_missing} sampled tokens; "
                     "they are left out of every figure.")
    bad = [k for k in recs if overflow(k) > 0]
    if bad:
        listed = ", ".join(f"{k} ({overflow(k)})" for k in bad)
        parts.append(f"Non-finite log-probs (overflow) in: {listed}.")
    return " ".join(p for p in parts if p)


def lagged_verdict(lag: int | None) -> str:
    """The verdict on records scored against other weights than those that sampled them (a post-mortem step that no
    checkpoint given sampled): the figures hold α, the policy's move, so nothing in them is the engine's."""
    apart = "an unknown number of steps" if lag is None else f"{lag} steps"
    return (f"These tables were measured against weights {apart} away from those that sampled the records (no "
            "checkpoint given matched them), so each log-ratio holds the policy's change α as well as the mismatch β: "
            "the shares above are not the engine's gap and say nothing of its precision or kernels. Give the "
            "checkpoint of this step (--checkpoints DIR) to measure β alone; the answer above judges the steps that "
            "were measured at their own weights.")


def _what_it_costs(result: dict) -> str:
    """What the tokens outside cost, in the ratio the user's trainer clips (answer/exposure.py)."""
    exp = exposure(result)
    if exp.where == IN_CLIP:
        return (": in PPO/GRPO each of them gets zero gradient whenever its advantage has the matching sign (phantom "
                "clipping)")
    if exp.where == IN_WEIGHT:
        knob = correction_knob(result, exp) or {}
        return (f"; {exp.setup.label} clips on its own log-probs, so none of them is phantom-clipped: β enters its "
                f"importance-sampling weight, where {exp.setting()} {exp.verb} {_share(knob.get('tokens'))} of tokens "
                f"({_share(knob.get('sequences'))} of sequences{_sampled(result)})")
    return (f"; {exp.setup.label} clips on its own log-probs and corrects nothing, so none of them is phantom-clipped, "
            "and each is trained on at full weight as if the trainer had sampled it")


def _sampled(result: dict) -> str:
    """'; sampled: mean 45 tokens': the length the correction's figures are for ('' without it)."""
    mean = sampled_mean(result)
    return "" if mean is None else f"; sampled: mean {mean:.0f} tokens"


def _share(v) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{100 * v:.2f}%"


def _kernels(kind: str) -> str:
    """How an engine of this kind computes differently from the trainer's one-pass forward in the same dtype."""
    return "one prefill pass against token-by-token decode" if kind == "local" else f"{kind}'s own kernels and decode"


def _split_verdict(result: dict, name: str) -> str:
    """Which lever is bigger for recipe `name`: matching the precision leaves β_kernel, matching the kernels
    leaves β_precision; compare what each leaves with the gap now."""
    split = result["recipes"][name].get("split")
    if not split:
        return ""
    now = result["recipes"][name]["beta_abs_mean"]
    prec, kern = split["precision"]["beta_abs_mean"], split["kernel"]["beta_abs_mean"]
    shadow, eng = result["shadow"]["recipe"], result["engine"]
    what = _kernels(eng["kind"])
    if result.get("fp8") and "quant" in split:  # an FP8 engine: β = β_precision + β_quant + β_kernel (diagnose.fp8)
        head, prec = fp8_split_head(result, name, now, split, what)
    else:
        head = (f"β = β_precision + β_kernel: for {name} (mean |β| {now:.4f}), β_precision ({name} against its own "
                f"{shadow} forward) has mean |·| {prec:.4f} and β_kernel (that {shadow} forward against the "
                f"{measured_engine(result)}: {what}) {kern:.4f}.")
    if prec == 0:
        return head + f" {name} already matches the engine's precision: all of its gap is kernels."
    corr = split.get("correlation")
    if corr is not None and math.isfinite(corr) and corr < ANTI_CORRELATED:
        head += (f" The parts are anti-correlated ({corr:.2f}): the {shadow} forward's own rounding enters both with "
                 f"opposite signs, i.e. it does not share the engine's rounding.")
    left = {"matching the precision": kern, "matching the kernels": prec}
    lever = min(left, key=left.get)
    other = next(k for k in left if k != lever)
    if round(left[lever], 4) >= round(now, 4):  # compared as printed: "0.0352 -> 0.0352" shrinks nothing
        return head + (f" Neither lever alone shrinks the gap ({lever} would leave {left[lever]:.4f}, {other} "
                       f"{left[other]:.4f}): tolerate or correct β instead.")
    worse = ", more than now" if round(left[other], 4) > round(now, 4) else ""  # as printed: 0.0705 is not more
    rest = f"{other} alone would leave {left[other]:.4f}{worse}"
    lever_cap = lever[0].upper() + lever[1:]
    if left[lever] > SMALL_GAIN * now:
        return head + (f" {lever_cap} would shrink it only a little (mean |β| {now:.4f} -> "
                       f"{left[lever]:.4f}) and {rest}: tolerate or correct β instead.")
    return head + f" {lever_cap} is the bigger lever (mean |β| {now:.4f} -> {left[lever]:.4f}); {rest}."


def as_float(v) -> float:
    """A figure as a float: JSON null (NaN written out) reads as NaN."""
    return math.nan if v is None else float(v)


def _batch_verdict(result: dict, name: str) -> str:
    """One sentence when batch layout alone (recipe `name` in the run's batch against the same sequences scored one
    at a time) puts more tokens outside the trust region than β_precision does."""
    split = result["recipes"][name].get("split", {})
    if "batch" not in split:
        return ""
    batch = as_float(split["batch"]["outside_trust_region"])
    prec = as_float(split["precision"]["outside_trust_region"])
    if not batch > prec:  # NaN (no token scored alone) says nothing
        return ""
    return (f"Batch layout alone puts {100 * batch:.2f}% of {name}'s tokens outside the trust region ({name} in the "
            f"run's padded batch of {result['config']['batch_size']} against the same sequences scored one at a "
            f"time), more than β_precision does ({100 * prec:.2f}%): the trainer's micro-batch layout moves the ratio "
            f"more than its precision; batch-invariant kernels, or one layout on both sides, remove that part.")


def _truncation_verdict(result: dict, name: str) -> str:
    """What top-p / top-k / min-p do to recipe `name`'s ratio against the engine's processed log-probs."""
    trunc = result["recipes"][name].get("truncation")
    if not trunc:
        return ""
    c = result["config"]
    rule = ", ".join(f"{k} {c[k]:g}" for k in ("top_p", "top_k", "min_p") if (c[k] != 1 if k == "top_p" else c[k] > 0))
    rebuilt = result["engine"].get("rebuilt_column") == "logp_engine_processed"
    return (f"Truncated sampling ({rule}): the processed log-probs are renormalised over the kept tokens, so a "
            f"ratio against them carries log S (mean {trunc['log_kept_mean']:.4f}, kept mass ≥ "
            f"{trunc['kept_mass_p10']:.2f} for 90% of tokens); for {name} that pushes {100 * trunc['pushed_out']:.2f}% "
            f"of tokens out of the trust region ({100 * trunc['naive']['outside_trust_region']:.2f}% outside in all). "
            f"Renormalising the trainer's log-probs over its own kept set (logp − log S) brings it to "
            f"{100 * trunc['corrected']['outside_trust_region']:.2f}%"
            + (f" (the engine's processed log-probs rebuilt from the {result['shadow']['recipe']} shadow's S: vLLM "
               "reported raw ones)." if rebuilt else "."))


def _drift_verdict(result: dict) -> str:
    """One sentence on --drift: an engine whose log-probs move under unchanged weights is defective (every β above
    carries the defect, and no trainer recipe removes it); one that stays put is said to, with how it was read."""
    d = result.get("drift")
    if not d:
        return ""
    label = measured_engine(result)
    if not d["moving"]:
        return (f"Drift: {d['syncs']} pushes of unchanged weights left the {label}'s log-probs "
                f"of the same {d['tokens']} tokens bit-identical ({DRIFT_METHODS[d['method']]}).")
    first = next(s for s in d["steps"] if s["max_abs"] > 0 or s["changed_share"] > 0 or s["token_changed_share"] > 0)
    tokens = (f", {100 * d['token_changed_share']:.2f}% of sampled tokens differ" if d["token_changed_share"] else "")
    return (f"Engine defect: the same weights pushed {d['syncs']} times into the {label} moved "
            f"its log-probs of the same tokens (from push {first['sync']}; max |Δ| {fmt_figure(d['max_abs'])}, "
            f"{100 * d['changed_share']:.2f}% of tokens changed{tokens}; {DRIFT_METHODS[d['method']]}). Every β above "
            "carries this and no trainer recipe removes it: check the engine's weight sync (every parameter group, "
            "tied embeddings, cached prefixes).")


DRIFT_METHODS = {"rescore": "the fixed tokens teacher-forced through its decode path after each push",
                 "resample": "the same prompts re-sampled with the same seeds after each push"}
"""how --drift read the tokens again (engines/drift.py), as the verdict and the printed block say it."""


def _advice(result: dict, recs: dict[str, dict], ans: dict) -> str:
    """What the figures say of the recipes (one gap, or not), then the answer's own changes (`ans`, answer/decide.py's
    block): the verdict restates them and never makes its own, so the two cannot disagree."""
    eng, kind = result["engine"]["dtype"], result["engine"]["kind"]
    gaps = [v["beta_abs_mean"] for v in recs.values()]
    spread = max(gaps) / min(gaps) if min(gaps) > 0 else math.inf
    same = engine_recipe(parse_dtype(eng)).name
    same = same if same in recs else None
    head = ""
    if len(recs) > 1 and spread < SAME_GAP_SPREAD:
        why = f", {same} included (the engine's own dtype, with other kernels: {_kernels(kind)})" if same else ""
        head = (f"No trainer recipe removes the gap: all {len(recs)} are within {100 * (spread - 1):.0f}% of each "
                f"other{why}. β here is the {measured_engine(result)}'s rounding noise, amplified through the "
                "network. ")
    return head + answer_sentence(ans)


def answer_sentence(ans: dict) -> str:
    """The answer's status and changes as one sentence: the changes in its order (fewest tokens touched first), each
    with its figure; under OK nothing to change; else why none is offered, as the answer's reasons say."""
    word = ans["status"].upper()
    if not ans["changes"]:
        if ans["status"] == "ok":
            why = "nothing to change"
        elif ans["status"] == "not judged":
            why = "no status, so no change is weighed"
        elif any(r.startswith("no measured change passes") for r in ans["reasons"]):
            why = "no change is offered: none measured passes the sign test on these tokens (sample more: --n)"
        else:
            why = "no change is offered: nothing measured here touches fewer of your tokens"
        return f"As the answer above says ({word}): {why}."
    listed = "; ".join(f"{one_line(c)} ({c['effect']})" for c in ans["changes"])
    return f"As the answer above says ({word}), change, fewest tokens touched first: {listed}."


def one_line(change: dict) -> str:
    """A change's setting on one line: its fields as dotted `key: value` (TRL's YAML), `key=value` (verl), or the
    setting itself (flags, code)."""
    fields = change.get("fields")
    if not fields or change.get("config") == "phantomclip":
        return " ".join(change["setting"].split())
    if change.get("config") == "verl":
        return " ".join(f"{k}={yaml_value(v)}" for k, v in fields.items())
    return ", ".join(f"{k}: {yaml_value(v)}" for k, v in fields.items())


def fmt_figure(v: float | None) -> str:
    """4 significant digits (a bound such as NeMo-RL's 1.05 needs the third decimal), scientific below FIXED_FROM."""
    if v is None or not math.isfinite(v):
        return "n/a"
    return f"{v:.4g}" if abs(v) >= FIXED_FROM or v == 0 else f"{v:.2e}"
