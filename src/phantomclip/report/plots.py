"""What every figure of the article shares: the palette and the Plotly layout."""

from __future__ import annotations

PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"]
"""Okabe-Ito: distinguishable with the common colour-vision deficiencies."""


def plot_layout(title: str, x: str, y: str, **kw) -> dict:
    return {"title": {"text": title}, "xaxis": {"title": {"text": x}, **kw.pop("xaxis", {})},
            "yaxis": {"title": {"text": y}, **kw.pop("yaxis", {})}, "colorway": PALETTE, "margin": {"t": 50, "r": 20},
            "legend": {"orientation": "h", "y": -0.25}, "font": {"size": 14}, **kw}
