"""What every figure of the article shares: the palette, one colour per training arm, the Plotly layout, and the
per-step lines with their seed bands.

Titles are not drawn by Plotly: the page puts each figure's title in HTML above it (where it wraps instead of being
cut off) and its source line below it. Legends sit above the plot area, so they never cover an axis title.
"""

from __future__ import annotations

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


def arm_colour(arm: str, arms: list[str]) -> str:
    """The arm's fixed colour; an unknown arm takes the next spare colour by its place among `arms`."""
    if arm in ARM_COLOURS:
        return ARM_COLOURS[arm]
    unknown = [a for a in arms if a not in ARM_COLOURS]
    return SPARE_COLOURS[unknown.index(arm) % len(SPARE_COLOURS)]


def seed_symbol(i: int) -> str:
    return SEED_SYMBOLS[i % len(SEED_SYMBOLS)]


LOG_AXIS = {"type": "log", "dtick": 1, "exponentformat": "power"}
"""log axes label whole decades only: the 2 and 5 minor labels crowd each other on a short axis."""


def plot_layout(x: str, y: str, **kw) -> dict:
    """A figure's layout: axis titles that push the margins instead of overlapping the tick labels, and the legend
    in a row above the plot area."""
    xaxis = {"title": {"text": x}, "automargin": True, **kw.pop("xaxis", {})}
    yaxis = {"title": {"text": y}, "automargin": True, **kw.pop("yaxis", {})}
    return {"xaxis": xaxis, "yaxis": yaxis, "colorway": PALETTE, "margin": {"t": 10, "r": 20, "b": 50, "l": 60},
            "legend": {"orientation": "h", "x": 0, "xanchor": "left", "y": 1.02, "yanchor": "bottom"},
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
