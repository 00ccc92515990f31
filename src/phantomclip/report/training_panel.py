"""The article's closed loop: per-step figures of the training runs, one line per arm (its intervention) with a band
over its seeds, and the per-step α against β scatter.

The band rule: at each step, the band spans the lowest to the highest value the arm's seeds logged there (their
min-max, not a t interval). Every edge of it is a measured value, so a quantity that cannot be negative never gets a
band below zero; with three seeds a 95% t interval would be about twice as wide as the data and leave the range of
the quantity. A step that fewer seeds reached (runs stop early once they converged) is drawn as an open marker with
the count in its hover, and where no seed logged a step the line has a gap: nothing is interpolated across it.
"""

from __future__ import annotations

import math

from .correlation import spearman, spearman_interval
from .plots import arm_colour, figure, mean_line, note, plot_layout, seed_band, seed_symbol, step_axis

SHOWN_ARMS = ("none", "force-r1", "shadow-ratio", "match-bf16", "no-clip")
"""arms drawn when the page opens; the others start hidden (click the legend to show them)."""
FP8_SHOWN_ARMS = ("none", "fp8", "fp8,tis", "fp8,shadow-ratio", "fp8,force-r1")
"""the FP8 section's: the bf16 engine, the FP8 engine, one reweighting correction and the two that take β out of
the clip (MIS and IcePop start hidden)."""


def arm_runs(data, key: str, runs: list[dict] | None = None) -> dict[str, list[dict]]:
    """Runs that log `key` (`runs`, or the closed loop's `data.runs`), grouped by the name every figure gives them
    (sources.seed_group: the experiment's arm, else the run directory's), in the order they were found."""
    arms: dict[str, list[dict]] = {}
    for r in data.runs if runs is None else runs:
        if r["metrics"] and key in r["metrics"][0]:
            arms.setdefault(r["group"], []).append(r)
    return arms


def step_values(runs: list[list[dict]], key: str, carry: bool) -> list[list[float]]:
    """Per step (1 .. the last step any run logged), the runs' values of `key`, each row placed by its own "step"
    (not by its place in the file: a row is where its step is); with `carry`, a run that stopped early (it
    converged) holds its last step's value, as experiments.length_curve does, so the mean does not jump when it
    stops."""
    steps = max((r["step"] for rows in runs for r in rows), default=0)
    values: list[list[float]] = [[] for _ in range(steps)]
    for rows in runs:
        by_step = {r["step"]: r for r in rows}
        last = by_step.get(max(by_step, default=0), {})
        for s in range(1, steps + 1):
            row = by_step.get(s)
            if row is not None and row.get(key) is not None:
                values[s - 1].append(row[key])
            elif carry and last and s > last["step"] and last.get(key) is not None:
                values[s - 1].append(last[key])
    return values


def arm_shown(arm: str, n_arms: int, shown: tuple[str, ...] = SHOWN_ARMS) -> bool | str:
    return True if arm in shown or n_arms <= len(shown) else "legendonly"


BAND_ARMS = 2
"""bands drawn when the page opens: with more arms shown, translucent bands of five arms overlap into one muddy
area; the first BAND_ARMS shown arms (the baseline first) keep theirs and the button under the figure shows every
arm's (layout.js bandToggle)."""


def band_arms(arms: dict[str, list[dict]], shown_arms: tuple[str, ...] = SHOWN_ARMS) -> list[str]:
    """The arms whose band is drawn when the page opens: the baseline first, then the others shown, BAND_ARMS in all;
    every arm when no more than BAND_ARMS are shown."""
    shown = [a for a in arms if arm_shown(a, len(arms), shown_arms) is True]
    shown.sort(key=lambda a: a != "none")  # stable: the baseline first
    return shown[:BAND_ARMS]


def per_step_caption(arms: dict[str, list[dict]], carry: bool, shown_arms: tuple[str, ...] = SHOWN_ARMS,
                     every_band: bool = False) -> str:
    """What the lines and bands of a per-step figure are for the seeds actually there: with one seed per arm there
    is no mean and no band, and with one run no arm to compare. `every_band`: the caption after the button under
    the figure has drawn every arm's band (layout.js bandToggle swaps the two)."""
    most = max(len(runs) for runs in arms.values())
    fewest = min(len(runs) for runs in arms.values())
    if most == 1:
        how = "One run" if len(arms) == 1 else "One seed per arm: each line is that run"
        how += "; no band: a band needs two seeds"
    else:
        banded = band_arms(arms, shown_arms)
        shown = sum(arm_shown(a, len(arms), shown_arms) is True for a in arms)
        how = "Line: the mean over seeds; band: the seeds' min–max"
        if shown > len(banded):
            how += (f", drawn for every arm (the button below shows only {' and '.join(banded)}'s again)" if every_band
                    else f", drawn for {' and '.join(banded)} (the button below shows every arm's)")
        how += "; open marker: a step fewer seeds reached" if not carry else ""
        if fewest == 1:
            how += "; an arm of one seed has no band"
    if carry:
        how += "; a run that stopped after converging keeps its last length"
    return how + "."


def _key_points(per_arm: dict[str, list[list[float]]], scale: float, shown: list[str], unit: str) -> list[dict]:
    """The figure's key point, drawn on it: the baseline's mean at its last step, and the shown arm that ends lowest
    at its own last step (what a fix does to where the baseline stays)."""
    def last(arm: str) -> tuple[int, float] | None:
        values = per_arm[arm]
        i = max((i for i, v in enumerate(values) if v), default=None)
        return None if i is None else (i + 1, scale * sum(values[i]) / len(values[i]))

    def amount(v: float) -> str:
        return f"{v:.2g}%" if unit == "%" else f"{v:.3g} {unit[:-1] if v == 1 and unit.endswith('s') else unit}"

    notes = []
    base = last("none") if "none" in per_arm else None
    if base:  # above its point, to the left (the last step is at the right edge)
        notes.append(note(*base, f"none: {amount(base[1])} at step {base[0]}", ax=-40, ay=-45, xanchor="right"))
    ends = [(e[1], arm, e) for arm in shown if arm != "none" and (e := last(arm))]
    if ends:
        _, arm, (step, v) = min(ends)
        if not base or v < base[1]:  # further left than the baseline's, at the height of its own point
            notes.append(note(step, v, f"{arm}: {amount(v)} at step {step}", ax=-110, ay=-12, xanchor="right"))
    return notes


def per_step(data, key: str, what: str, ylabel: str, carry: bool = False, runs: list[dict] | None = None,
             shown: tuple[str, ...] = SHOWN_ARMS) -> dict | None:
    """One line per arm: the mean over its seeds at each step, in the band of their min-max; band and line share a
    legend entry, so a click shows or hides both. `what`: the title; per_step_caption says what the marks are.
    `runs` (the closed loop's `data.runs` by default) and `shown` (the arms drawn on opening) let the FP8 section
    draw its own experiment's runs."""
    arms = arm_runs(data, key, runs)
    if not arms:
        return None
    caption = per_step_caption(arms, carry, shown)
    scale = 100 if key.startswith("clip/") else 1
    traces, used, banded = [], [], band_arms(arms, shown)
    per_arm = {arm: step_values([r["metrics"] for r in runs], key, carry) for arm, runs in arms.items()}
    top = axis_cut([scale * v for values in per_arm.values() for vs in values for v in vs])
    above: list[tuple[float, str, int]] = []
    for arm, runs in arms.items():
        values = per_arm[arm]
        colour = arm_colour(arm, list(arms))
        common = {"legendgroup": arm, "visible": arm_shown(arm, len(arms), shown)}
        traces += seed_band(values, scale, {"fillcolor": colour, **common,
                                            **({} if arm in banded else {"opacity": 0})})
        seeds = f"{len(runs)} seed" + ("s" if len(runs) > 1 else "")
        traces.append(mean_line(values, scale, len(runs), {"name": f"{arm} ({seeds})", "line": {"color": colour},
                                                           **common}))
        if top is not None:
            over = [(i + 1, [scale * v for v in vs if scale * v > top]) for i, vs in enumerate(values)]
            over = [(step, vs) for step, vs in over if vs]
            above += [(v, arm, step) for step, vs in over for v in vs]
            if over:  # ▲ on the top edge where a seed's value is above the cut, its values in the hover
                traces.append({"type": "scatter", "mode": "markers", "x": [o[0] for o in over],
                               "y": [top] * len(over), "cliponaxis": False, "showlegend": False,
                               "marker": {"symbol": "triangle-up", "size": 10, "color": colour},
                               "text": [f"{arm}, above the axis: " + ", ".join(f"{v:.3g}" for v in vs)
                                        for _, vs in over],
                               "hovertemplate": "step %{x}: %{text}<extra></extra>", **common})
        used += runs
    yaxis = {"rangemode": "tozero"}
    if above:
        yaxis = {"range": [0, top], "autorange": False}
        v, arm, step = max(above)
        caption += (f" The axis stops at {top:.3g}, {CUT_RULE}: {len(above)} seed "
                    f"value{'s' if len(above) > 1 else ''} above it, marked ▲ on the top edge (the largest {v:.3g}, "
                    f"{arm} at step {step}).")
    layout = plot_layout("step", ylabel, yaxis=yaxis, xaxis=step_axis([1, max(len(v) for v in per_arm.values())]))
    opened = [a for a in arms if arm_shown(a, len(arms), shown) is True]
    unit = "%" if scale == 100 else "nats" if "nats" in ylabel else ylabel
    layout["annotations"] = _key_points(per_arm, scale, opened, unit)
    toggle = any(t.get("opacity") == 0 for t in traces if t.get("fill") == "toself")
    return figure(traces, layout, what, caption, ("runs", used), band_toggle=toggle,
                  caption_every_band=caption.replace(per_step_caption(arms, carry, shown),
                                                     per_step_caption(arms, carry, shown, every_band=True), 1))


CUT_FACTOR = 2.0
"""the axis of a per-step figure is cut when its largest value is more than CUT_FACTOR times the 99th percentile
of all values drawn: then one seed's spike (no-clip's 1.2 nats at step 27 in the demo, against 0.28 for the 99th
percentile) would squeeze every other arm into the bottom of the plot."""
CUT_RULE = f"1.5 × the 99th percentile of the seeds' values, since the largest is over {CUT_FACTOR:g} times that"


def axis_cut(values: list[float]) -> float | None:
    """The top of a per-step figure's axis, or None when the values need no cut: 1.5 × their 99th percentile where
    the largest is more than CUT_FACTOR times it; never under ALL_POINTS_BELOW values (a few points all show)."""
    xs = sorted(v for v in values if math.isfinite(v))
    if len(xs) < ALL_POINTS_BELOW:
        return None
    p99 = xs[int(0.99 * (len(xs) - 1))]
    return 1.5 * p99 if p99 > 0 and xs[-1] > CUT_FACTOR * p99 else None


ALL_POINTS_BELOW = 50
"""with fewer points the axes hold every one: a 1-99 percentile range on 6 points hid 2 of them, and a
handful of points cannot squash each other out of sight."""


FENCE = 3.0
"""the α-β scatter's axes reach FENCE interquartile ranges past the quartiles (Tukey's 'far out' fences): the
middle 98% of the demo's points filled the axes so loosely that the middle 80% took 13% x 10% of them."""


def _robust_range(values: list[float]) -> list[float]:
    """An axis range fitted to the bulk of `values`: from the lowest value at or above Q1 − FENCE·IQR to the highest
    at or below Q3 + FENCE·IQR, with a margin, so a few far points do not squash the rest; with fewer than
    ALL_POINTS_BELOW values, all of them."""
    xs = sorted(values)
    q1, q3 = xs[int(0.25 * (len(xs) - 1))], xs[int(0.75 * (len(xs) - 1))]
    inside = [x for x in xs if q1 - FENCE * (q3 - q1) <= x <= q3 + FENCE * (q3 - q1)]
    lo, hi = inside[0], inside[-1]
    if len(xs) < ALL_POINTS_BELOW:
        lo, hi = xs[0], xs[-1]
    pad = 0.08 * (hi - lo or abs(hi) or 1e-3)
    return [lo - pad, hi + pad]


def alpha_beta_points(data) -> dict[str, list[tuple[float, float]]]:
    """arm -> its runs' per-step (mean α, mean β): the points of fig_alpha_beta_steps."""
    return {arm: [(m["mismatch/alpha_mean"], m["mismatch/beta_mean"]) for r in runs for m in r["metrics"]
                  if m.get("mismatch/alpha_mean") is not None and m.get("mismatch/beta_mean") is not None]
            for arm, runs in arm_runs(data, "mismatch/alpha_mean").items()}


def inside_axes(points: list[tuple[float, float]]) -> set[tuple[float, float]]:
    """The points fig_alpha_beta_steps' axes hold (both coordinates inside _robust_range of all the points): the
    points its sentence (prose.alpha_beta_steps) reads."""
    (x0, x1), (y0, y1) = _robust_range([p[0] for p in points]), _robust_range([p[1] for p in points])
    return {p for p in points if x0 <= p[0] <= x1 and y0 <= p[1] <= y1}


def run_seed(run: dict, i: int) -> int:
    """The run's seed from its configuration; its place among the arm's runs for a config without one."""
    seed = run["config"].get("seed")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else i


def fig_alpha_beta_steps(data) -> dict | None:
    """Per step: each run's mean α against its mean β; colour is the arm, the marker the seed. The axes hold the
    points inside Tukey's far-out fences (_robust_range); the caption states the rule and counts those outside, and
    the plot carries the rank correlation its sentence reads (prose.alpha_beta_steps)."""
    arms = arm_runs(data, "mismatch/alpha_mean")
    if not arms:
        return None
    traces, xs, ys, used = [], [], [], []
    for arm, runs in arms.items():
        points = [(m["mismatch/alpha_mean"], m["mismatch/beta_mean"], m["step"], run_seed(r, i))
                  for i, r in enumerate(runs) for m in r["metrics"]
                  if m.get("mismatch/alpha_mean") is not None and m.get("mismatch/beta_mean") is not None]
        xs += [p[0] for p in points]
        ys += [p[1] for p in points]
        used += runs
        traces.append({"type": "scatter", "mode": "markers", "name": arm, "legendgroup": arm,
                       "visible": arm_shown(arm, len(arms)), "x": [p[0] for p in points], "y": [p[1] for p in points],
                       "marker": {"color": arm_colour(arm, list(arms)), "size": 7, "opacity": 0.7,
                                  "symbol": [seed_symbol(p[3]) for p in points]},
                       "customdata": [[p[3], p[2]] for p in points],
                       "hovertemplate": "seed %{customdata[0]}, step %{customdata[1]}: α %{x:.4f}, β %{y:.4f}"})
    if not xs:
        return None
    x_range, y_range = _robust_range(xs), _robust_range(ys)
    outside = sum(not (x_range[0] <= x <= x_range[1] and y_range[0] <= y <= y_range[1]) for x, y in zip(xs, ys))
    seeds = sorted({run_seed(r, i) for runs in arms.values() for i, r in enumerate(runs)})
    if len(seeds) > 1:
        caption = ("Colour: the arm; marker: the seed (" + ", ".join(f"{seed_symbol(s).replace('-', ' ')} {s}"
                                                                     for s in seeds) + ").")
    else:
        caption = f"{'Colour: the arm; ' if len(arms) > 1 else ''}one seed ({seeds[0]})."
    if outside:
        caption += (f" The axes reach {FENCE:g} interquartile ranges past the quartiles: {outside} of {len(xs)} "
                    "points lie outside them (double-click the plot to show them).")
    layout = plot_layout("mean α (nats)", "mean β (nats)", xaxis={"range": x_range}, yaxis={"range": y_range})
    every = [p for pts in alpha_beta_points(data).values() for p in pts]
    inside = inside_axes(every)
    held = [p for p in every if p in inside]
    rho = spearman([p[0] for p in held], [p[1] for p in held])
    if rho is not None:  # the count is of every arm's points inside the axes, which the hidden arms' share
        on_open = sum(p in inside for arm, pts in alpha_beta_points(data).items()
                      if arm_shown(arm, len(arms)) is True for p in pts)
        interval = spearman_interval(rho, len(held))
        text = f"Spearman ρ = {rho:+.2f}" + (f" [{interval[0]:+.2f}, {interval[1]:+.2f}]" if interval else "")
        text += f" over the {len(held)} points inside the axes" + (
            f", all arms ({on_open} shown on opening)" if on_open < len(held) else "")
        layout["annotations"] = [note(0.98, 0.98, text, xref="paper", yref="paper", showarrow=False,
                                      xanchor="right", yanchor="top")]
    title = ("Per step and run: mean α against mean β" if len(seeds) > 1 or len(arms) > 1
             else "Per step: mean α against mean β")
    return figure(traces, layout, title, caption, ("runs", used))
