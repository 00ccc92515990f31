"""The article's tables of an experiment's arms against its baseline: the interventions table (section 7, from an
`experiment sanity` summary) and the FP8 table (section 8, from an `experiment fp8` summary), one implementation
(`html_arms_table`) with each experiment's words for what an arm changes.

It fits the text column: a few narrow columns of numbers per arm, then a full-width row under it with what the
intervention changes and the verdict against the baseline. One unit per quantity: lengths in tokens, rates in % of
tokens, differences of rates in percentage points (pp).

Interval rules, stated under the table: a quantity that cannot be negative (a length, a rate, |β|) is shown as the
mean over seeds with the seeds' min-max, so no bound leaves its range; a difference against the baseline (which
can be negative) is the mean with its paired 95% Student-t interval over seeds, as the experiment computed it.
"""

from __future__ import annotations

import math

from ..maths.metrics import RUN_WINDOW
from .escape import html_text
from .plots import arm_colour

UNITS = {"final_length": (1, "tokens"), "length_auc": (1, "tokens"), "steps_to_converge": (1, "steps"),
         "phantom_rate": (100, "pp")}
"""vs_baseline key -> (scale, unit) of the verdict's differences (their words: experiments.DIFFERENCE_LABELS)."""


def finite(*xs) -> bool:
    """Whether every one of `xs` is a finite number: the report's one test before a figure is used, since a summary
    writes null where a figure was not measured (no token clipped: no phantom share; one seed: no interval)."""
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


def seed_values(summary: dict, arm: str, key: str) -> list[float]:
    """The arm's per-seed values of `key` (its runs' rows in the summary), the unmeasured (null, NaN) left out."""
    return [r[key] for r in summary.get("runs", []) if r.get("run") == arm and finite(r.get(key))]


def _mean_range(summary: dict, arm: str, key: str, scale: float = 1, digits: int = 1) -> str:
    """'16.5 (11.2–22.0)': the mean over seeds and their min–max; '—' when no seed measured it."""
    xs = [scale * x for x in seed_values(summary, arm, key)]
    if not xs:
        return "—"
    mean = f"{sum(xs) / len(xs):.{digits}f}"
    return mean if len(xs) == 1 else f"{mean} <small>({min(xs):.{digits}f}–{max(xs):.{digits}f})</small>"


def _difference(d: dict | None, scale: float, digits: int = 1) -> str:
    """'−8.1 [−11.3, −4.9]': a paired difference and its 95% interval (one seed: the difference alone)."""
    if not d or not finite(d.get("mean")):
        return "—"
    text = f"{scale * d['mean']:+.{digits}f}"
    if finite(d.get("low"), d.get("high")):
        text += f" <small>[{scale * d['low']:+.{digits}f}, {scale * d['high']:+.{digits}f}]</small>"
    return text


def phantom_free(arm: str) -> str | None:
    """Why an arm has no phantom clip by construction, or None: an arm that clips on α alone (shadow-ratio: a phantom
    clip is one α alone would not fire), forces r = 1 (no ratio, no clip) or never clips (ε = ∞). Its phantom-clip
    rate is 0 whatever β does, so its difference from the baseline is the baseline's rate, not a measured effect.
    Read from the Plan fields the arm's interventions set (interventions.INTERVENTIONS; an FP8 arm 'fp8,X' by X)."""
    from ..training.interventions import INTERVENTIONS

    for part in arm.split(","):
        name, _, arg = part.partition("=")
        if name not in INTERVENTIONS:
            continue
        try:
            fields = INTERVENTIONS[name].changes(arg or None)
        except Exception:  # an argument this version refuses: nothing to say by construction
            continue
        if fields.get("clip_on") == "shadow":
            return "it clips on α alone"
        if fields.get("ratio_against") == "self":
            return "its ratio is 1, never clipped"
        if not math.isfinite(fields.get("eps_low", 0.0)) or not math.isfinite(fields.get("eps_high", 0.0)):
            return "it never clips"
    return None


def measured(arm: str, diffs: dict[str, dict]) -> dict[str, dict]:
    """The paired differences of an arm that are measurements: all but the phantom-clip rate of an arm that has no
    phantom clip by construction (phantom_free)."""
    return {k: d for k, d in diffs.items() if not (k == "phantom_rate" and phantom_free(arm))}


def arm_verdict(arm: dict, baseline: str) -> str:
    """The differences whose paired interval excludes zero (experiments.detected, the terminal verdict's rule), in
    their units, or 'no detectable difference'; a difference that holds by construction (phantom_free) is said
    apart, after them."""
    from ..training.experiments import DIFFERENCE_LABELS, detected

    diffs = arm.get("vs_baseline")
    if not diffs:
        return "the baseline"
    n = next(iter(diffs.values()))["n"]
    told = []
    for key, d in detected(measured(arm["run"], diffs)).items():
        scale, unit = UNITS.get(key, (1, ""))
        told.append(f"{DIFFERENCE_LABELS.get(key, key)} {scale * d['mean']:+.2g} {unit} [{scale * d['low']:+.2g}, "
                    f"{scale * d['high']:+.2g}]")
    seeds = f"{n} seed{'s' if n != 1 else ''}"
    why = phantom_free(arm["run"])
    aside = f"; no phantom clips by construction ({why})" if why and "phantom_rate" in diffs else ""
    if not told:
        return f"no detectable difference from {baseline} at {seeds}{aside}"
    return "; ".join(told) + f" vs {baseline} (paired, {seeds}){aside}"


COLUMNS = ("arm", f"final length, tokens (mean of the last {RUN_WINDOW} steps)", "Δ final length vs baseline, tokens",
           "phantom-clipped, % of tokens (whole run)", "Δ phantom-clipped, pp", "phantom share of clipped, %",
           f"mean |β|, first {RUN_WINDOW} → last {RUN_WINDOW} steps")
"""the table's columns; 'final' and 'first → last' name their windows (metrics.RUN_WINDOW steps, token-weighted for
|β|: experiments.summarize_run, metrics.run_phantom_summary)."""


def _cells(summary: dict, a: dict, arms: list[str]) -> list[str]:
    arm, vs = a["run"], a.get("vs_baseline", {})
    beta = "<br>→ ".join(_mean_range(summary, arm, k, digits=3) for k in ("beta_abs_mean_start", "beta_abs_mean_end"))
    swatch = f'<span class="swatch" style="background:{arm_colour(arm, arms)}"></span>'
    n = len(a["seeds"])
    phantom = _difference(vs.get("phantom_rate"), 100, 2)
    if vs.get("phantom_rate") and phantom_free(arm):  # no interval: nothing was measured against the baseline
        phantom = f"{100 * vs['phantom_rate']['mean']:+.2f} <small>by construction</small>"
    return [f"{swatch}<b>{html_text(arm)}</b><br><small>{n} seed{'s' if n != 1 else ''}, {html_text(a['converged'])} "
            "converged</small>",
            _mean_range(summary, arm, "final_length"), _difference(vs.get("final_length"), 1),
            _mean_range(summary, arm, "phantom_rate", 100, 2),
            phantom, _mean_range(summary, arm, "phantom_share_of_clipped", 100, 0), beta]


def intervention_words(arm: str) -> str:
    """What an arm of `experiment sanity` (or epsilon) changes: its intervention's line in training/interventions.py."""
    from ..training.interventions import INTERVENTIONS

    doc = INTERVENTIONS.get(arm.split(",")[0].split("=")[0])
    return doc.doc if doc else "the baseline run"


def fp8_words(arm: str) -> str:
    """What an arm of `experiment fp8` changes ('none', 'fp8', 'fp8,tis'): the engine's FP8 recipe (its line in
    precision/fp8_layers.py), said to be emulated (fp8_layers.EMULATED: the local engine on this CPU, not a GPU's
    kernels), and the correction's line in training/interventions.py."""
    from ..precision.fp8_layers import EMULATED, LINEAR_QUANTS
    from ..training.experiments import FP8_QUANT
    from ..training.interventions import INTERVENTIONS

    engine, _, correction = arm.partition(",")
    if engine != "fp8":
        return "the bf16 engine, nothing corrected (the baseline)"
    if not correction:
        return (f"the engine samples in FP8, {EMULATED} ({FP8_QUANT}, standing for {LINEAR_QUANTS[FP8_QUANT].doc}), "
                "nothing corrected")
    doc = INTERVENTIONS.get(correction)
    return f"the emulated FP8 engine, with {doc.doc if doc else correction}"


def html_sanity_table(data, brief: bool = False) -> str | None:
    """The sanity experiment's arms (section 7); None without one."""
    return html_arms_table(data.sanity[-1], intervention_words, brief=brief) if data.sanity else None


def html_fp8_table(data, brief: bool = False) -> str | None:
    """The FP8 experiment's arms against the bf16 engine (section 8); None without one."""
    return html_arms_table(data.fp8[-1], fp8_words, "fp8-table", brief) if data.fp8 else None


def html_arms_table(summary: dict, words, table_id: str | None = None, brief: bool = False) -> str:
    """The experiment's arms, each with its numbers on one row and what it changes (`words(arm)`) and its verdict on
    a full-width row, and the note on brackets and intervals under the table (`brief`: a table after the page's
    first one only counts its comparisons and refers to the first's note). The page adds its Data: line."""
    baseline = summary.get("baseline", "none")
    arms = [a["run"] for a in summary["arms"]]
    ident = f' id="{table_id}"' if table_id else ""
    head = f'<table class="arms"{ident}><thead><tr>' + "".join(f"<th>{html_text(h)}</th>" for h in COLUMNS)
    body = "</tr></thead>"
    compared = sum(bool(a.get("vs_baseline")) for a in summary["arms"])
    for a in summary["arms"]:
        body += ("<tbody><tr>" + "".join(f"<td>{c}</td>" for c in _cells(summary, a, arms)) + "</tr>"
                 f'<tr class="sub"><td colspan="{len(COLUMNS)}"><b>What it changes:</b> '
                 f"{html_text(words(a['run']))}. <b>Against the baseline:</b> "
                 f"{html_text(arm_verdict(a, baseline))}.</td></tr></tbody>")
    free = [a["run"] for a in summary["arms"]
            if a.get("vs_baseline", {}).get("phantom_rate") and phantom_free(a["run"])]
    rules = ("Lengths, rates and |β| cannot be negative: each is the mean over seeds with the seeds' "
            "lowest and highest value in brackets (a min–max, not an interval, so no bound leaves the quantity's "
            f"range); 'final' is the mean of a run's last {RUN_WINDOW} steps, |β| 'first → last' the token-weighted "
            f"mean over its first and last {RUN_WINDOW}. "
            "Differences against the baseline can be negative: each is the mean of the per-seed differences with its "
            f"paired {html_text(summary.get('interval', '95% Student t interval'))}; pp = percentage points. An "
            "interval that includes zero means no difference was detected at this number of seeds, not that there is "
            "none. ")
    note = ('<p class="note">' + ("Brackets and intervals as under the first table of arms. " if brief else rules)
            + f"Each interval holds for its own comparison with the baseline: {compared} arm"
            f"{'s are' if compared != 1 else ' is'} compared here, and no correction for the number of comparisons "
            "is applied."
            + (" " + html_text(and_join([f"{a} ({phantom_free(a)})" for a in free]))
               + (" has" if len(free) == 1 else " have") + " no phantom clip by construction: the phantom-clip "
               "difference of such an arm is the baseline's rate, not a measured effect, and is not counted among "
               "the detected differences." if free else "") + "</p>")
    return head + body + "</table>" + note


def and_join(items: list[str]) -> str:
    """'a', 'a and b', 'a, b and c': a list in a sentence (arm names may hold commas: 'fp8,tis')."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
