"""The page: article.md's prose with each `<!-- figure: NAME -->` marker replaced by its figure (a title above, the
Plotly div, the source line below), its table, or a note naming the command that makes the missing data; the summary
at the top; one template; Plotly's cartesian bundle inlined.

The bundle is plotly.js-cartesian-dist-min 4.1.1 from npm (the plotly.js version the plotly Python package ships),
kept byte for byte in plotly-cartesian.min.js beside this file, with its MIT licence in plotly-LICENSE.md, which
the page carries in a comment. It holds the trace types the article uses (scatter, bar, histogram) and none of the
map, 3-D and WebGL code of the full bundle: 1.5 MB instead of 4.8 MB.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from ..files import json_safe
from ..owned import write_owned, write_owned_bytes
from . import figures as diagnose_figures
from . import growth_panel
from .answer_panel import html_answer
from .escape import html_text, script_json
from .glossary import html_glossary
from .interventions_table import html_fp8_table, html_sanity_table
from .plots import PALETTE
from .prose import TEXTS
from .sources import ReportData, ReportError, collect
from .summary import html_sections_compared, html_summary, machine, short_path, source_line
from .training_panel import FP8_SHOWN_ARMS, fig_alpha_beta_steps, per_step

SANITY = "phantomclip experiment sanity --out runs/sanity"
FP8 = "phantomclip experiment fp8 --seeds 3 --out runs/fp8"
FIGURES: dict[str, tuple[Callable[[ReportData], dict | None], str]] = {
    "spacing": (diagnose_figures.fig_spacing, ""),
    "beta_by_prob": (diagnose_figures.fig_beta_by_prob, "phantomclip diagnose --json diagnose.json"),
    "trace_depth": (diagnose_figures.fig_trace_depth, "phantomclip trace --json trace.json"),
    "beta_hist": (diagnose_figures.fig_beta_hist, "phantomclip diagnose --json diagnose.json"),
    "outside_vs_eps": (diagnose_figures.fig_outside_vs_eps, "phantomclip diagnose --json diagnose.json"),
    "beta_split": (diagnose_figures.fig_beta_split, "phantomclip diagnose --engine vllm --json diagnose-vllm.json"),
    "alpha_beta_tokens": (diagnose_figures.fig_alpha_beta_tokens, "phantomclip train --out runs/baseline"),
    "alpha_beta_steps": (fig_alpha_beta_steps, "phantomclip train --out runs/baseline"),
    "training": (lambda d: per_step(d, "completion/length_mean", "Mean completion length per step", "tokens",
                                    carry=True), SANITY),
    "phantom_steps": (lambda d: per_step(d, "clip/phantom_rate", "Phantom-clipped tokens per step", "% of tokens"),
                      SANITY),
    "beta_steps": (lambda d: per_step(d, "mismatch/beta_abs_mean", "Mean |β| per step", "mean |β| (nats)"), SANITY),
    "fp8_training": (lambda d: per_step(d, "completion/length_mean", "Mean completion length per step, bf16 and FP8 "
                                        "engines", "tokens", carry=True, runs=d.fp8_runs, shown=FP8_SHOWN_ARMS), FP8),
    "fp8_phantom_steps": (lambda d: per_step(d, "clip/phantom_rate", "Phantom-clipped tokens per step, bf16 and FP8 "
                                             "engines", "% of tokens", runs=d.fp8_runs, shown=FP8_SHOWN_ARMS), FP8),
    "growth": (lambda d: growth_panel.fig_growth(d.growths), growth_panel.COMMAND),
    "growth_buckets": (lambda d: growth_panel.fig_growth_buckets(d.growths), growth_panel.COMMAND),
    "growth_split": (lambda d: growth_panel.fig_growth_split(d.growths), growth_panel.COMMAND),
    "growth_depth": (lambda d: growth_panel.fig_growth_depth(d.growths), growth_panel.COMMAND),
}
"""figure name -> (draws a figure from the data, or None when its data is missing; the command that makes the data)."""

WIDGETS = ("number_line", "crossing", "grpo_widget")
"""figures drawn in the browser by widgets.js (they need no data)."""


def html_appendix(data: ReportData, copied: dict[Path, str], roots: list[Path]) -> str:
    """Every data file: its copy under data/ (or its path relative to --from), its configuration and versions."""
    items = [("diagnose", d["_path"], d.get("config", {}), d.get("versions", {})) for d in data.diagnose]
    items += [(f"run {r['name']}", r["_path"], r["config"], r["config"].get("versions", {})) for r in data.runs]
    items += [(f"run {r['name']} (experiment fp8)", r["_path"], r["config"], r["config"].get("versions", {}))
              for r in data.fp8_runs]
    items += [(f"experiment {s.get('experiment', 'sanity')}", s["_path"], s.get("base_config", {}), {})
              for s in data.sanity + data.fp8]
    items += [("trace", t["_path"], t.get("config", {}), {}) for t in data.traces]
    items += [("trace --run", g["_path"], {"run": growth_panel.run_name(g), "model": g["model"]}, {})
              for g in data.growths]
    if not items:
        return "<p>No data files were given.</p>"
    out = "<ul>"
    for kind, path, cfg, versions in items:
        cfg = _no_absolute_paths(cfg, roots)
        link = copied.get(Path(path))
        shown = link or short_path(path, roots)
        name = f'<a href="{html_text(link)}">{html_text(link)}</a>' if link else html_text(shown)
        out += (f"<li><b>{html_text(kind)}</b>: {name}<details><summary>configuration</summary><pre>"
                f"{html_text(json.dumps(cfg, indent=1, default=str))}</pre></details>"
                + (f"<details><summary>versions</summary><pre>{html_text(json.dumps(versions, indent=1))}</pre>"
                   "</details>" if versions else "")
                + "</li>")
    return out + "</ul>"


def _no_absolute_paths(x, roots: list[Path]):
    """A configuration with every absolute path in it shortened (summary.short_path): the page may be shared, and
    this machine's directory layout is none of its readers' business."""
    if isinstance(x, str) and (x.startswith("/") or re.match(r"[A-Za-z]:[\\/]", x)):
        return short_path(x, roots)
    if isinstance(x, dict):
        return {k: _no_absolute_paths(v, roots) for k, v in x.items()}
    if isinstance(x, list):
        return [_no_absolute_paths(v, roots) for v in x]
    return x


def _figure_block(name: str, fig: dict, figures: dict, roots: list[Path]) -> str:
    kind, docs = fig.pop("source")
    title = fig.pop("title")
    toggle = ('<button type="button" class="band-toggle" aria-pressed="false" onclick="bandToggle(this)" '
              f'data-figure="{name}">Show every arm\'s band</button>' if fig.pop("band_toggle", False) else "")
    figures[name] = _compact(json_safe(fig))  # NaN/inf -> null: browsers' JSON has neither
    return (f'<figure class="chart"><div class="fig-title">{html_text(title)}</div>'
            f'<div class="figure" id="fig-{name}"></div>{toggle}'
            f'<figcaption class="source">{html_text(source_line(kind, docs, roots))}</figcaption></figure>')


def _compact(x):
    """Floats to 6 significant digits: far below what a figure can show, and a third of the page's data bytes."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _compact(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_compact(v) for v in x]
    return x


def _missing(command: str) -> str:
    return (f'<p class="missing" data-command="{html_text(command)}">No data for this figure yet. Run '
            f'<code>{html_text(command)}</code> and pass its output to <code>phantomclip report --from</code>.</p>')


MISSING = re.compile(r'<p class="missing" data-command="([^"]*)">.*?</p>', re.S)


def _one_note_per_section(body: str) -> str:
    """Where a section (from one <h2> to the next) has several figures without data, one note in place of the
    first, counting the figures and naming each command once; the others are dropped (section 6 showed
    the same box five times). The commands are ours (FIGURES, SANITY), already escaped in the attribute."""
    parts = re.split(r"(?=<h2>)", body)
    for i, part in enumerate(parts):
        commands = MISSING.findall(part)
        if len(commands) < 2:
            continue
        counts = {c: commands.count(c) for c in dict.fromkeys(commands)}
        runs = " and ".join(f"<code>{c}</code>" + (f" ({n} figure{'s' if n > 1 else ''})" if len(counts) > 1 else "")
                            for c, n in counts.items())
        note = (f'<p class="missing" data-command="{"; ".join(counts)}">No data for the {len(commands)} figures of '
                f"this section yet. Run {runs} and pass the output to <code>phantomclip report --from</code>.</p>")
        first = [True]

        def keep_first(_m, first=first) -> str:
            out, first[0] = (note if first[0] else ""), False
            return out

        parts[i] = MISSING.sub(keep_first, part)
    return "".join(parts)


UNRECORDED = "; machine not recorded."


def _machine_once(body: str, data: ReportData, roots: list[Path]) -> str:
    """Where files lack the record of their machine (trace and trace --run files written before they kept one), the
    first source line saying so names those files and says new ones record it; the later lines drop the words (the
    demo's five figures of traces and growths repeated 'machine not recorded')."""
    if UNRECORDED not in body:
        return body
    docs = [d for d in [*data.diagnose, *data.traces, *data.growths] if machine(d) == "machine not recorded"]
    folders: dict[str, list[str]] = {}
    for d in docs:
        f = short_path(d["_path"], roots)
        folders.setdefault(str(Path(f).parent), []).append(f)
    named = " and ".join(f"{len(fs)} files in {folder}/" if len(fs) > 3 else ", ".join(fs)
                         for folder, fs in folders.items())
    note = (f"; machine not recorded (by {html_text(named) or 'these files'}, written before phantomclip kept that "
            "record: trace and trace --run files written now keep it).")
    first, *rest = body.split(UNRECORDED)
    return first + note + ".".join(rest)


def _block(name: str, data: ReportData, figures: dict, ctx: dict) -> str:
    """The HTML that replaces the marker of `name`."""
    from .framework_panel import html_framework_panel

    if name in WIDGETS:
        return f'<div class="widget" id="{name}"></div>'
    tables = {"sanity_table": (lambda: html_sanity_table(data), SANITY),
              "fp8_table": (lambda: html_fp8_table(data), FP8),
              "growth_table": (lambda: growth_panel.html_growth_table(data.growths), growth_panel.COMMAND),
              "your_framework": (lambda: html_framework_panel(data.diagnose),
                                 "phantomclip diagnose --json diagnose.json")}
    if name in tables:
        draw, command = tables[name]
        return draw() or _missing(command)
    if name == "appendix":
        return html_appendix(data, ctx["copied"], ctx["roots"])
    if name == "summary":
        return html_summary(data.diagnose, data.sanity, data.fp8)
    if name == "answer":
        return html_answer(data.diagnose, ctx["roots"])
    if name == "glossary":
        return html_glossary()
    if name == "sections_compared":
        return html_sections_compared(data.diagnose, data.sanity)
    if name in FIGURES:
        draw, command = FIGURES[name]
        fig = draw(data)
        return _figure_block(name, fig, figures, ctx["roots"]) if fig else _missing(command)
    return f'<p class="missing">Unknown figure {html_text(name)} in article.md.</p>'


def _text(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def render(data: ReportData, copied: dict[Path, str] | None = None, roots: list[Path] | None = None) -> str:
    """The whole page as one HTML string. `roots`: the --from paths, to name files relative to them."""
    from jinja2 import Environment
    from markdown_it import MarkdownIt

    ctx = {"copied": copied or {}, "roots": [Path(r).resolve() for r in roots or []]}
    # Markdown's raw HTML and the template's unescaped variables are safe: article.md and the template are ours, and
    # every piece of data in the blocks below went through escape.html_text or escape.script_json.
    body = MarkdownIt("commonmark", {"html": True}).render(_text("article.md"))
    figures: dict[str, dict] = {}
    for marker in re.findall(r"<!-- figure: [a-z0-9_]+ -->", body):
        name = marker[len("<!-- figure: ") : -len(" -->")]
        body = body.replace(marker, _block(name, data, figures, ctx), 1)
    for marker in re.findall(r"<!-- text: [a-z0-9_]+ -->", body):  # sentences computed from the data (prose.py)
        name = marker[len("<!-- text: ") : -len(" -->")]
        text = TEXTS[name](data) if name in TEXTS else f"(unknown text {name} in article.md)"
        body = body.replace(marker, html_text(text), 1)
    body = _one_note_per_section(body)
    body = _machine_once(body, data, ctx["roots"])
    template = Environment(autoescape=False).from_string(_text("template.html.j2"))
    return template.render(body=body, plotly_js=_text("plotly-cartesian.min.js"),
                           plotly_licence=_text("plotly-LICENSE.md").replace("*/", "* /"),
                           figures=script_json(figures), widgets_js=_text("widgets.js"),
                           layout_js=_text("layout.js"), palette=script_json(PALETTE))


def _safe_name(name: str) -> str:
    """A directory's name as a copy's file name and link: letters, digits, `.`, `_` and `-` kept, anything else
    (`<`, a quote, a byte that is not UTF-8) one `_`, so a link needs no escaping to reach its file."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def _copy_data(data: ReportData, out: Path) -> dict[Path, str]:
    copied: dict[Path, str] = {}
    fp8_runs = {Path(r["_path"]) for r in data.fp8_runs}
    files = data.files()
    width = max(2, len(str(len(files) - 1)))  # '099' before '100': the copies list in the order they were found
    for i, f in enumerate(files):
        # a run of an experiment lives in OUT/<arm>/seed-<s>/: its arm is part of the name ('11-seed-0-metrics.jsonl'
        # said which seed but not of which arm); an FP8 experiment's runs say so too (its 'none' is not sanity's)
        folder = f.parent.name if not f.parent.name.startswith("seed-") else f"{f.parent.parent.name}-{f.parent.name}"
        folder = f"fp8-experiment-{folder}" if f.parent in fp8_runs else folder
        rel = f"data/{i:0{width}d}-{_safe_name(folder)}-{f.name}"
        write_owned(out, out / rel, lambda tmp, f=f: shutil.copyfile(f, tmp))  # no link at out/data nor below
        copied[f] = rel
        if f.name == "metrics.jsonl":
            copied[f.parent] = rel
    return copied


def build(sources: list[str | Path], out: str | Path) -> Path:
    """Write out/index.html and copy the data files to out/data/; returns the page's path."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {out} is a file: give a directory")
    data = collect(sources, skip=out)
    roots = [Path(s) if Path(s).is_dir() else Path(s).parent for s in sources]
    try:
        copied = _copy_data(data, out)
        page = out / "index.html"
        try:
            body = render(data, copied, roots)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:  # a file damaged below its top level
            raise ReportError(f"cannot draw the report from {', '.join(map(str, sources))} ({type(e).__name__}: "
                              f"{str(e)[:80]}): a file there was edited or is not one phantomclip wrote") from None
        write_owned_bytes(out, page, body.encode("utf-8"))
    except OSError as e:
        raise ReportError(f"--out {out}: cannot write the report ({e.strerror or e})") from None
    return page
