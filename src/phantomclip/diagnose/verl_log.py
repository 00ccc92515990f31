"""`diagnose --from-verl-log LOG`: what a verl run logged (runs/framework_log.py reads its console output or its file
log), as terminal lines: the `phantomclip/*` and `rollout_corr/*` figures of the first and the last steps, each
figure over the whole run (its median, its mean over the first and the last steps and how it moved), what each
means, and the status words the rest of diagnose uses (answer/decide.py), judged on the run's last steps.

Which figure is judged follows where β meets verl's loss (docs/verl.md; answer/setups.py): in bypass mode the clip
compares with the engine's log-probs, so the share of tokens β alone puts outside the trust region is the share
clipped at α = 0 (decide's figure for β in the clip); with `rollout_is` or `rollout_rs` in decoupled mode β is in a
weight, and the share of tokens whose weight the setting changes, or that it removes, is the figure; in decoupled mode
without either, β is in no ratio and the share outside the trust region is used at full weight (decide's figure for
β in neither). The log tells the modes apart exactly: verl runs the correction phantomclip's driver figures hook only
in decoupled mode (verl/trainer/ppo/ray_trainer.py `fit`, "Only in decoupled mode"), so in bypass mode β's figures come
only from phantomclip's recompute, beside the figures only it logs. The same bounds as diagnose's answer: ok <=
OK_SHARE, will stall from STALL_SHARE.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..answer.decide import LEVELS, OK_SHARE, STALL_SHARE, share_status
from ..answer.exposure import pct
from ..answer.verdict_text import FIXED_FROM
from ..runs.framework_log import FrameworkLogError, figure_series, finite_median, read_verl_log

P = "phantomclip/"
MEANINGS = {
    P + "beta_tokens": "response tokens with both log-probs finite (β's N), driver",
    P + "beta_nonfinite": "response tokens whose β is NaN or ±inf, left out of every β figure",
    P + "beta_mean": "mean β = old_log_probs − rollout_log_probs: trainer minus engine at the same weights",
    P + "beta_abs_mean": "mean |β|",
    P + "beta_abs_p99": "99th percentile of |β|",
    P + "beta_abs_max": "largest |β|",
    P + "beta_outside_trust_region": "share of tokens β alone puts outside the trust region (α = 0)",
    P + "is_token_share": "share of tokens whose IS weight your rollout_is setting changes",
    P + "is_seq_share": "share of sequences with such a token",
    P + "rs_token_share": "share of response tokens rejection sampling removes",
    P + "rs_seq_share": "share of sequences with a removed token",
    P + "is_ess": "(Σw)² / (N Σw²) of the IS weights the loss uses: 1 when all are equal",
    P + "actor/tokens": "tokens of a loss call's micro-batch, over every rank (workers)",
    P + "actor/log_ratio_abs_mean": "mean |log_prob − old_log_prob|: α in decoupled mode, α + β in bypass mode",
    P + "actor/clip_high_tokens": "tokens with A > 0 and r > 1 + ε_high: gradient zeroed by the clip",
    P + "actor/clip_low_tokens": "tokens with A < 0 and r < 1 − ε_low: gradient zeroed by the clip",
    P + "actor/clip_rate": "share of tokens the clip zeroes, over every rank",
    P + "actor/dual_clip_tokens": "tokens with A < 0 where dual-clip's bound wins",
    P + "phantom_clip_rate_at_alpha0": "share of tokens clipped at α = 0, each a phantom clip (bypass mode)",
    P + "recompute_seconds": "seconds of bypass mode's extra actor forward",
    P + "bypass_misaligned": "1 when the batch no longer lined up with the recompute (bypass mode)",
    "rollout_corr/kl": "mean of logp_engine − logp: k1 estimate of KL(engine ‖ trainer)",
    "rollout_corr/k3_kl": "k3 estimate of the same KL",
    "rollout_corr/log_ppl_abs_diff": "mean over sequences of |mean logp_engine − mean logp|",
    "rollout_corr/chi2_token": "E[ρ²] − 1 per token, ρ the engine-to-trainer ratio",
    "rollout_corr/chi2_seq": "E[ρ²] − 1 per sequence",
    "rollout_corr/rollout_is_eff_sample_size": "effective sample size of verl's IS weights, in (0, 1]",
}
"""what each figure holds, in a few words (the definitions: docs/verl.md "Figures"; verl's: maths/frameworks.py)."""
SHARES = {P + k for k in ("beta_outside_trust_region", "is_token_share", "is_seq_share", "rs_token_share",
                          "rs_seq_share", "actor/clip_rate", "phantom_clip_rate_at_alpha0")}
"""figures printed as percentages."""
OUTSIDE, IS_SHARE, RS_SHARE = P + "beta_outside_trust_region", P + "is_token_share", P + "rs_token_share"
JUDGED_WORDS = {OUTSIDE: "of tokens outside the trust region at α = 0",
                IS_SHARE: "of tokens whose IS weight your rollout_is setting changes",
                RS_SHARE: "of tokens rejection sampling removes"}
"""the figures a status is judged on (each a share of tokens β touches), as the answer line says them."""
BYPASS_ONLY = (P + "phantom_clip_rate_at_alpha0", P + "recompute_seconds", P + "bypass_misaligned")
"""figures only bypass mode logs: the sign that the clip sees β."""
EDGE = 3
"""steps shown at each end of the per-step table."""
TREND_STEPS = 5
"""a figure's first and last steps averaged for the whole-run summary (at most half its steps each)."""


def judged_keys(series: dict) -> tuple[str, list[str]]:
    """(where β meets the loss, as the log shows it; the figures the status is judged on)."""
    weights = [k for k in (IS_SHARE, RS_SHARE) if k in series]
    if any(k in series for k in BYPASS_ONLY):
        return "the clip (bypass mode)", [k for k in (OUTSIDE, *weights) if k in series]
    if weights:
        return "an IS or RS weight (decoupled mode)", weights
    return "no ratio (decoupled mode without rollout_is or rollout_rs)", [OUTSIDE] if OUTSIDE in series else []


def finite_mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def level_word(share: float) -> str:
    """A share of tokens β touches in the status words of diagnose's answer (answer/decide.py `share_status`); '-'
    for NaN."""
    return share_status(share) if math.isfinite(share) else "-"


def summarise(log: dict) -> dict:
    """{"where", "figures": {key: {"steps", "k", "median", "first", "last", "change", "verdict"}}, "answer":
    {"status", "figure", "share", "k"}}: each figure over its own logged steps (NaN steps left out of its means),
    `change` last/first (NaN where the first is 0 or not finite); the status the worst verdict of the judged figures
    on their last-steps mean, 'not judged' where none was measured."""
    series = figure_series(log)
    where, judged = judged_keys(series)
    figures = {}
    for key, pairs in series.items():
        values = [v for _, v in pairs]
        k = min(TREND_STEPS, max(1, len(values) // 2))
        first, last = finite_mean(values[:k]), finite_mean(values[-k:])
        change = last / first if math.isfinite(first) and first != 0 and math.isfinite(last) else math.nan
        figures[key] = {"steps": len(values), "k": k, "median": finite_median(values), "first": first, "last": last,
                        "change": change, "verdict": level_word(last) if key in judged else "-"}
    measured = [k for k in judged if figures[k]["verdict"] != "-"]
    if not measured:
        return {"where": where, "figures": figures, "answer": {"status": "not judged", "figure": None}}
    worst = max(measured, key=lambda k: (LEVELS[figures[k]["verdict"]], figures[k]["last"]))
    answer = {"status": figures[worst]["verdict"], "figure": worst, "share": figures[worst]["last"],
              "k": figures[worst]["k"]}
    return {"where": where, "figures": figures, "answer": answer}


def _cell(key: str, v: float | None) -> str:
    """A figure as diagnose prints figures (diagnose/text.py `_fmt`); '-' where the step did not log it."""
    if v is None:
        return "-"
    if not math.isfinite(v):
        return "n/a"
    if key in SHARES:
        return f"{100 * v:.2f}%"
    if v == int(v) and abs(v) >= 1:  # a count (tokens): whole
        return str(int(v))
    return f"{v:.3g}" if abs(v) >= FIXED_FROM or v == 0 else f"{v:.1e}"


def answer_line(summary: dict) -> str:
    a = summary["answer"]
    if a["figure"] is None:
        return ("answer: NOT JUDGED: the log holds no share of tokens β touches (phantomclip/"
                "beta_outside_trust_region, is_token_share or rs_token_share): run verl with phantomclip's driver "
                "hook, in bypass mode with its recompute (docs/verl.md)")
    return (f"answer: {a['status'].upper()}: {pct(a['share'])} {JUDGED_WORDS[a['figure']]}, mean of the last "
            f"{a['k']} steps that logged it ({a['figure']}; ok ≤ {100 * OK_SHARE:g}%, stall ≥ {100 * STALL_SHARE:g}%)")


def verl_log_lines(path: str | Path) -> list[str]:
    """The lines `diagnose --from-verl-log` prints; a file that is no verl log, or one without any kept figure, is a
    FrameworkLogError (one line)."""
    log = read_verl_log(path)
    if not log["steps"]:
        raise FrameworkLogError(f"{path}: verl's metrics, but no phantomclip/* or rollout_corr/* figure in them: run "
                                "verl with VERL_USE_EXTERNAL_MODULES=phantomclip.integrations.verl and a "
                                "rollout_correction block (docs/verl.md)")
    s, series = summarise(log), figure_series(log)
    steps = [st["step"] for st in log["steps"]]
    shown = steps if len(steps) <= 2 * EDGE else [*steps[:EDGE], None, *steps[-EDGE:]]
    width = max(map(len, series))
    at = {(st["step"], key): v for st in log["steps"] for key, v in st["figures"].items()}  # last line of a step wins
    head = "".join(f"{'…' if n is None else f'step {n}':>10}" for n in shown)
    lines = [answer_line(s), f"β meets the loss in {s['where']}, as the figures logged show (docs/verl.md)", "",
             f"phantomclip diagnose --from-verl-log {path}: {len(steps)} steps with phantomclip/* or rollout_corr/* "
             f"figures ({log['format']} log), the first and the last {EDGE}:", f"  {'figure':<{width}}{head}"]
    for key in series:
        lines.append(f"  {key:<{width}}" + "".join(f"{'' if n is None else _cell(key, at.get((n, key))):>10}"
                                                   for n in shown))
    lines += ["", "whole run (first, last: mean of a figure's first and last k logged steps, k ≤ "
              f"{TREND_STEPS}; change: last / first; NaN steps left out):",
              f"  {'figure':<{width}}{'steps':>6}{'median':>10}{'first':>10}{'last':>10}{'change':>8}  verdict"]
    for key, f in s["figures"].items():
        change = "-" if not math.isfinite(f["change"]) else f"x{f['change']:.2f}"
        lines.append(f"  {key:<{width}}{f['steps']:>6}{_cell(key, f['median']):>10}{_cell(key, f['first']):>10}"
                     f"{_cell(key, f['last']):>10}{change:>8}  {f['verdict']}")
    lines += ["", "what they mean (every figure: docs/verl.md \"Figures\"):"]
    lines += [f"  {key:<{width}}  {MEANINGS.get(key, 'not one phantomclip defines: see verl docs')}" for key in series]
    return lines
