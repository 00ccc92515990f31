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

from ..base.files import json_safe
from ..base.owned import write_owned, write_owned_bytes
from . import figures as diagnose_figures
from . import growth_panel, moe_panel
from .answer_panel import html_answer
from .escape import html_text, script_json
from .glossary import html_glossary
from .interventions_table import html_fp8_table, html_sanity_table
from .plots import PALETTE, plotly_text
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
    "fp8_training": (lambda d: per_step(d, "completion/length_mean", "Mean completion length per step, bf16 and "
                                        "emulated FP8 engines", "tokens", carry=True, runs=d.fp8_runs,
                                        shown=FP8_SHOWN_ARMS), FP8),
    "fp8_phantom_steps": (lambda d: per_step(d, "clip/phantom_rate", "Phantom-clipped tokens per step, bf16 and "
                                             "emulated FP8 engines", "% of tokens", runs=d.fp8_runs,
                                             shown=FP8_SHOWN_ARMS), FP8),
    "moe_flips": (moe_panel.fig_moe_flips, moe_panel.DIAGNOSE),
    "moe_training": (moe_panel.fig_moe_training, moe_panel.EXPERIMENT),
    "growth": (lambda d: growth_panel.fig_growth(d.growths), growth_panel.COMMAND),
    "growth_buckets": (lambda d: growth_panel.fig_growth_buckets(d.growths), growth_panel.COMMAND),
    "growth_split": (lambda d: growth_panel.fig_growth_split(d.growths), growth_panel.COMMAND),
    "postmortem": (lambda d: growth_panel.fig_postmortem(d.diagnose), growth_panel.POSTMORTEM_COMMAND),
    "growth_depth": (lambda d: growth_panel.fig_growth_depth(d.growths), growth_panel.COMMAND),
}
USER_ONLY = {"postmortem": "drawn from the reader's own recorded rollouts (diagnose --rollouts DIR): the bundled demo "
                           "holds no user's run"}
"""figures only the reader's own data can draw: without it the figure is left out, without a 'missing' box (its
lead-in names the command), and the demo page is complete without them."""
"""figure name -> (draws a figure from the data, or None when its data is missing; the command that makes the data)."""

WIDGETS = ("number_line", "crossing", "grpo_widget")
"""figures drawn in the browser by widgets.js (they need no data)."""


def _run_groups(data: ReportData) -> list[tuple[str, list[dict]]]:
    """The runs grouped by experiment and arm, in the order found: ('experiment sanity, arm none', its runs)."""
    groups: dict[str, list[dict]] = {}
    for r in data.runs + data.fp8_runs + data.moe_runs:
        arm = r.get("arm") or r["config"].get("intervention", r["name"])
        where = f"experiment {r['experiment']}, arm {arm}" if r.get("experiment") else f"run {r['name']}"
        groups.setdefault(where, []).append(r)
    return list(groups.items())


def _differs(runs: list[dict]) -> str:
    """' The other runs' configurations differ from it only in: seed.' (the keys whose values differ), or ''."""
    first = runs[0]["config"]
    keys = sorted({k for r in runs[1:] for k in set(first) | set(r["config"])
                   if k != "versions" and first.get(k) != r["config"].get(k)})
    return f" The other runs' configurations differ from it only in: {', '.join(keys)}." if keys else ""


def html_appendix(data: ReportData, copied: dict[Path, str], roots: list[Path]) -> str:
    """Every data file: its copy under data/ (or its path relative to --from), its configuration and versions; the
    runs of an arm as one item (a link per seed and file, the first seed's configuration and what the others
    change), where one item per run listed 66 runs with 132 folded boxes."""
    def link(path: Path, label: str | None = None) -> str:
        rel = copied.get(path)
        if rel is None:
            return html_text(short_path(str(path), roots))
        return f'<a href="{html_text(rel)}">{html_text(label or rel)}</a>'

    def boxes(cfg: dict, versions: dict, said: str = "") -> str:
        cfg = _no_absolute_paths(cfg, roots)
        return (f"<details><summary>configuration</summary>{html_text(said)}<pre>"
                f"{html_text(json.dumps(cfg, indent=1, default=str))}</pre></details>"
                + (f"<details><summary>versions</summary><pre>{html_text(json.dumps(versions, indent=1))}</pre>"
                   "</details>" if versions else ""))

    out = []
    for d in data.diagnose:
        out.append(f"<b>diagnose</b>: {link(Path(d['_path']))}{boxes(d.get('config', {}), d.get('versions', {}))}")
    for where, runs in _run_groups(data):
        files = "; ".join(
            f"{html_text(r['name'].rsplit('/', 1)[-1])}: " + ", ".join(
                link(Path(r["_path"]) / f, f.split(".")[0]) for f in ("metrics.jsonl", "config.json", "tokens.jsonl")
                if f != "tokens.jsonl" or r.get("tokens"))
            for r in runs)
        said = (f"The first run's ({runs[0]['name']})." + _differs(runs)) if len(runs) > 1 else ""
        out.append(f"<b>{html_text(where)}</b> ({len(runs)} run{'s' if len(runs) > 1 else ''}): {files}"
                   + boxes(runs[0]["config"], runs[0]["config"].get("versions", {}), said))
    for doc in data.sanity + data.fp8 + data.moe:
        out.append(f"<b>experiment {html_text(doc.get('experiment', 'sanity'))}</b>: {link(Path(doc['_path']))}"
                   + boxes(doc.get("base_config", {}), {}))
    out += [f"<b>trace</b>: {link(Path(t['_path']))}{boxes(t.get('config', {}), {})}" for t in data.traces]
    out += [f"<b>trace --run</b>: {link(Path(g['_path']))}"
            + boxes({"run": growth_panel.run_name(g), "model": g["model"]}, {}) for g in data.growths]
    if not out:
        return "<p>No data files were given.</p>"
    return "<ul>" + "".join(f"<li>{item}</li>" for item in out) + "</ul>"


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
    """The figure's HTML: its short title, the plot, the band button where it has one, its caption and its Data:
    line. Every string of its data and layout reaches Plotly as text (plots.plotly_text), never as markup."""
    kind, docs = fig.pop("source")
    title, caption = fig.pop("title"), fig.pop("caption", "")
    toggle = ('<button type="button" class="band-toggle" aria-pressed="false" onclick="bandToggle(this)" '
              f'data-figure="{name}">Show every arm\'s band</button>' if fig.pop("band_toggle", False) else "")
    every = fig.pop("caption_every_band", "")  # the caption once the button has drawn every band (bandToggle)
    swap = (f' data-few="{html_text(caption)}" data-every="{html_text(every)}"' if toggle and every != caption else "")
    figures[name] = _compact(json_safe(plotly_text(fig)))  # NaN/inf -> null: browsers' JSON has neither
    return (f'<figure class="chart"><div class="fig-title">{html_text(title)}</div>'
            f'<div class="figure" id="fig-{name}"></div>{toggle}'
            + (f'<p class="caption" id="caption-{name}"{swap}>{html_text(caption)}</p>' if caption else "")
            + f'<figcaption class="source">{html_text(source_line(kind, docs, roots))}</figcaption></figure>')


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
    brief = ctx.get("arms_table", False)  # the first table of arms carries the long note
    last = data.diagnose[-1:]
    moe = [d for d in [moe_panel.moe_diagnose(data)] if d]
    tables = {  # name -> (the table, its Data: line's kind and documents, the command that makes the data)
        "sanity_table": (lambda: html_sanity_table(data, brief), ("summary", [*data.sanity[-1:], *data.runs]), SANITY),
        "fp8_table": (lambda: html_fp8_table(data, brief), ("summary", [*data.fp8[-1:], *data.fp8_runs]), FP8),
        "moe_split": (lambda: moe_panel.html_route_split(data), ("diagnose", moe), moe_panel.DIAGNOSE),
        "moe_table": (lambda: moe_panel.html_moe_table(data, brief), ("summary", [*data.moe[-1:], *data.moe_runs]),
                      moe_panel.EXPERIMENT),
        "growth_table": (lambda: growth_panel.html_growth_table(data.growths), ("growths", data.growths),
                         growth_panel.COMMAND),
        "your_framework": (lambda: html_framework_panel(data.diagnose, data.verl_logs),
                           ("framework", [*last, *data.verl_logs[-1:]]) if data.verl_logs else ("diagnose", last),
                           "phantomclip diagnose --json diagnose.json")}
    if name in tables:
        draw, (kind, docs), command = tables[name]
        html = draw()
        ctx["arms_table"] = brief or (bool(html) and 'class="arms"' in html)
        if not html:
            return _missing(command)
        return html + f'<p class="source">{html_text(source_line(kind, docs, ctx["roots"]))}</p>'
    if name == "appendix":
        return html_appendix(data, ctx["copied"], ctx["roots"])
    if name == "summary":
        return html_summary(data.diagnose, data.sanity, data.fp8, moe_panel.summary_line(data))
    if name == "answer":
        return html_answer(data.diagnose, ctx["roots"])
    if name == "glossary":
        return html_glossary()
    if name == "sections_compared":
        return html_sections_compared(data.diagnose, data.sanity)
    if name in FIGURES:
        draw, command = FIGURES[name]
        fig = draw(data)
        if fig:
            return _figure_block(name, fig, figures, ctx["roots"])
        return "" if name in USER_ONLY else _missing(command)
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
        block = _block(name, data, figures, ctx)
        if block.startswith('<p class="missing"'):  # its lead-in ('How the share ... depends on ε:') would dangle
            body = re.sub(r"<p>(?:(?!<p>).)*?:</p>\s*(?=" + re.escape(marker) + ")", "", body, count=1, flags=re.S)
        body = body.replace(marker, block, 1)
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
    # the runs of another experiment than sanity say whose they are: an FP8 experiment's 'none' is not sanity's
    others = {Path(r["_path"]): f"{r['experiment']}-experiment" for r in data.fp8_runs + data.moe_runs}
    files = data.files()
    width = max(2, len(str(len(files) - 1)))  # '099' before '100': the copies list in the order they were found
    for i, f in enumerate(files):
        # a run of an experiment lives in OUT/<arm>/seed-<s>/: its arm is part of the name ('11-seed-0-metrics.jsonl'
        # said which seed but not of which arm); an FP8 experiment's runs say so too (its 'none' is not sanity's)
        folder = f.parent.name if not f.parent.name.startswith("seed-") else f"{f.parent.parent.name}-{f.parent.name}"
        folder = f"{others[f.parent]}-{folder}" if f.parent in others else folder
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
