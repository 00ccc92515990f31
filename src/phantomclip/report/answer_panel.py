"""The answer `phantomclip diagnose` gives first (answer/decide.py's JSON block `answer`), near the top of the article:
the status with its reasons, the contract that was measured, and each change as the user's framework spells it with
what this run measured for it. Drawn from the block alone, with the terminal's words (answer.answer_lines says the
same), so the page and the terminal cannot disagree; a diagnose JSON written before the block existed draws nothing.
"""

from __future__ import annotations

from ..answer.changes import CONFIG_NAMES
from .escape import html_text
from .summary import short_path

STATUS_CLASS = {"ok": "verdict-ok", "at risk": "verdict-zero", "will stall": "verdict-zero"}
"""the colour of each status word ('not judged' stays plain)."""


def html_answer(diagnose: list[dict], roots) -> str:
    """The answer of the last diagnose JSON (the one sections 3 and 4 draw), or '' when it holds none (the block is
    optional: older files and other kinds of data draw the article without it; another file's answer would be about
    another run than the page's)."""
    result = diagnose[-1] if diagnose else None
    if result is None or not isinstance(result.get("answer"), dict):
        return ""
    ans = result["answer"]
    c = ans["contract"]
    status = str(ans["status"])
    reasons = [html_text(r) for r in ans.get("reasons", [])]
    out = (f'<section class="answer" id="answer"><h2>Your run: <span class="{STATUS_CLASS.get(status, "")}">'
           f"{html_text(status.upper())}</span></h2>"
           f"<p>{reasons[0] if reasons else ''}</p>"
           + ("<ul>" + "".join(f"<li>{r}</li>" for r in reasons[1:]) + "</ul>" if len(reasons) > 1 else "")
           + f"<p>Measured by <code>phantomclip diagnose</code> ({html_text(short_path(result['_path'], roots))}): "
           f"a {html_text(c['trainer'])} trainer against a "
           f"{html_text(c.get('engine_label') or c['engine_dtype'] + ' ' + c['engine'] + ' engine')}, "
           f"ε {c['epsilon_low']:g}/{c['epsilon_high']:g}.</p>")
    changes = ans.get("changes") or []
    if changes:
        config = ans.get("config") or {"trl": "GRPOConfig", "verl": "verl"}.get(ans.get("framework", ""), "phantomclip")
        out += (f"<p>What to change ({html_text(CONFIG_NAMES.get(config, config))}), fewest tokens touched first:</p>"
                "<table><thead><tr><th>setting, as pasted</th><th>what this run measured for it</th></tr></thead>"
                "<tbody>"
                + "".join(f"<tr><td><pre><code>{html_text(ch['setting'])}</code></pre></td>"
                          f"<td>{html_text(ch['effect'])}</td></tr>" for ch in changes)
                + "</tbody></table>")
    return out + "</section>"
