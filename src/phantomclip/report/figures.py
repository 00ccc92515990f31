"""The figures of the article's first half, drawn from a diagnose JSON and a trace JSON: spacing of the formats, |β|
by token probability, the β histogram against the trust region, the share outside against ε, the precision/kernel
split, α against β per token, and the error along depth.

Each figure is a dict with Plotly's "data" and "layout", the "title" the page prints above it, and "source": the
kind and the documents it was drawn from, which the page turns into the source line below it.
"""

from __future__ import annotations

import math

from ..metrics import PROB_EDGES
from .growth_panel import bucket_labels, site_label
from .plots import LOG_AXIS, PALETTE, category_axis, log_axis, plot_layout


def fig_spacing(data) -> dict:
    import torch

    from ..numerics import ulp

    x = torch.logspace(-6, 4, 200, dtype=torch.float64)
    traces = [{"type": "scatter", "mode": "lines", "name": name, "x": x.tolist(),
               "y": ulp(x.float(), dt).double().tolist(), "line": {"color": colour}}
              for (name, dt), colour in zip((("fp32", torch.float32), ("fp16", torch.float16),
                                             ("bf16", torch.bfloat16)), PALETTE)]
    return {"data": traces, "layout": plot_layout("|x|", "spacing", xaxis=LOG_AXIS, yaxis={**LOG_AXIS, "dtick": 2}),
            "title": "Spacing between neighbouring numbers (one ulp) against the magnitude", "source": ("computed", [])}


def _beta_arrays(diag: dict) -> dict[str, list[float]]:
    return {name: [b for b in arr["beta"] if b is not None] for name, arr in diag["tokens"]["per_recipe"].items()}


def bucket_of(p: float) -> int:
    """metrics.prob_buckets' rule for one probability: edges[i] <= p < edges[i+1], p = 1 in the last bucket."""
    return min(sum(p >= e for e in PROB_EDGES[1:-1]), len(PROB_EDGES) - 2)


def fig_beta_by_prob(data) -> dict | None:
    """Mean |β| per bucket of the engine's probability of the token, on metrics.PROB_EDGES: the buckets section 6
    uses, so the two can be read side by side."""
    if not data.diagnose:
        return None
    diag = data.diagnose[-1]
    labels = bucket_labels(list(PROB_EDGES))
    traces = []
    for i, (name, arr) in enumerate(diag["tokens"]["per_recipe"].items()):
        sums, counts = [0.0] * len(labels), [0] * len(labels)
        for lp, b in zip(diag["tokens"]["logp_engine"], arr["beta"]):
            if lp is None or b is None:
                continue
            k = bucket_of(math.exp(lp))
            sums[k] += abs(b)
            counts[k] += 1
        traces.append({"type": "scatter", "mode": "lines+markers", "name": name, "x": labels,
                       "y": [s / c if c else None for s, c in zip(sums, counts)], "line": {"color": PALETTE[i]},
                       "text": [f"{c} tokens" for c in counts], "hovertemplate": "%{x}: mean |β| %{y:.4f} (%{text})"})
    return {"data": traces, "layout": plot_layout("engine probability of the sampled token", "mean |β| (nats)",
                                                  yaxis=log_axis([y for t in traces for y in t["y"]]),
                                                  xaxis=category_axis(labels)),
            "title": "Mean |β| by the engine's probability of the sampled token, per trainer recipe",
            "source": ("diagnose", [diag])}


def fig_beta_hist(data) -> dict | None:
    if not data.diagnose:
        return None
    diag = data.diagnose[-1]
    tr = diag["trust_region"]
    traces = [{"type": "histogram", "name": name, "x": betas, "nbinsx": 120, "opacity": 0.6,
               "marker": {"color": PALETTE[i]}, "visible": True if i == 0 else "legendonly"}
              for i, (name, betas) in enumerate(_beta_arrays(diag).items())]
    layout = plot_layout("β (nats)", "tokens", barmode="overlay", yaxis=LOG_AXIS)
    layout["shapes"] = [{"type": "rect", "xref": "x", "yref": "paper", "x0": tr["log_low"], "x1": tr["log_high"],
                         "y0": 0, "y1": 1, "fillcolor": "#009E73", "opacity": 0.12, "line": {"width": 0}}]
    return {"data": traces, "layout": layout, "source": ("diagnose", [diag]),
            "title": f"β = logp − logp_engine per token (α = 0); shaded: the trust region for "
                     f"ε = {tr['epsilon_low']:g}"}


def fig_outside_vs_eps(data) -> dict | None:
    if not data.diagnose:
        return None
    eps_grid = [0.01 * i for i in range(1, 41)]
    traces = []
    for i, (name, betas) in enumerate(_beta_arrays(data.diagnose[-1]).items()):
        n = max(len(betas), 1)
        ys = [sum(1 for b in betas if b < math.log1p(-e) or b > math.log1p(e)) / n * 100 for e in eps_grid]
        # a share of 0 has no place on a log axis: Plotly drew it as a vertical line down to the edge
        traces.append({"type": "scatter", "mode": "lines+markers", "name": name, "x": eps_grid,
                       "y": [y if y > 0 else None for y in ys], "marker": {"size": 4},
                       "line": {"color": PALETTE[i]}})
    zeros = [(t["name"], t["x"][t["y"].index(None)]) for t in traces if None in t["y"]]
    title = "Share of tokens whose β alone leaves [1 − ε, 1 + ε]"
    if zeros:
        title += ("; a share of 0 is not drawn on this log axis: no token is outside from ε = "
                  + ", ".join(f"{e:.2f} for {name}" for name, e in zeros))
    return {"data": traces, "layout": plot_layout("ε", "% of tokens", yaxis=log_axis([y for t in traces
                                                                                       for y in t["y"]])),
            "title": title, "source": ("diagnose", data.diagnose[-1:])}


def fig_beta_split(data) -> dict | None:
    """Mean |β| of each recipe and its two parts, per diagnose file that has the split (one group per engine)."""
    docs = [d for d in data.diagnose if "shadow" in d]
    if not docs:
        return None
    traces = []
    for i, (part, key) in enumerate((("β (total)", None), ("β_precision: recipe vs its own engine-dtype forward",
                                                           "precision"), ("β_kernel: that forward vs the engine",
                                                                          "kernel"))):
        engines, recipes, y = [], [], []  # a two-level axis: recipes grouped under their engine
        for d in docs:
            e = d["engine"]
            for name, stats in d["recipes"].items():
                engines.append(f"{e['kind']} engine, {e['dtype']}")
                recipes.append(name)
                y.append(stats["beta_abs_mean"] if key is None else stats["split"][key]["beta_abs_mean"])
        traces.append({"type": "bar", "name": part, "x": [engines, recipes], "y": y, "marker": {"color": PALETTE[i]},
                       "hovertemplate": "%{x}: mean |β| %{y:.4f}"})
    return {"data": traces, "layout": plot_layout("trainer recipe, by engine", "mean |β| (nats)", barmode="group",
                                                  xaxis={"tickangle": 0}),
            "title": "Mean |β| of each trainer recipe, split into its precision and kernel parts",
            "source": ("diagnose", docs)}


def _epsilons(run: dict) -> tuple[float, float]:
    plan = run["config"].get("plan", {})
    eps_low = float(plan.get("eps_low", run["config"].get("epsilon", 0.2)))
    return eps_low, float(plan.get("eps_high", run["config"].get("epsilon_high") or eps_low))


def _trust_region_edges(xs: list[float], eps: tuple[float, float]) -> list[dict]:
    """Dashed: α + β = log(1 − ε_low) and log(1 + ε_high), the edges of the ratio's trust region; dotted: α at the
    same edges. A clipped token between a dashed and a dotted edge, on the same side, is a phantom clip."""
    lo, hi = min(xs, default=-0.5), max(xs, default=0.5)
    shapes = []
    for edge in (math.log1p(-eps[0]), math.log1p(eps[1])):
        shapes.append({"type": "line", "xref": "x", "yref": "y", "x0": lo, "x1": hi, "y0": edge - lo, "y1": edge - hi,
                       "line": {"dash": "dash", "color": "#555555", "width": 1}})
        shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": edge, "x1": edge, "y0": 0, "y1": 1,
                       "line": {"dash": "dot", "color": "#555555", "width": 1}})
    return shapes


ZERO_ADVANTAGE = "advantage 0: no gradient to lose"
"""tokens whose group's rewards were all equal: their loss term is zero on either branch, clipped or not, so they
are drawn apart from the tokens whose gradient flows (1024 of the demo's 1192 'gradient flows' were these)."""
TOKEN_COLOURS = {"gradient flows": "#999999", "phantom-clipped": "#D55E00", "clipped (α alone too)": "#0072B2",
                 ZERO_ADVANTAGE: "#DDDDDD"}


def _token_groups(run: dict) -> dict[str, tuple[list, list]]:
    """α and β of every logged token of `run`, grouped by what the clip did to it."""
    import torch

    from ..metrics import phantom_clip_mask

    eps_low, eps_high = _epsilons(run)
    groups: dict[str, tuple[list, list]] = {k: ([], []) for k in TOKEN_COLOURS}
    for t in run["tokens"]:
        alpha_clips = phantom_clip_mask(torch.tensor(t["alpha"], dtype=torch.float64),
                                        torch.tensor(t["advantage"], dtype=torch.float64), eps_low, eps_high).tolist()
        for a, b, adv, c, ac in zip(t["alpha"], t["beta"], t["advantage"], t["clipped"], alpha_clips):
            if c:
                key = "clipped (α alone too)" if ac else "phantom-clipped"
            else:
                key = ZERO_ADVANTAGE if adv == 0 else "gradient flows"
            groups[key][0].append(a)
            groups[key][1].append(b)
    return groups


def _clipped(groups: dict) -> int:
    return len(groups["phantom-clipped"][0]) + len(groups["clipped (α alone too)"][0])


def _first_clipping_step(runs: list[dict]) -> tuple[dict, dict] | None:
    """(run, its metrics row) of the earliest step at which any of `runs` logged a clipped token."""
    found = [(m["step"], i, m) for i, r in enumerate(runs) for m in r["metrics"] if (m.get("clip/rate") or 0) > 0]
    if not found:
        return None
    _, i, m = min(found, key=lambda f: f[:2])
    return runs[i], m


def fig_alpha_beta_tokens(data) -> dict | None:
    """Per token of the first logged steps of one run: α against β, by outcome. The run is the first (the baseline
    first) whose logged tokens hold a clipped one; when none does, the baseline, and the title says at which step
    a run's metrics first record a clip and how to log its tokens."""
    runs = [r for r in data.runs if r.get("tokens")]
    if not runs:
        return None
    runs.sort(key=lambda r: r["config"].get("intervention") != "none")  # the baseline first; stable otherwise
    grouped = [(r, _token_groups(r)) for r in runs]
    run, groups = next(((r, g) for r, g in grouped if _clipped(g)), grouped[0])
    traces = [{"type": "scatter", "mode": "markers", "name": f"{k} ({len(xs)})", "x": xs, "y": ys,
               "marker": {"size": 5, "opacity": 0.6, "color": TOKEN_COLOURS[k]}}
              for k, (xs, ys) in groups.items() if xs or k != ZERO_ADVANTAGE]
    layout = plot_layout("α (nats)", "β (nats)", showlegend=True)
    layout["shapes"] = _trust_region_edges([a for xs, _ in groups.values() for a in xs], _epsilons(run))
    steps = [t["step"] for t in run["tokens"]]
    title = (f"Run '{run['name']}', logged steps {min(steps)}–{max(steps)}: α against β per token. Dashed: "
             "α + β at the trust region's edges; dotted: α alone at them")
    if not _clipped(groups):
        title += ("; no token of these steps was clipped" + (f" in any of the {len(runs)} runs that logged tokens"
                                                             if len(runs) > 1 else ""))
        first = _first_clipping_step([run]) or _first_clipping_step([r for r in data.runs if r["metrics"]])
        if first:
            r, m = first
            where = "this run's metrics" if r is run else f"the metrics of '{r['name']}'"
            title += (f". The first clip in {where} is at step {m['step']} "
                      f"({100 * m['clip/rate']:.1f}% of tokens, {100 * (m.get('clip/phantom_rate') or 0):.1f}% "
                      f"phantom): log that far with train --token-log-steps {m['step']}")
    return {"data": traces, "layout": layout, "source": ("runs", [run]), "title": title}


def fig_trace_depth(data) -> dict | None:
    if not data.traces:
        return None
    t = data.traces[-1]
    sites = [s for s in t["sites"]
             if s["site"].endswith("residual") or s["site"] in ("embed", "final_norm", "logits", "logprobs")]
    return {"data": [{"type": "scatter", "mode": "lines+markers", "name": "relative error",
                      "x": [site_label(s["site"]) for s in sites], "y": [s["rel_error"] for s in sites],
                      "text": [s["site"] for s in sites], "hovertemplate": "%{text}: %{y:.3g}",
                      "line": {"color": PALETTE[0]}}],
            "layout": plot_layout("site: embedding, the residual stream after each layer, final norm, logits, "
                                  "log-probabilities", "‖x − x_ref‖ / ‖x_ref‖",
                                  yaxis=log_axis([s["rel_error"] for s in sites]),
                                  xaxis=category_axis([site_label(s["site"]) for s in sites]), showlegend=False),
            "title": f"{t['recipe']} against {t['against']}: relative error along the depth",
            "source": ("traces", [t])}
