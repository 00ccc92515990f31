"""The article's "Your framework" panel: what the user's own RL framework would log for their last diagnose run
(`diagnose.text.framework_rows`: each framework's headline figure and every figure with a published bound, judged
against it) and the "for your config" knob advice (`diagnose.text.knob_lines`), as HTML, from the diagnose JSON
alone. The words are the terminal's, so the page and `phantomclip diagnose` cannot disagree.

With a verl run's file log among the inputs, the panel adds what that run logged (framework_log.py).

A diagnose JSON written before these keys existed (schema 1 files may lack `recipes.*.frameworks` and `knobs`) gets a
note saying how to produce them instead of an empty table.
"""

from __future__ import annotations

from ..answer.decide import measured_engine
from ..answer.verdict_text import fmt_figure
from ..diagnose.text import drift_lines, framework_rows, knob_lines
from .escape import html_text
from .framework_log import html_log_table

RERUN = "phantomclip diagnose --json diagnose.json"
"""the command that writes every key the panel reads."""


def html_framework_panel(diagnose: list[dict], verl_logs: list[dict] = ()) -> str | None:
    """The panel for the last diagnose JSON of `diagnose` and the last verl log of `verl_logs` (what the run logged,
    beside diagnose's figures: framework_log.py); None when there is neither (the page names the command)."""
    if not diagnose and not verl_logs:
        return None
    result = diagnose[-1] if diagnose else None
    parts = [framework_table_html(result), knob_list(result)] if result else []
    if result and "drift" in result:
        parts.append("<pre>" + html_text("\n".join(drift_lines(result["drift"]))) + "</pre>")
    if verl_logs:
        parts.append(html_log_table(verl_logs[-1], result))
    return "\n".join(parts)


def _older(what: str) -> str:
    return (f'<p class="note">This diagnose JSON has no {what}: it was written by an earlier phantomclip. Rerun '
            f"<code>{html_text(RERUN)}</code> with this version and pass the file to "
            "<code>phantomclip report --from</code>.</p>")


def framework_table_html(result: dict) -> str:
    """The framework table of the first trainer recipe (the user's), or the note for an older file."""
    first = next(iter(result["recipes"].values()), {})
    if "frameworks" not in first:
        return _older("framework figures")
    recipe = next(iter(result["recipes"]))
    rows = "".join(
        f"<tr><td>{html_text(fw)}</td><td><code>{html_text(figure)}</code></td><td>{fmt_figure(value)}</td>"
        f"<td>{html_text(threshold or '—')}</td><td>{_verdict_cell(verdict)}</td></tr>"
        for fw, figure, value, threshold, verdict in framework_rows(result))
    return (f"<p>What each framework would log for a <b>{html_text(recipe)}</b> trainer against the "
            f"{html_text(measured_engine(result))}, each by its own definition, beside the bound its "
            "project publishes (every figure: the JSON's <code>recipes." + html_text(recipe) + ".frameworks</code>)"
            ":</p><table><thead><tr><th>framework</th><th>figure</th><th>value</th><th>published threshold</th>"
            f"<th>verdict</th></tr></thead><tbody>{rows}</tbody></table>")


def _verdict_cell(verdict: str) -> str:
    return '<span class="verdict-zero">over</span>' if verdict == "over" else html_text(verdict)


def knob_list(result: dict) -> str:
    """The knob advice as a list, or the note for an older file."""
    if "knobs" not in result:
        return _older("knob advice")
    knobs = result["knobs"]
    items = "".join(f"<li>{html_text(line)}</li>" for line in knob_lines(knobs))
    return (f"<p><b>For your config</b> ({html_text(knobs['recipe'])} trainer's β; every figure: the JSON's "
            f"<code>knobs</code>):</p><ul>{items}</ul>")
