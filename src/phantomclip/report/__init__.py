"""`phantomclip report`: an offline, self-contained HTML article whose figures are drawn from this tool's own
measurements (diagnose JSON, training run directories, `experiment sanity` summaries, trace JSON) and from what a verl
run logged from inside verl (its file log).

The prose lives in `article.md` (a writer edits it without touching Python); each `<!-- figure: NAME -->` marker is
replaced by the figure `FIGURES[NAME]` draws from the data, or by a note naming the command that produces the missing
data. Plotly rather than Vega-Lite: a browser bundle of it ships with this package (inlined, so the page needs no
network), and its legend toggles and hover give the interactions the article needs without a second grammar to learn.

Modules, by concept: `sources` reads and classifies the files; `figures` draws the diagnose and trace figures,
`training_panel` the closed loop, `growth_panel` the gap along training, `interventions_table` the arms' table,
`framework_panel` "Your framework" (with `framework_log`, what a verl run logged); `summary` writes the words that
come from the data (the summary at the top, the source line under each figure); `plots` holds the shared look; `page`
assembles and writes the page.

May import: base, precision, maths, models, runs, answer, training, diagnose.
"""

from __future__ import annotations

from .page import FIGURES, USER_ONLY, WIDGETS, build, render
from .sources import ReportData, ReportError, collect, demo_sources

__all__ = ["FIGURES", "USER_ONLY", "WIDGETS", "ReportData", "ReportError", "build", "collect", "demo_sources", "render"]
