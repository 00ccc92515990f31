"""What a verl run logged, drawn in the article's "Your framework" panel beside diagnose's figures.

The log is read by runs/framework_log.py (verl's file tracker, `trainer.logger=['console','file']`, one JSON object
per step; `sources.collect` reads it wherever a .jsonl is found), which keeps phantomclip's
own figures logged from inside verl (`phantomclip/*`, docs/verl.md "Figures") and verl's mismatch diagnostics
(`rollout_corr/*`), of which diagnose computes several for the same definitions (maths/frameworks.py `verl`), so the
panel can put what the run logged beside what diagnose measured before training.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..runs.framework_log import figure_series, finite_median
from .escape import html_text


def _fmt(x: float | None) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:.4g}"


def html_log_table(log: dict, diagnose: dict | None) -> str:
    """The run's logged figures: each kept key's median over the steps that logged it and its last value, beside
    diagnose's value where diagnose computes the same figure for verl (its first trainer recipe's
    `frameworks.verl`). A log without any kept key says how to produce one."""
    steps = log["steps"]
    if not steps:
        return (f"<p class=\"note\">{html_text(Path(log['_path']).name)} holds no phantomclip/* or rollout_corr/* "
                "figure: run verl with VERL_USE_EXTERNAL_MODULES=phantomclip.integrations.verl and a "
                "rollout_correction block (docs/verl.md).</p>")
    predicted = {}
    if diagnose is not None:
        predicted = next(iter(diagnose["recipes"].values())).get("frameworks", {}).get("verl", {})
    series = {k: [v for _, v in pairs] for k, pairs in figure_series(log).items()}  # each key's steps, in order
    rows = "".join(f"<tr><td><code>{html_text(k)}</code></td><td>{_fmt(finite_median(v))}</td><td>{_fmt(v[-1])}</td>"
                   f"<td>{_fmt(predicted.get(k))}</td></tr>" for k, v in series.items())
    return (f"<p>What your verl run logged ({len(steps)} steps, from {html_text(Path(log['_path']).name)}; every "
            "figure: docs/verl.md), beside diagnose's value for the same definition where it computes one:</p>"
            "<table><thead><tr><th>figure</th><th>median over steps</th><th>last step</th><th>diagnose</th></tr>"
            f"</thead><tbody>{rows}</tbody></table>")
