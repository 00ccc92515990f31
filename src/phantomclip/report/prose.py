"""The article's sentences that state a direction, a slope, a ratio or a count: computed from the data the figure
beside them draws, never written into article.md, so a page built from other data says what that data shows.

article.md places them with `<!-- text: NAME -->` inside a paragraph; `TEXTS[NAME](data)` returns the sentence (plain
text, escaped by the page) or "" when its data is missing, and the paragraph then reads without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..maths.metrics import PROB_EDGES
from .correlation import cohen_size, pearson_and_slope, sign_test_two_sided, spearman, spearman_interval
from .interventions_table import and_join

FEW_POINTS = 10
"""with fewer points inside the axes, the α-β sentence gives ρ and says the points are too few to read a direction
from: a 95% interval over 4 points spans nearly [−1, 1], and a sentence that concludes from it reads noise."""


def _trend_words(rho: float, interval: tuple[float, float] | None) -> str:
    """'a clear small fall', 'a clear medium rise' or 'no detectable direction': 'clear' only where the 95% interval
    excludes zero, the size in Cohen's words (correlation.cohen_size)."""
    if interval is None or interval[0] <= 0 <= interval[1]:
        return "no detectable direction"
    return f"a clear {cohen_size(rho)} {'rise' if rho > 0 else 'fall'}"


def alpha_beta_steps(data) -> str:
    """Section 4: which way the per-step (mean α, mean β) points of fig_alpha_beta_steps go, against the slope −1
    that the shared rounding alone would give them. The rule, stated in the sentence: over the points inside the
    figure's axes (training_panel.inside_axes), of every arm whether shown on opening or not, the rank correlation ρ
    with its 95% interval (correlation.spearman_interval): a rise or fall only where the interval excludes zero,
    'no detectable direction' where it holds it; and how many arms' own ρ is positive or negative, with the
    two-sided sign test on that count. Points outside the axes are left out; where Pearson's r over every point
    says another direction, the sentence says so (a few far points set it). Fewer than FEW_POINTS points: ρ and
    no conclusion."""
    from .training_panel import alpha_beta_points, inside_axes

    arms = alpha_beta_points(data)
    every = [p for points in arms.values() for p in points]
    if len(every) < 3:
        return ""
    inside = inside_axes(every)
    shown = [p for p in every if p in inside]
    rho = spearman([p[0] for p in shown], [p[1] for p in shown])
    if rho is None:
        return ""
    if len(shown) < FEW_POINTS:
        return (f"Only {len(shown)} points lie inside these axes (Spearman's rank correlation ρ = {rho:+.2f}): too "
                "few to read a direction from, so none is read here.")
    interval = spearman_interval(rho, len(shown))
    bounds = f", 95% interval [{interval[0]:+.2f}, {interval[1]:+.2f}]" if interval else ""
    trend = _trend_words(rho, interval)
    text = (f"Over the {len(shown)} points inside these axes, mean β shows {trend} against mean α (Spearman's rank "
            f"correlation ρ = {rho:+.2f}{bounds})")
    per_arm = {arm: spearman([p[0] for p in pts if p in inside], [p[1] for p in pts if p in inside])
               for arm, pts in arms.items()}
    per_arm = {arm: r for arm, r in per_arm.items() if r is not None}
    if len(per_arm) > 1:
        rise, fall = sum(r > 0 for r in per_arm.values()), sum(r < 0 for r in per_arm.values())
        p = sign_test_two_sided(rise, fall)
        majority = (f"more {'rise' if rise > fall else 'fall'} than chance would give" if p < 0.05
                    else "no detectable majority")
        text += (f"; of the {len(per_arm)} arms, {rise} rise and {fall} fall on their own points (two-sided sign "
                 f"test p = {p:.2g}: {majority})"
                 + (f" (the baseline none: ρ = {per_arm['none']:+.2f})" if "none" in per_arm else ""))
    text += "."
    if len(shown) < len(every):
        text += f" The {len(every) - len(shown)} points outside the axes are left out"
        fit = pearson_and_slope([p[0] for p in every], [p[1] for p in every])
        if fit is not None and (fit[0] > 0) != (rho > 0):
            text += f": with them Pearson's r reads {fit[0]:+.2f}, a direction a few far points set, not the bulk"
        text += "."
    if trend == "no detectable direction":
        return text + " No direction is detected at this number of points: neither the shared rounding's nor another."
    if rho < 0:
        return text + (f" That is the direction the shared rounding gives them, and a {cohen_size(rho)} one (ρ² = "
                       f"{rho * rho:.0%}: α's ranks account for that share of the variance of β's).")
    return text + (" That is the opposite of the shared rounding's direction: something that moves α and β the same "
                   "way outweighs it in these runs.")


def _bucket_ratio(edges: list[float], means: list) -> tuple[str, str, float] | None:
    """(lowest non-empty bucket, highest non-empty bucket, ratio of their mean |β|) or None."""
    filled = [(i, m) for i, m in enumerate(means) if m is not None and m > 0]
    if len(filled) < 2:
        return None
    (lo, m_lo), (hi, m_hi) = filled[0], filled[-1]
    return f"{edges[lo]:g}–{edges[lo + 1]:g}", f"{edges[hi]:g}–{edges[hi + 1]:g}", m_lo / m_hi


def _ratio_words(ratio: float) -> str:
    return f"{ratio:.1f} times" if ratio >= 1 else f"{1 / ratio:.1f} times less than"


def rare_tokens(data) -> str:
    """Section 3: how much larger mean |β| is in the lowest probability bucket than in the highest, by the first
    recipe of the last diagnose file (the data of fig_beta_by_prob, figures.beta_by_bucket)."""
    if not data.diagnose:
        return ""
    from .figures import beta_by_bucket

    diag = data.diagnose[-1]
    name, arr = next(iter(diag["tokens"]["per_recipe"].items()))
    found = _bucket_ratio(list(PROB_EDGES), beta_by_bucket(diag, arr["beta"])[0])
    if found is None:
        return ""
    lo, hi, ratio = found
    return (f"In this data ({name} trainer), tokens the engine gave a probability of {lo} carry "
            f"{_ratio_words(ratio)} the mean |β| of tokens at {hi}.")


def _spread(xs: list[float], fmt: str = ".1f", what: str = "runs") -> str:
    """'174.1 (148.3 to 340.7 over 6 runs)': the median of `xs` and their range over `what`, or the one value."""
    if len(xs) == 1:
        return f"{xs[0]:{fmt}} (one {'run' if what == 'runs' else 'measurement'})"
    ordered = sorted(xs)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return f"{median:{fmt}} (median; {ordered[0]:{fmt}} to {ordered[-1]:{fmt}} over {len(xs)} {what})"


def gap_along_runs(data) -> str:
    """Section 6: whether mean |β| on the fixed tokens rose from the first to the last snapshot, run by run, and
    how much larger the rarest bucket's |β| was than the most confident's at the first snapshot, over every run
    (median and range: one run's figure is not the runs')."""
    rows = [[s for s in g["snapshots"] if "reference" in s] for g in data.growths]
    pairs = [(r[0]["reference"]["beta_abs_mean"], r[-1]["reference"]["beta_abs_mean"]) for r in rows if r]
    pairs = [(a, b) for a, b in pairs if a and b is not None]
    if not pairs:
        return ""
    factors = [b / a for a, b in pairs]
    up = sum(f > 1.05 for f in factors)
    down = sum(f < 1 / 1.05 for f in factors)
    n = len(factors)
    span = (f"×{factors[0]:.2f}" if n == 1 else f"×{min(factors):.2f} to ×{max(factors):.2f}")
    if n == 1:
        moved = ("grew" if up else "shrank" if down else "stayed within 5% of where it was")
        text = (f"In the one run measured here, mean |β| on the fixed tokens {moved} from the first to the last "
                f"snapshot ({span}).")
    else:
        text = (f"In the {n} runs measured here, mean |β| on the fixed tokens grew by more than 5% from the first to "
                f"the last snapshot in {up}, shrank by more than 5% in {down}, and held within 5% in {n - up - down} "
                f"({span}).")
    found = [(f, g) for g, r in zip(data.growths, rows) if r
             for f in [_bucket_ratio(g["prob_edges"], r[0]["reference"]["bucket_beta_abs_mean"])] if f]
    same = [f for f, _ in found if f[:2] == found[0][0][:2]] if found else []
    if same:
        lo, hi, _ = same[0]
        # runs of the same seed share their first snapshot (the same weights on the same tokens): one measurement,
        # counted once, where the demo's 6 runs gave 3 distinct first snapshots, each twice
        ratios = list(dict.fromkeys(f[2] for f in same))
        twice = (f" ({len(same)} runs; runs that start from the same seed share their first snapshot, counted once)"
                 if len(ratios) < len(same) else "")
        text += (f" At the first snapshot, tokens of engine probability {lo} carried "
                 f"{_spread(ratios, what='distinct first snapshots')} times the mean |β| of tokens at {hi}{twice}.")
    return text


def closed_loop_seeds(data) -> str:
    """Section 5: what a line and a band are for the seeds there are, and how many arms start hidden."""
    from .training_panel import arm_runs, arm_shown, run_seed

    arms = arm_runs(data, "completion/length_mean")
    if not arms:
        return ""
    seeds = {arm: frozenset(run_seed(r, i) for i, r in enumerate(runs)) for arm, runs in arms.items()}
    most = max(len(s) for s in seeds.values())
    if most == 1 and len(arms) == 1:
        text = ("This page has one run: each line is that run, step by step, with no band (a band needs two seeds) "
                "and nothing yet to tell its noise from its trend.")
    elif most == 1:
        text = (f"Each of the {len(arms)} arms has one seed here: each line is that run, with no band (a band needs "
                "two seeds), so a gap between two lines may be one seed's luck.")
    else:
        same = len(set(seeds.values())) == 1
        text = ((f"Every arm runs under the same {most} seeds" if same else
                 f"The arms run under {min(len(s) for s in seeds.values())} to {most} seeds each") +
                "; each line is the mean over seeds, and its band spans the lowest to the highest seed at that step "
                "(with a few seeds a 95% interval is wider than the data and can cross zero, which none of these "
                "quantities can).")
    hidden = sum(arm_shown(arm, len(arms)) is not True for arm in arms)
    if len(arms) > 1:
        text += " Click the legend to show or hide an arm" + (f" ({hidden} of {len(arms)} start hidden)."
                                                               if hidden else ".")
    return text


def _interval(d: dict, key: str, digits: int) -> str:
    """'−15.1 [−24.1, −6.0] tokens': a paired difference as the FP8 table shows it (its digits; the scale and unit of
    interventions_table.UNITS)."""
    from .interventions_table import UNITS

    scale, unit = UNITS[key]
    return (f"{scale * d['mean']:+.{digits}f} [{scale * d['low']:+.{digits}f}, {scale * d['high']:+.{digits}f}]"
            f" {unit}")


FP8_COMPARED = (("final_length", 1, "Against the bf16 engine ({baseline}) in final length",
                 ("ended shorter", "ended longer")),
                ("phantom_rate", 2, "In phantom-clip rate", ("were below the bf16 engine's", "were above it")))
"""the differences the FP8 sentence reads: summary key, digits (the table's), the clause's opening, and the words for
an interval below zero and above it."""


@dataclass(frozen=True)
class Fp8Verdicts:
    """What the FP8 arms' paired intervals allow, read once by the one rule (experiments.detected) for the two
    places that say it: section 8's sentence (fp8_result) and the summary's FP8 line (summary.html_summary)."""

    baseline: str
    """the experiment's baseline arm: the bf16 engine, nothing corrected ('none')"""
    seeds: tuple[int, ...]
    """the seed counts n of the arms' paired differences, smallest first (one value when every arm has the same)"""
    by_key: tuple[tuple[list[tuple[str, dict]], list[tuple[str, dict]], list[str]], ...]
    """per FP8_COMPARED row: (arms whose interval lies below zero, with their difference; arms whose interval lies
    above zero, with theirs; arms whose interval includes zero), each in the summary's order of arms"""
    compared: int
    """how many (arm, quantity) intervals were read: the count of comparisons"""
    found: int
    """how many of them exclude zero"""
    by_construction: tuple[tuple[str, str], ...] = ()
    """(arm, why) of the arms with no phantom clip by construction (interventions_table.phantom_free): their
    phantom-clip difference is the baseline's rate, not a comparison, and is neither in by_key nor counted"""

    def seeds_words(self) -> str:
        """'3 seeds' or '2 to 3 seeds'."""
        return f"{self.seeds[0]} seeds" if len(self.seeds) == 1 else f"{self.seeds[0]} to {self.seeds[-1]} seeds"


def fp8_verdicts(summary: dict) -> Fp8Verdicts | None:
    """The verdicts of an `experiment fp8` summary's arms on FP8_COMPARED's quantities; None when no arm has a
    paired difference (no seed counted). An interval counts only when its mean and bounds are finite (one seed: no
    interval, nothing compared), and only when it measures something (interventions_table.measured)."""
    from ..training.experiments import detected
    from .interventions_table import finite, measured, phantom_free

    arms = [a for a in summary["arms"] if a.get("vs_baseline")]
    seeds = sorted({d["n"] for a in arms for d in a["vs_baseline"].values() if isinstance(d.get("n"), int)})
    if not seeds:
        return None
    by_key, compared, found = [], 0, 0
    for key, *_ in FP8_COMPARED:
        lower, higher, same = [], [], []
        for a in arms:
            d = measured(a["run"], a["vs_baseline"]).get(key)
            if not d or not finite(d.get("mean"), d.get("low"), d.get("high")):
                continue
            compared += 1
            if detected({key: d}):
                found += 1
                (lower if d["high"] < 0 else higher).append((a["run"], d))
            else:
                same.append(a["run"])
        by_key.append((lower, higher, same))
    free = tuple((a["run"], why) for a in arms
                 if "phantom_rate" in a["vs_baseline"] and (why := phantom_free(a["run"])))
    return Fp8Verdicts(summary.get("baseline", "none"), tuple(seeds), tuple(by_key), compared, found, free)


def fp8_clauses(verdicts: Fp8Verdicts, arm: Callable[[str, dict, str, int], str],
                mark: Callable[[str], str] = str, text: Callable[[str], str] = str) -> list[str]:
    """Per FP8_COMPARED quantity with an arm to name, its clause: the opening, then the arms below zero, above zero,
    and with no detectable difference, in FP8_COMPARED's words. `arm(run, difference, key, digits)` names an arm whose
    interval excludes zero (with its figure); `mark` wraps such a group (the summary bolds it); `text` makes a plain
    string safe where it is embedded (the summary's html_text; section 8's sentence is escaped whole by the page)."""
    parts = []
    for (key, digits, opening, (below, above)), (lower, higher, same) in zip(FP8_COMPARED, verdicts.by_key):
        said = [f"{mark(and_join([arm(run, d, key, digits) for run, d in group]))} {words}"
                for group, words in ((lower, below), (higher, above)) if group]
        said += [f"{and_join([text(run) for run in same])} showed no detectable difference"] if same else []
        if said:
            parts.append(text(opening.format(baseline=verdicts.baseline)) + ", " + "; ".join(said))
    if verdicts.by_construction:
        parts.append(text(and_join([run for run, _ in verdicts.by_construction]) + " have no phantom clip by "
                          "construction (" + "; ".join(f"{run}: {why}" for run, why in verdicts.by_construction)
                          + "), so theirs is not a comparison"))
    return parts


def fp8_result(data) -> str:
    """Section 8: what the FP8 arms did against the bf16 engine, in the words the table's intervals allow: an arm is
    said to end shorter (or to have fewer phantom clips) only where its paired interval lies below zero
    (experiments.detected, the table's verdict rule, read by fp8_verdicts); where the interval includes zero, 'no
    detectable difference'; with one seed, no interval and no direction. The intervals' terms are said: paired by
    seed over N seeds, 95% per comparison, no correction for the number of comparisons
    (multiple_comparisons_note)."""
    from .interventions_table import finite
    if not data.fp8:
        return ""
    summary = data.fp8[-1]
    verdicts = fp8_verdicts(summary)
    if verdicts is None:
        return ""
    baseline = verdicts.baseline
    if verdicts.seeds[-1] < 2:
        return (f"Each arm has one seed here: the table gives each difference from the bf16 engine ({baseline}) "
                "without an interval, and one seed cannot tell an arm's effect from that seed's luck.")
    parts = []
    base = next((a for a in summary["arms"] if a["run"] == baseline), None)
    fp8 = next((a for a in summary["arms"] if a["run"] == "fp8" and a.get("vs_baseline")), None)
    if fp8 is not None and base is not None:
        b0, b1 = base["beta_abs_mean_start"].get("mean"), fp8["beta_abs_mean_start"].get("mean")
        if finite(b0, b1) and b0 > 0:
            parts.append(f"The FP8 engine starts with a mean |β| of {b1:.3f} against the bf16 engine's {b0:.3f} "
                         f"({b1 / b0:.1f} times; means over seeds)")
    parts += fp8_clauses(verdicts, lambda run, d, key, digits: f"{run} ({_interval(d, key, digits)})")
    if not verdicts.compared:
        return ""
    return (". ".join(parts) + f". Each difference is paired by seed over {verdicts.seeds_words()}."
            + multiple_comparisons_note(verdicts.compared, verdicts.found))


def postmortem_weights(data) -> str:
    """Section 6's lead-in to the reader's post-mortem: which weights each recorded step was scored at, as the
    post-mortem recorded it: each step's own checkpoint only where checkpoints were given; '' without a post-mortem
    (the paragraph then names the command alone)."""
    doc = next((d for d in reversed(data.diagnose) if d.get("postmortem")), None)
    if doc is None:
        return ""
    pm = doc["postmortem"]
    if pm.get("checkpoints"):
        return "Here each step was scored at its own checkpoint, the weights that sampled it."
    first = (pm.get("steps") or [{}])[0].get("checkpoint") or "the model given"
    return (f"No checkpoints were given for this run: every step was scored at one set of weights ({first}), so a "
            "step those weights did not sample holds the policy's change α as well as β.")


def fp8_emulated(data) -> str:
    """Section 8's warning that its FP8 engine is emulated, only where the page holds FP8 data (a page without any
    has no FP8 engine to warn about)."""
    if not (data.fp8 or data.fp8_runs):
        return ""
    return ("The FP8 engine on this page is emulated on a CPU, not run on an FP8 GPU: phantomclip's local engine "
            "applies vLLM's quantisers bit for bit and sums the exact E4M3 products in fp32, in one order. A GPU "
            "kernel sums them in another order, which moves a single token's β_quant by as much as its size, so this "
            "section reads what does not hang on the order: means, shares outside the trust region, and the runs' "
            "outcomes.")


def moe_model(data) -> str:
    """Section 9: what the page's MoE model is, where moe_panel.MODEL_WORDS knows it (tiny-moe: a random model whose
    figures show the mechanism, not a real MoE's size); '' without MoE data."""
    from .moe_panel import MODEL_WORDS, experiment_model, moe_diagnose

    names = [str(s.get("base_config", {}).get("model", "")) for s in data.moe]
    doc = moe_diagnose(data)
    names += [str((doc.get("config") or {}).get("model", ""))] if doc else []
    known = [n for n in names if n.split(":")[0] in MODEL_WORDS]
    if not known:
        return ""
    return (f"The MoE model of this page is {experiment_model({'base_config': {'model': known[0]}})}: its figures "
            "show the mechanism, not the size of a real MoE's routing mismatch.")


def _seed_compared(data) -> str:
    from .seed_article import seed_compared

    return seed_compared(data)


def _moe_result(data) -> str:
    from .moe_panel import moe_result

    return moe_result(data)


TEXTS: dict[str, Callable] = {"closed_loop_seeds": closed_loop_seeds, "alpha_beta_steps": alpha_beta_steps,
                              "rare_tokens": rare_tokens, "gap_along_runs": gap_along_runs, "fp8_result": fp8_result,
                              "moe_result": _moe_result, "postmortem_weights": postmortem_weights,
                              "seed_compared": _seed_compared, "fp8_emulated": fp8_emulated, "moe_model": moe_model}
"""marker name -> the sentence it becomes ("" when its data is missing)."""


def multiple_comparisons_note(m: int, detected: int, where: str = "") -> str:
    """What m separate 95% intervals mean together. No correction is applied (the intervals are experiment's, each
    at 95% on its own); the note says how many would exclude zero by chance alone if no arm changed anything:
    m · 0.05 expected, at least one with probability 1 − 0.95^m (independent comparisons; they share the baseline's
    seeds, so this is a guide, not an exact rate). `where`: which lines the m comparisons come from, when more than
    one ('(11 in section 7, 12 in section 8)')."""
    if m < 2:
        return ""
    return (f" Each interval is 95% on its own, with no correction for the {m} comparisons{where}: if no arm changed "
            f"anything, on average {0.05 * m:.2g} of them would still exclude zero by chance (at least one with "
            f"probability {1 - 0.95 ** m:.0%}), against {detected} here; read one detected arm as a lead to rerun "
            "with more seeds.")
