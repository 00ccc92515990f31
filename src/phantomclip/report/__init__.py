"""`phantomclip report`: an offline, self-contained HTML article whose figures are drawn from this tool's own
measurements (diagnose JSON, training run directories, `experiment sanity` summaries, trace JSON).

The prose lives in `article.md` (a writer edits it without touching Python); each `<!-- figure: NAME -->`
marker is replaced by the figure `FIGURES[NAME]` draws from the data, or by a note naming the command that
produces the missing data. Plotly's JavaScript is inlined from the plotly package, so the page needs no network.
Plotly rather than Vega-Lite: its Python package ships the browser bundle we inline, and its legend toggles and
hover give the interactions the article needs without a second grammar to learn.
"""

from __future__ import annotations

import html
import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .. import DIAGNOSE_SCHEMA, SCHEMA_VERSION
from ..errors import PhantomclipError
from ..files import json_safe
from ..runs import read_jsonl
from . import growth_panel
from .plots import PALETTE, plot_layout


class ReportError(PhantomclipError):
    """Unreadable sources or an output path that cannot be written."""


@dataclass
class ReportData:
    """Everything the page can draw, gathered from files; each item keeps the path it came from."""

    diagnose: list[dict] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)
    sanity: list[dict] = field(default_factory=list)
    traces: list[dict] = field(default_factory=list)
    growths: list[dict] = field(default_factory=list)
    """`trace --run` results: β along a training run, per snapshot."""

    def files(self) -> list[Path]:
        out = [Path(d["_path"]) for d in self.diagnose + self.sanity + self.traces + self.growths]
        for r in self.runs:
            out += [Path(r["_path"]) / "config.json", Path(r["_path"]) / "metrics.jsonl"]
        return out


DOC_SHAPES = {"diagnose": {"recipes": dict, "tokens": dict}, "sanity": {"runs": list, "arms": list},
              "traces": {"sites": list, "first_order": dict}, "growths": {"snapshots": list, "prob_edges": list}}
"""what each kind of JSON file holds at its top level (the keys that tell the kinds apart, with their types)."""


def _check_shape(path: Path, doc: dict, shape: dict[str, type]) -> None:
    for key, kind in shape.items():
        if not isinstance(doc[key], kind):
            raise ReportError(f"{path}: \"{key}\" holds a {type(doc[key]).__name__}, not a {kind.__name__}: the file "
                              "was edited or is not one phantomclip wrote")


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def collect(sources: list[str | Path]) -> ReportData:
    """Classify every JSON file and run directory under `sources` (files or directories)."""
    data = ReportData()
    seen: set[Path] = set()
    for src in map(Path, sources):
        if not src.exists():
            raise ReportError(f"--from {src}: no such file or directory")
        files = [src] if src.is_file() else sorted(src.rglob("*.json"))
        for f in files:
            f = f.resolve()
            if f in seen:
                continue
            seen.add(f)
            doc = _read_json(f)
            if doc is None:
                continue
            kind = next((k for k, shape in DOC_SHAPES.items() if all(key in doc for key in shape)), None)
            newest = DIAGNOSE_SCHEMA if kind == "diagnose" else SCHEMA_VERSION  # diagnose's file has its own number
            schema = doc.get("schema", SCHEMA_VERSION)
            if not isinstance(schema, int) or isinstance(schema, bool):
                raise ReportError(f"{f}: \"schema\" is {schema!r}, not a whole number: the file was edited or is not "
                                  "one phantomclip wrote")
            if schema > newest:
                raise ReportError(f"{f}: written with data schema {doc['schema']}, newer than this phantomclip reads "
                                  f"({newest}): upgrade phantomclip")
            doc["_path"] = str(f)
            if f.name == "config.json" and (f.parent / "metrics.jsonl").exists():
                name = f"{f.parent.parent.name}/{f.parent.name}" if f.parent.name.startswith("seed-") else f.parent.name
                data.runs.append({"_path": str(f.parent), "name": name, "config": doc,
                                  "metrics": read_jsonl(f.parent / "metrics.jsonl"),
                                  "tokens": read_jsonl(f.parent / "tokens.jsonl")})
            elif kind is not None:
                _check_shape(f, doc, DOC_SHAPES[kind])
                getattr(data, kind).append(doc)
    if not (data.diagnose or data.runs or data.sanity or data.traces or data.growths):
        raise ReportError(f"--from {' '.join(map(str, sources))}: found no diagnose JSON, trace JSON, run directory or "
                          "experiment directory; give the files that diagnose --json, trace --json, train --out or "
                          "experiment --out wrote")
    return data


# ---------------------------------------------------------------------------------------------- figures


def fig_spacing(data: ReportData) -> dict:
    import torch

    from ..numerics import ulp

    x = torch.logspace(-6, 4, 200, dtype=torch.float64)
    traces = [{"type": "scatter", "mode": "lines", "name": name, "x": x.tolist(),
               "y": ulp(x.float(), dt).double().tolist()}
              for name, dt in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16))]
    return {"data": traces, "layout": plot_layout("Spacing between neighbouring numbers (ulp)", "|x|", "spacing",
                                                  xaxis={"type": "log"}, yaxis={"type": "log"})}


def _beta_arrays(diag: dict) -> dict[str, list[float]]:
    return {name: [b for b in arr["beta"] if b is not None] for name, arr in diag["tokens"]["per_recipe"].items()}


def fig_beta_by_prob(data: ReportData) -> dict | None:
    if not data.diagnose:
        return None
    diag = data.diagnose[-1]
    logp_engine = diag["tokens"]["logp_engine"]
    edges = [-math.inf, math.log(1e-4), math.log(1e-3), math.log(1e-2), math.log(0.1), math.log(0.5), math.log(0.9),
             0.01]
    labels = ["<1e-4", "1e-4–1e-3", "1e-3–0.01", "0.01–0.1", "0.1–0.5", "0.5–0.9", ">0.9"]
    traces = []
    for name, arr in diag["tokens"]["per_recipe"].items():
        sums, counts = [0.0] * len(labels), [0] * len(labels)
        for lp, b in zip(logp_engine, arr["beta"]):
            if lp is None or b is None:
                continue
            i = next(i for i in range(len(labels)) if edges[i] <= lp < edges[i + 1])
            sums[i] += abs(b)
            counts[i] += 1
        traces.append({"type": "scatter", "mode": "lines+markers", "name": name, "x": labels,
                       "y": [s / c if c else None for s, c in zip(sums, counts)],
                       "text": [f"{c} tokens" for c in counts], "hovertemplate": "%{x}: mean |β| %{y:.4f} (%{text})"})
    return {"data": traces, "layout": plot_layout("Mean |β| by the engine's probability of the sampled token",
                                                  "engine probability of the token", "mean |β| (nats)",
                                                  yaxis={"type": "log"})}


def fig_beta_hist(data: ReportData) -> dict | None:
    if not data.diagnose:
        return None
    diag = data.diagnose[-1]
    tr = diag["trust_region"]
    traces = [{"type": "histogram", "name": name, "x": betas, "nbinsx": 120, "opacity": 0.6,
               "visible": True if i == 0 else "legendonly"}
              for i, (name, betas) in enumerate(_beta_arrays(diag).items())]
    layout = plot_layout(f"β = logp − logp_engine per token (α = 0), trust region for ε = {tr['epsilon_low']:g} shaded",
                         "β (nats)", "tokens", barmode="overlay", yaxis={"type": "log"})
    layout["shapes"] = [{"type": "rect", "xref": "x", "yref": "paper", "x0": tr["log_low"], "x1": tr["log_high"],
                         "y0": 0, "y1": 1, "fillcolor": "#009E73", "opacity": 0.12, "line": {"width": 0}}]
    return {"data": traces, "layout": layout}


def fig_outside_vs_eps(data: ReportData) -> dict | None:
    if not data.diagnose:
        return None
    eps_grid = [0.01 * i for i in range(1, 41)]
    traces = []
    for name, betas in _beta_arrays(data.diagnose[-1]).items():
        n = max(len(betas), 1)
        ys = [sum(1 for b in betas if b < math.log1p(-e) or b > math.log1p(e)) / n * 100 for e in eps_grid]
        traces.append({"type": "scatter", "mode": "lines", "name": name, "x": eps_grid, "y": ys})
    return {"data": traces, "layout": plot_layout("Share of tokens whose β alone leaves [1 − ε, 1 + ε]", "ε",
                                                  "% of tokens", yaxis={"type": "log"})}


def fig_beta_split(data: ReportData) -> dict | None:
    """Mean |β| of each recipe and its two parts, per diagnose file that has the split (one group per engine)."""
    docs = [d for d in data.diagnose if "shadow" in d]
    if not docs:
        return None
    traces = []
    for part, key in (("β (total)", None), ("β_precision: recipe vs its own engine-dtype forward", "precision"),
                      ("β_kernel: that forward vs the engine", "kernel")):
        engines, recipes, y = [], [], []  # a two-level axis: recipes grouped under their engine
        for d in docs:
            e = d["engine"]
            for name, stats in d["recipes"].items():
                engines.append(f"{e['kind']} engine, {e['dtype']}")
                recipes.append(name)
                y.append(stats["beta_abs_mean"] if key is None else stats["split"][key]["beta_abs_mean"])
        traces.append({"type": "bar", "name": part, "x": [engines, recipes], "y": y,
                       "hovertemplate": "%{x}: mean |β| %{y:.4f}"})
    return {"data": traces, "layout": plot_layout("Mean |β| split into precision and kernel parts",
                                                  "trainer recipe, by engine", "mean |β| (nats)", barmode="group",
                                                  xaxis={"tickangle": 0})}


def fig_alpha_beta_steps(data: ReportData) -> dict | None:
    runs = [r for r in data.runs if r["metrics"] and "mismatch/alpha_mean" in r["metrics"][0]]
    if not runs:
        return None
    traces = [{"type": "scatter", "mode": "markers", "name": r["name"],
               "x": [m["mismatch/alpha_mean"] for m in r["metrics"]],
               "y": [m["mismatch/beta_mean"] for m in r["metrics"]],
               "text": [f"step {m['step']}" for m in r["metrics"]]}
              for r in runs]
    return {"data": traces, "layout": plot_layout("Per step: mean α against mean β of each run",
                                                  "mean α (nats)", "mean β (nats)")}


def fig_alpha_beta_tokens(data: ReportData) -> dict | None:
    """Per token of the first logged steps of one run (the baseline when there is one): α against β, by outcome."""
    runs = [r for r in data.runs if r.get("tokens")]
    if not runs:
        return None
    import torch

    from ..metrics import phantom_clip_mask

    run = next((r for r in runs if r["config"].get("intervention") == "none"), runs[0])
    plan = run["config"].get("plan", {})
    eps_low = float(plan.get("eps_low", run["config"].get("epsilon", 0.2)))
    eps_high = float(plan.get("eps_high", eps_low))
    groups: dict[str, tuple[list, list]] = {"gradient flows": ([], []), "phantom-clipped": ([], []),
                                            "clipped (α alone too)": ([], [])}
    for t in run["tokens"]:
        alpha_clips = phantom_clip_mask(torch.tensor(t["alpha"], dtype=torch.float64),
                                        torch.tensor(t["advantage"], dtype=torch.float64), eps_low, eps_high).tolist()
        for a, b, c, ac in zip(t["alpha"], t["beta"], t["clipped"], alpha_clips):
            key = "gradient flows" if not c else ("clipped (α alone too)" if ac else "phantom-clipped")
            groups[key][0].append(a)
            groups[key][1].append(b)
    traces = [{"type": "scatter", "mode": "markers", "name": f"{k} ({len(xs)})", "x": xs, "y": ys,
               "marker": {"size": 5, "opacity": 0.6}}
              for k, (xs, ys) in groups.items()]
    steps = len(run["tokens"])
    return {"data": traces, "layout": plot_layout(f"Run '{run['name']}', first {steps} steps: α against β per token",
                                                  "α (nats)", "β (nats)")}


SHOWN_ARMS = ("none", "force-r1", "shadow-ratio", "match-bf16", "no-clip")
"""arms drawn when the page opens; the others start hidden (click the legend to show them)."""


def _arms(data: ReportData, key: str) -> dict[str, list[list[dict]]]:
    """Runs that log `key`, grouped by arm (their intervention), each run its metric rows."""
    arms: dict[str, list[list[dict]]] = {}
    for r in data.runs:
        if r["metrics"] and key in r["metrics"][0]:
            arms.setdefault(r["config"].get("intervention", r["name"]), []).append(r["metrics"])
    return arms


def _step_values(runs: list[list[dict]], key: str, carry: bool) -> list[list[float]]:
    """Per step (1 .. the longest run), the runs' values of `key`; with `carry`, a run that stopped early (it
    converged) holds its last value, as experiments.length_curve does, so the mean does not jump when it stops."""
    steps = max(len(rows) for rows in runs)
    values: list[list[float]] = [[] for _ in range(steps)]
    for rows in runs:
        for i in range(steps):
            if i < len(rows) and rows[i].get(key) is not None:
                values[i].append(rows[i][key])
            elif carry and rows and i >= len(rows):
                values[i].append(rows[-1][key])
    return values


def _per_step(data: ReportData, key: str, title: str, ylabel: str, carry: bool = False) -> dict | None:
    """One line per arm: the mean over seeds at each step, in a band of its 95% t interval (none with one seed);
    band and line share a legend entry, so a click shows or hides both."""
    from ..metrics import t_interval

    arms = _arms(data, key)
    if not arms:
        return None
    scale = 100 if key.startswith("clip/") else 1
    traces = []
    for i, (arm, runs) in enumerate(arms.items()):
        stats = [t_interval(v) for v in _step_values(runs, key, carry)]
        x = list(range(1, len(stats) + 1))
        colour = PALETTE[i % len(PALETTE)]
        shown = True if arm in SHOWN_ARMS or len(arms) <= len(SHOWN_ARMS) else "legendonly"
        common = {"legendgroup": arm, "visible": shown}
        if len(runs) > 1:
            lows, highs = [scale * t["low"] for t in stats], [scale * t["high"] for t in stats]
            traces.append({"type": "scatter", "x": x + x[::-1], "y": highs + lows[::-1], "fill": "toself",
                           "mode": "lines", "line": {"width": 0}, "fillcolor": colour, "opacity": 0.18,
                           "hoverinfo": "skip", "showlegend": False, **common})
        seeds = f"{len(runs)} seed" + ("s" if len(runs) > 1 else "")
        traces.append({"type": "scatter", "mode": "lines", "name": f"{arm} ({seeds})", "x": x,
                       "y": [scale * t["mean"] for t in stats], "line": {"color": colour}, **common})
    return {"data": traces, "layout": plot_layout(title, "step", ylabel)}


FIGURES: dict[str, tuple[Callable[[ReportData], dict | str | None], str]] = {
    "spacing": (fig_spacing, ""),
    "beta_by_prob": (fig_beta_by_prob, "phantomclip diagnose --json diagnose.json"),
    "beta_hist": (fig_beta_hist, "phantomclip diagnose --json diagnose.json"),
    "outside_vs_eps": (fig_outside_vs_eps, "phantomclip diagnose --json diagnose.json"),
    "beta_split": (fig_beta_split, "phantomclip diagnose --engine vllm --json diagnose-vllm.json"),
    "alpha_beta_tokens": (fig_alpha_beta_tokens, "phantomclip train --out runs/baseline"),
    "alpha_beta_steps": (fig_alpha_beta_steps, "phantomclip train --out runs/baseline"),
    "training": (lambda d: _per_step(d, "completion/length_mean", "Mean completion length per step (mean over seeds, "
                                    "95% interval band)", "tokens", carry=True),
                 "phantomclip experiment sanity --out runs/sanity"),
    "phantom_steps": (lambda d: _per_step(d, "clip/phantom_rate",
                                          "Phantom-clip rate per step (mean over seeds, 95% band)", "% of tokens"),
                      "phantomclip experiment sanity --out runs/sanity"),
    "beta_steps": (lambda d: _per_step(d, "mismatch/beta_abs_mean", "Mean |β| per step (mean over seeds, 95% band)",
                                       "mean |β| (nats)"), "phantomclip experiment sanity --out runs/sanity"),
    "growth": (lambda d: growth_panel.fig_growth(d.growths), growth_panel.COMMAND),
    "growth_buckets": (lambda d: growth_panel.fig_growth_buckets(d.growths), growth_panel.COMMAND),
    "growth_split": (lambda d: growth_panel.fig_growth_split(d.growths), growth_panel.COMMAND),
    "growth_depth": (lambda d: growth_panel.fig_growth_depth(d.growths), growth_panel.COMMAND),
}
"""figure name -> (draws a Plotly figure dict from the data, or None when its data is missing; command that makes the
data)."""


# ------------------------------------------------------------------------------------------- HTML pieces


def html_sanity_table(data: ReportData) -> str | None:
    """The experiment's arms with their intervals, each intervention's mechanism and the verdict on it."""
    from ..experiments import ARM_COLUMNS
    from ..interventions import INTERVENTIONS

    if not data.sanity:
        return None
    summary = data.sanity[-1]
    verdicts = dict(line.split(": ", 1) for line in summary.get("verdict", []))
    head = ("<table><thead><tr><th>arm</th><th>seeds</th>"
            + "".join(f"<th>{html.escape(h)}</th>" for h, _ in ARM_COLUMNS)
            + "<th>what it changes</th><th>against the baseline</th></tr></thead><tbody>")
    body = ""
    for a in summary["arms"]:
        doc = INTERVENTIONS.get(a["run"].split(",")[0].split("=")[0])
        body += (f"<tr><td>{html.escape(a['run'])}</td><td>{len(a['seeds'])}</td>"
                 + "".join(f"<td>{html.escape(cell(a))}</td>" for _, cell in ARM_COLUMNS)
                 + f"<td>{html.escape(doc.doc if doc else '')}</td>"
                   f"<td>{html.escape(verdicts.get(a['run'], 'the baseline'))}</td></tr>")
    note = (f"<p class=\"note\">Mean [95% interval]: {html.escape(summary.get('interval', ''))}. Steps to convergence "
            "is censored at the budget: a run that did not converge counts as the budget.</p>")
    return head + body + "</tbody></table>" + note


def _num_text(x, digits: int) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def html_trace_depth(data: ReportData) -> dict | None:
    if not data.traces:
        return None
    t = data.traces[-1]
    sites = [s for s in t["sites"]
             if s["site"].endswith("residual") or s["site"] in ("embed", "final_norm", "logits", "logprobs")]
    return {"data": [{"type": "scatter", "mode": "lines+markers", "name": "relative error",
                      "x": [s["site"] for s in sites], "y": [s["rel_error"] for s in sites]}],
            "layout": plot_layout(f"{t['recipe']} against {t['against']}: relative error along depth", "module",
                                  "‖x − x_ref‖ / ‖x_ref‖", yaxis={"type": "log"})}


def html_appendix(data: ReportData, copied: dict[Path, str]) -> str:
    items = []
    for d in data.diagnose:
        items.append(("diagnose", d["_path"], d.get("config", {}), d.get("versions", {})))
    for r in data.runs:
        items.append((f"run {r['name']}", r["_path"], r["config"], r["config"].get("versions", {})))
    for s in data.sanity:
        items.append(("experiment sanity", s["_path"], s.get("base_config", {}), {}))
    for t in data.traces:
        items.append(("trace", t["_path"], t.get("config", {}), {}))
    for g in data.growths:
        items.append(("trace --run", g["_path"], {"run": g["run"], "model": g["model"]}, {}))
    if not items:
        return "<p>No data files were given.</p>"
    out = "<ul>"
    for kind, path, cfg, versions in items:
        link = copied.get(Path(path))
        name = f'<a href="{html.escape(link)}">{html.escape(link)}</a>' if link else html.escape(path)
        out += (f"<li><b>{html.escape(kind)}</b>: {name}<details><summary>configuration</summary><pre>"
                f"{html.escape(json.dumps(cfg, indent=1, default=str))}</pre></details>"
                + (f"<details><summary>versions</summary><pre>{html.escape(json.dumps(versions, indent=1))}</pre>"
                   "</details>" if versions else "")
                + "</li>")
    return out + "</ul>"


WIDGETS = ("number_line", "crossing", "grpo_widget")
"""figures drawn in the browser by widgets.js (they need no data)."""


def render(data: ReportData, copied: dict[Path, str] | None = None) -> str:
    """The whole page as one HTML string."""
    from jinja2 import Environment
    from markdown_it import MarkdownIt
    from plotly.offline import get_plotlyjs

    from .framework_panel import html_framework_panel

    copied = copied or {}
    article = resources.files(__package__).joinpath("article.md").read_text(encoding="utf-8")
    md = MarkdownIt("commonmark", {"html": True})
    body = md.render(article)
    figures: dict[str, dict] = {}
    for marker in _markers(body):
        name = marker[len("<!-- figure: ") : -len(" -->")]
        if name in WIDGETS:
            block = f'<div class="widget" id="{name}"></div>'
        elif name == "sanity_table":
            table = html_sanity_table(data)
            block = table or _missing("phantomclip experiment sanity --out runs/sanity")
        elif name == "appendix":
            block = html_appendix(data, copied)
        elif name == "growth_table":
            block = growth_panel.html_growth_table(data.growths) or _missing(growth_panel.COMMAND)
        elif name == "your_framework":
            block = html_framework_panel(data.diagnose) or _missing("phantomclip diagnose --json diagnose.json")
        elif name == "trace_depth":
            fig = html_trace_depth(data)
            block = _figure_div(name, fig, figures) if fig else _missing("phantomclip trace --json trace.json")
        elif name in FIGURES:
            draw, command = FIGURES[name]
            fig = draw(data)
            block = _figure_div(name, fig, figures) if fig else _missing(command)
        else:
            block = f'<p class="missing">Unknown figure {html.escape(name)} in article.md.</p>'
        body = body.replace(marker, block, 1)
    template = Environment(autoescape=False).from_string(
        resources.files(__package__).joinpath("template.html.j2").read_text(encoding="utf-8"))
    widgets_js = resources.files(__package__).joinpath("widgets.js").read_text(encoding="utf-8")
    return template.render(body=body, plotly_js=get_plotlyjs(),
                           figures=json.dumps(figures, allow_nan=False, default=_nan_free), widgets_js=widgets_js,
                           palette=json.dumps(PALETTE))


def _nan_free(x):
    raise TypeError(f"not serialisable: {type(x).__name__}")


def _markers(body: str) -> list[str]:
    import re

    return re.findall(r"<!-- figure: [a-z_]+ -->", body)


def _figure_div(name: str, fig: dict, figures: dict) -> str:
    figures[name] = json_safe(fig)  # NaN/inf -> null: browsers' JSON has neither
    return f'<div class="figure" id="fig-{name}"></div>'


def _missing(command: str) -> str:
    return (f'<p class="missing">No data for this figure yet. Run <code>{html.escape(command)}</code> and pass its '
            'output to <code>phantomclip report --from</code>.</p>')


def build(sources: list[str | Path], out: str | Path) -> Path:
    """Write out/index.html and copy the data files to out/data/; returns the page's path."""
    from ..files import atomic_write_bytes

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {out} is a file: give a directory")
    data = collect(sources)
    copied: dict[Path, str] = {}
    try:
        for i, f in enumerate(data.files()):
            rel = f"data/{i:02d}-{f.parent.name}-{f.name}"
            (out / "data").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, out / rel)
            copied[f] = rel
            if f.name == "metrics.jsonl":
                copied[f.parent] = rel
        page = out / "index.html"
        try:
            body = render(data, copied)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:  # a file damaged below its top level
            raise ReportError(f"cannot draw the report from {', '.join(map(str, sources))} ({type(e).__name__}: {e}): "
                              "a file there was edited or is not one phantomclip wrote") from None
        atomic_write_bytes(page, body.encode("utf-8"))
    except OSError as e:
        raise ReportError(f"--out {out}: cannot write the report ({e.strerror or e})") from None
    return page


def demo_sources() -> list[Path]:
    """The bundled demo data (a diagnose JSON, a trace JSON and sanity-experiment runs on the bundled model)."""
    return [Path(str(resources.files(__package__).joinpath("demo")))]
