"""The one way data enters the page: as HTML text (`html_text`) or as JSON inside a <script> block (`script_json`).

Every string the page shows came from a file someone else may have written (a run directory's name, a config's
intervention, a diagnose recipe name, an arm name): the page must show it, never run it. The two contexts differ:

- HTML text and attribute values: `&`, `<`, `>`, `"` and `'` become entities (html.escape), so no tag, comment or
  attribute can start or end inside the data.
- A <script> block is not parsed as HTML text: entities are not decoded there, and the HTML tokenizer ends the block
  at the first `</script` and enters its "escaped" states at `<!--` (HTML Living Standard, 13.2.5.4-13.2.5.26,
  script data states), before JavaScript sees anything. So the JSON escapes `<`, `>` and `&` as \\u003c, \\u003e and
  \\u0026 (equal strings to JSON.parse and to a JavaScript literal, and no `<` is left for the tokenizer to see), and
  writes every other non-ASCII character as \\uXXXX (ensure_ascii): U+2028 and U+2029, which older JavaScript
  parsers read as line ends inside a string literal, and lone surrogates, which have no UTF-8 form, round-trip as
  the escapes JSON defines for them.

Lone surrogates in HTML text (a file name that is not UTF-8, held by Python as U+DC80-U+DCFF) are shown as \\xNN
(files.printable): the page is written as UTF-8, which cannot encode them.
"""

from __future__ import annotations

import html
import json

from ..base.files import printable

SCRIPT_ESCAPES = {ord("<"): "\\u003c", ord(">"): "\\u003e", ord("&"): "\\u0026"}
"""characters the HTML tokenizer acts on inside a <script> block, as the JSON escapes that mean the same string."""


def html_text(x) -> str:
    """`x` (any value, shown as str(x)) as HTML text, safe in an element's content and in a quoted attribute."""
    return html.escape(printable(str(x)), quote=True)


def script_json(x) -> str:
    """`x` as strict JSON (no NaN or inf: json_safe them first) that can sit inside a <script> block unchanged:
    JSON.parse and a JavaScript literal read back exactly `x`, and the block holds no `<`, `>`, `&` nor any
    non-ASCII character."""
    text = json.dumps(x, allow_nan=False, separators=(",", ":"), ensure_ascii=True)
    return text.translate(SCRIPT_ESCAPES)
