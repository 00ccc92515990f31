"""What every figure of the article shares: the palette, one colour per training arm, the Plotly layout, the
per-step lines with their seed bands, the text Plotly is given, and the figure record itself (`figure`).

Titles are not drawn by Plotly: the page puts each figure's short title in HTML above it (where it wraps instead of
being cut off), and its caption (what the lines, bands and markers are, the rules the figure follows) and source line
below it. Legends sit above the plot area, so they never cover an axis title.
"""

from __future__ import annotations

import html
import math

from ..base.files import printable

PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"]
"""Okabe-Ito: distinguishable with the common colour-vision deficiencies."""

ARM_COLOURS = {"none": "#000000", "force-r1": "#0072B2", "match-bf16": "#E69F00", "shadow-ratio": "#009E73",
               "no-clip": "#CC79A7", "fp16": "#D55E00", "fp32-head": "#56B4E9", "autocast": "#882255",
               "recompute-old": "#999933", "tis": "#332288", "mis": "#888888", "icepop": "#661100"}
"""one colour per intervention arm, the same in every figure: Okabe-Ito for the baseline (black) and the arms shown
when the page opens, then Paul Tol's muted colours for the rest, so no two arms share a colour."""
SPARE_COLOURS = ["#6699CC", "#117733", "#DDCC77", "#AA4499", "#44AA99"]
"""for arms this version does not know (a later intervention), in order of appearance."""
SEED_SYMBOLS = ["circle", "square", "diamond", "triangle-up", "x", "star", "cross", "triangle-down"]
"""seeds are told apart by marker, never by colour (colour is the arm)."""


FP8_COLOUR = "#AA4499"
"""the FP8 engine's arm ('fp8', `experiment fp8`); an FP8 arm with a correction ('fp8,tis') takes the correction's
colour: inside the FP8 section no two arms share one, and TIS is the same colour in both experiments' figures."""


def arm_colour(arm: str, arms: list[str]) -> str:
    """The arm's fixed colour; an unknown arm takes the next spare colour by its place among `arms`."""
    if arm in ARM_COLOURS:
        return ARM_COLOURS[arm]
    engine, _, correction = arm.partition(",")
    if engine.startswith("fp8") and (not correction or correction in ARM_COLOURS):
        return ARM_COLOURS[correction] if correction else FP8_COLOUR
    unknown = [a for a in arms if a not in ARM_COLOURS]
    return SPARE_COLOURS[unknown.index(arm) % len(SPARE_COLOURS)]


TITLE_WORDS = 15
"""a figure's title says what it shows in at most this many words; the rest goes in its caption."""


def figure(data: list[dict], layout: dict, title: str, caption: str, source: tuple, **kw) -> dict:
    """A figure record the page draws: Plotly's data and layout, the title above it (at most TITLE_WORDS words), the
    caption under it and `source` (the kind and the documents drawn from, which the page turns into the Data: line).
    Extra keys (`band_toggle`) ride along."""
    if len(title.split()) > TITLE_WORDS:
        raise ValueError(f"figure title of {len(title.split())} words (at most {TITLE_WORDS}): {title}")
    return {"data": data, "layout": layout, "title": title, "caption": caption, "source": source, **kw}


TEMPLATE_KEYS = ("hovertemplate", "texttemplate")
"""Plotly's template strings: ours alone (placeholders such as %{x} and our own <extra></extra>); data reaches the
hover through `text` or `customdata`, never inside a template, where a '%{...}' in a name would be substituted."""


def plotly_text(x):
    """`x` (a figure's data or layout) with every string but a template's made safe as Plotly text: Plotly renders a
    subset of HTML in trace names, hover text, tick labels and annotations (<b>, <br>, <span style=...>, <a>), so a
    name such as '<span style="font-size:60px">' would draw 60-px text in every legend. `&`, `<` and `>` become
    entities, which Plotly turns back into the characters after it has read the tags (svg_text_utils, convertEntities):
    the name is shown as typed. Lone surrogates are shown as \\xNN (files.printable)."""
    if isinstance(x, str):
        return html.escape(printable(x), quote=False)
    if isinstance(x, dict):
        return {k: (v if k in TEMPLATE_KEYS else plotly_text(v)) for k, v in x.items()}
    if isinstance(x, list):
        return [plotly_text(v) for v in x]
    return x


def step_axis(steps: list[int]) -> dict:
    """An x axis of training steps: ticks on whole steps only (Plotly put ticks at 1.5 and 2.5 on a 4-step run), every
    step up to 10 of them, else every 2, 5, 10, 20, 50 ... steps, whichever first gives at most 10 ticks."""
    span = max(steps, default=1) - min(steps, default=0)
    dtick = next(d for m in (1, 10, 100, 1000, 10**4, 10**5) for d in (m, 2 * m, 5 * m) if span / d <= 10)
    return {"tickmode": "linear", "tick0": 0, "dtick": dtick, "tickformat": "d"}


def note(x: float, y: float, text: str, xref: str = "x", yref: str = "y", **kw) -> dict:
    """A Plotly annotation: the figure's key point written on the plot, at (x, y) in data units (or 'paper'), with
    an arrow to the point unless `showarrow=False`."""
    return {"x": x, "y": y, "xref": xref, "yref": yref, "text": text, "showarrow": True, "arrowhead": 2,
            "arrowsize": 1, "arrowwidth": 1, "ax": -40, "ay": -30, "font": {"size": 12},
            "bgcolor": "rgba(255,255,255,0.8)", **kw}


def seed_symbol(i: int) -> str:
    return SEED_SYMBOLS[i % len(SEED_SYMBOLS)]


LOG_AXIS = {"type": "log", "dtick": 1, "exponentformat": "power"}
"""log axes label whole decades only: the 2 and 5 minor labels crowd each other on a short axis."""


SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def _power_text(v: float) -> str:
    """0.002 -> '2·10⁻³', 0.01 -> '10⁻²', 1 -> '1', 50 -> '50': the tick label of a log axis (1 to 999 as they
    are: '5·10¹' for 50 read as a puzzle)."""
    if 1 <= v < 1000:
        return f"{v:g}"
    exp = math.floor(math.log10(v) + 1e-9)
    mant = f"{v / 10**exp:.2g}"
    power = "1" if exp == 0 else "10" + str(exp).translate(SUPERSCRIPT)
    return power if mant == "1" else (mant if exp == 0 else f"{mant}·{power}")


def log_axis(values) -> dict:
    """A log axis labelled at least three times inside the data's range: whole decades when the data spans three
    or more, else 1, 2 and 5 of each decade, else every digit. Plotly's own decade-only labels leave a single label
    on data that spans less than a decade (the depth figure read '10⁻²' alone), so the dip of one layer
    could not be read. Zeros and negatives cannot sit on a log axis and are left out of the range."""
    pos = [v for v in values if isinstance(v, (int, float)) and v > 0 and math.isfinite(v)]
    if not pos:
        return dict(LOG_AXIS)
    lo, hi = min(pos), max(pos)
    e_lo, e_hi = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    axis: dict = {"type": "log", "tickmode": "array"}
    for mantissas in ((1,), (1, 2, 5), tuple(range(1, 10))):
        every = [float(f"{m * 10.0**e:.3g}") for e in range(e_lo, e_hi + 1) for m in mantissas]
        ticks = [v for v in every if lo / 1.05 <= v <= hi * 1.05]
        if len(ticks) >= 3:
            break
    else:  # data inside one step of the digits (0.011-0.019): the digits on either side and the half between
        below = max((v for v in every if v < lo), default=lo / 2)
        above = min((v for v in every if v > hi), default=hi * 2)
        ticks = sorted({below, float(f"{(below + above) / 2:.3g}"), above})
        axis["range"] = [math.log10(below) - 0.02, math.log10(above) + 0.02]
    return {**axis, "tickvals": ticks, "ticktext": [_power_text(v) for v in ticks]}


def category_axis(labels: list[str]) -> dict:
    """An axis of named places in the given order: labels such as '11' and 'logits' are names, and on an axis whose
    type Plotly guesses from mostly numeric labels the others are dropped ('embed', 'norm', 'logits' and
    'logprobs' of the depth figure were not drawn)."""
    return {"type": "category", "categoryorder": "array", "categoryarray": list(labels)}


def plot_layout(x: str, y: str, **kw) -> dict:
    """A figure's layout: axis titles that push the margins instead of overlapping the tick labels, and the legend
    in a row above the plot area."""
    xaxis = {"title": {"text": x}, "automargin": True, **kw.pop("xaxis", {})}
    yaxis = {"title": {"text": y}, "automargin": True, **kw.pop("yaxis", {})}
    return {"xaxis": xaxis, "yaxis": yaxis, "colorway": PALETTE, "margin": {"t": 10, "r": 20, "b": 50, "l": 60},
            "legend": {"orientation": "h", "x": 0, "xanchor": "left", "y": 1.02, "yanchor": "bottom",
                       "maxheight": 4000},  # px: never scrolls (layout.js grows the figure to keep the plot)
            "font": {"size": 14}, **kw}


def segments(values: list[list[float]]) -> list[list[int]]:
    """Runs of consecutive indices whose lists hold at least two values: the stretches where a band can be drawn.
    A step with fewer values ends a stretch, so a band never bridges a gap."""
    out: list[list[int]] = []
    for i, vs in enumerate(values):
        if len(vs) >= 2:
            if out and out[-1][-1] == i - 1:
                out[-1].append(i)
            else:
                out.append([i])
    return out


def seed_band(values: list[list[float]], scale: float, style: dict) -> list[dict]:
    """The min-max of the seeds' values at each step, as filled polygons (one per stretch where two or more seeds
    logged the step). Each seed's value is a measured value, so the band never leaves the quantity's range."""
    traces = []
    for seg in segments(values):
        x = [i + 1 for i in seg]
        lows = [scale * min(values[i]) for i in seg]
        highs = [scale * max(values[i]) for i in seg]
        traces.append({"type": "scatter", "x": x + x[::-1], "y": highs + lows[::-1], "fill": "toself",
                       "mode": "lines", "line": {"width": 0}, "opacity": 0.18, "hoverinfo": "skip",
                       "showlegend": False, **style})
    return traces


def mean_line(values: list[list[float]], scale: float, seeds: int, style: dict) -> dict:
    """The mean over the seeds that logged each step (a gap where none did); steps that fewer than `seeds` runs
    reached are drawn as open markers, and hover says how many seeds are in the mean."""
    y = [scale * sum(v) / len(v) if v else None for v in values]
    fewer = [bool(v) and len(v) < seeds for v in values]
    return {"type": "scatter", "mode": "lines+markers", "x": list(range(1, len(values) + 1)), "y": y,
            "marker": {"size": [7 if f else 0 for f in fewer], "symbol": "circle-open"},
            "customdata": [len(v) for v in values],
            "hovertemplate": f"step %{{x}}: %{{y:.4g}} (mean of %{{customdata}} of {seeds} seeds)", **style}
