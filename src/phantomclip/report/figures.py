"""The figures of the article's first half, drawn from a diagnose JSON and a trace JSON: spacing of the formats, |β|
by token probability, the β histogram against the trust region, the share outside against ε, the precision/kernel
split, α against β per token, and the error along depth.

Each figure is a record of plots.figure: Plotly's "data" and "layout", a short "title" above it, a "caption" below it
(what its marks are, the rules it follows) and "source": the kind and the documents it was drawn from, which the page
turns into the Data: line. Each draws its key point on the plot (plots.note): the ratio it shows, the share it counts,
a token it is about.
"""

from __future__ import annotations

import math

from ..answer.decide import measured_engine
from ..maths.metrics import PROB_EDGES
from .growth_panel import bucket_labels, site_label
from .plots import LOG_AXIS, PALETTE, category_axis, figure, log_axis, note, plot_layout


def fig_spacing(data) -> dict:
    import torch

    from ..base.numerics import ulp

    x = torch.logspace(-6, 4, 200, dtype=torch.float64)
    traces = [{"type": "scatter", "mode": "lines", "name": name, "x": x.tolist(),
               "y": ulp(x.float(), dt).double().tolist(), "line": {"color": colour}}
              for (name, dt), colour in zip((("fp32", torch.float32), ("fp16", torch.float16),
                                             ("bf16", torch.bfloat16)), PALETTE)]
    one = {name: ulp(torch.ones(1), dt).item() for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    layout = plot_layout("|x|", "spacing", xaxis=LOG_AXIS, yaxis={**LOG_AXIS, "dtick": 2})
    layout["annotations"] = [note(0, math.log10(one["bf16"]), f"at 1: bf16 {one['bf16']:.3g}, fp32 {one['fp32']:.2g}",
                                  ax=-70, ay=-40)]
    return figure(traces, layout, "Spacing between neighbouring numbers (one ulp), by magnitude",
                  "Each format's spacing doubles at every power of two; bf16's is 2^16 times fp32's at every "
                  "magnitude, and fp16's stops shrinking below 6·10⁻⁵, where its subnormal numbers start.",
                  ("computed", []))


def _beta_arrays(diag: dict) -> dict[str, list[float]]:
    return {name: [b for b in arr["beta"] if b is not None] for name, arr in diag["tokens"]["per_recipe"].items()}


def bucket_of(p: float) -> int:
    """metrics.prob_buckets' rule for one probability: edges[i] <= p < edges[i+1], p = 1 in the last bucket."""
    return min(sum(p >= e for e in PROB_EDGES[1:-1]), len(PROB_EDGES) - 2)


def beta_by_bucket(diag: dict, beta: list) -> tuple[list[float | None], list[int]]:
    """Mean |β| and the token count per engine-probability bucket (metrics.PROB_EDGES) of a recipe's per-token β."""
    sums, counts = [0.0] * (len(PROB_EDGES) - 1), [0] * (len(PROB_EDGES) - 1)
    for lp, b in zip(diag["tokens"]["logp_engine"], beta):
        if lp is not None and b is not None:
            k = bucket_of(math.exp(lp))
            sums[k] += abs(b)
            counts[k] += 1
    return [t / c if c else None for t, c in zip(sums, counts)], counts


def fig_beta_by_prob(data) -> dict | None:
    """Mean |β| per bucket of the engine's probability of the token, on metrics.PROB_EDGES: the buckets section 6
    uses, so the two can be read side by side. The note gives the first recipe's ratio of its rarest bucket to its
    most confident (prose.rare_tokens says it in words)."""
    if not data.diagnose:
        return None
    diag = data.diagnose[-1]
    labels = bucket_labels(list(PROB_EDGES))
    traces = []
    for i, (name, arr) in enumerate(diag["tokens"]["per_recipe"].items()):
        means, counts = beta_by_bucket(diag, arr["beta"])
        traces.append({"type": "scatter", "mode": "lines+markers", "name": name, "x": labels, "y": means,
                       "line": {"color": PALETTE[i]}, "text": [f"{c} token{'s' if c != 1 else ''}" for c in counts],
                       "hovertemplate": "%{x}: mean |β| %{y:.4f} (%{text})"})
    layout = plot_layout("engine probability of the sampled token", "mean |β| (nats)",
                         yaxis=log_axis([y for t in traces for y in t["y"]]), xaxis=category_axis(labels))
    first = traces[0]
    filled = [(x, y) for x, y in zip(first["x"], first["y"]) if y]
    if len(filled) >= 2:
        (x_lo, y_lo), (x_hi, y_hi) = filled[0], filled[-1]
        layout["annotations"] = [note(x_hi, math.log10(y_hi), f"{first['name']}: {y_lo / y_hi:.0f}× less than at "
                                                              f"{x_lo}", ax=-90, ay=-50)]
    return figure(traces, layout, "Mean |β| by the engine's probability of the sampled token",
                  "One line per trainer recipe; each point's hover gives its number of tokens. Rare tokens carry the "
                  "large ratios: a logit error moves log p of a confident token little, and of a rare one fully.",
                  ("diagnose", [diag]))


def _outside(betas: list[float], log_low: float, log_high: float) -> int:
    """How many of `betas` lie outside [log_low, log_high] (metrics.trust_region_split's strict rule)."""
    return sum(b < log_low or b > log_high for b in betas)


def fig_beta_hist(data) -> dict | None:
    if not data.diagnose:
        return None
    diag = data.diagnose[-1]
    tr = diag["trust_region"]
    arrays = _beta_arrays(diag)
    traces = [{"type": "histogram", "name": name, "x": betas, "nbinsx": 120, "opacity": 0.6,
               "marker": {"color": PALETTE[i]}, "visible": True if i == 0 else "legendonly"}
              for i, (name, betas) in enumerate(arrays.items())]
    every = [b for bs in arrays.values() for b in bs] + [tr["log_low"], tr["log_high"]]
    pad = 0.05 * (max(every) - min(every))  # every token in view: the few outside the band are the point
    layout = plot_layout("β (nats)", "tokens", barmode="overlay", yaxis=LOG_AXIS,
                         xaxis={"range": [min(every) - pad, max(every) + pad]})
    layout["shapes"] = [{"type": "rect", "xref": "x", "yref": "paper", "x0": tr["log_low"], "x1": tr["log_high"],
                         "y0": 0, "y1": 1, "fillcolor": "#009E73", "opacity": 0.12, "line": {"width": 0}}]
    name, betas = next(iter(arrays.items()))
    out = _outside(betas, tr["log_low"], tr["log_high"])
    layout["annotations"] = [note(tr["log_high"], 0.9, f"{name}: {out} of {len(betas)} tokens outside the band",
                                  yref="paper", ax=60, ay=-10, xanchor="left")]
    return figure(traces, layout, "β per token before training, against the trust region",
                  f"β = logp − logp_engine at α = 0, one histogram per trainer recipe (the first shown; click the "
                  f"legend for the others). Shaded: the trust region for ε = {tr['epsilon_low']:g}, log(1 − ε) to "
                  f"log(1 + ε); the tokens count on a log axis.", ("diagnose", [diag]))


def fig_outside_vs_eps(data) -> dict | None:
    if not data.diagnose:
        return None
    eps_grid = [0.01 * i for i in range(1, 41)]
    diag = data.diagnose[-1]
    traces = []
    for i, (name, betas) in enumerate(_beta_arrays(diag).items()):
        n = max(len(betas), 1)
        ys = [_outside(betas, math.log1p(-e), math.log1p(e)) / n * 100 for e in eps_grid]
        # a share of 0 has no place on a log axis: Plotly drew it as a vertical line down to the edge
        traces.append({"type": "scatter", "mode": "lines+markers", "name": name, "x": eps_grid,
                       "y": [y if y > 0 else None for y in ys], "marker": {"size": 4},
                       "line": {"color": PALETTE[i]}})
    zeros = [(t["name"], t["x"][t["y"].index(None)]) for t in traces if None in t["y"]]
    caption = "One line per trainer recipe: the share of tokens outside [1 − ε, 1 + ε] on β alone, at α = 0."
    if zeros:
        caption += (" A share of 0 is not drawn on this log axis: no token is outside from ε = "
                    + ", ".join(f"{e:.2f} for {name}" for name, e in zeros) + ".")
    layout = plot_layout("ε", "% of tokens", yaxis=log_axis([y for t in traces for y in t["y"]]))
    eps = diag["trust_region"]["epsilon_low"]
    first = traces[0]
    at = min(range(len(eps_grid)), key=lambda k: abs(eps_grid[k] - eps))
    if first["y"][at]:
        layout["annotations"] = [note(eps_grid[at], math.log10(first["y"][at]),
                                      f"{first['name']} at ε = {eps:g}: {first['y'][at]:.2g}%", ax=50, ay=-40)]
    return figure(traces, layout, "Share of tokens whose β alone leaves the trust region, by ε", caption,
                  ("diagnose", [diag]))


def fig_beta_split(data) -> dict | None:
    """Mean |β| of each recipe and its two parts, per diagnose file that has the split (one group per engine), of
    the model of the last one (a file of another model, an MoE one of its own section, would mix two models'
    bars). The note points at a recipe in the engine's own dtype, whose β is all kernel."""
    last = data.diagnose[-1] if data.diagnose else {}
    docs = [d for d in data.diagnose if "shadow" in d and d.get("model", {}).get("name") == last["model"]["name"]]
    if not docs:
        return None
    traces = []
    for i, (part, key) in enumerate((("β (total)", None), ("β_precision: recipe vs its own engine-dtype forward",
                                                           "precision"), ("β_kernel: that forward vs the engine",
                                                                          "kernel"))):
        engines, recipes, y = [], [], []  # a two-level axis: recipes grouped under their engine
        for d in docs:
            for name, stats in d["recipes"].items():
                engines.append(measured_engine(d))
                recipes.append(name)
                y.append(stats["beta_abs_mean"] if key is None else stats["split"][key]["beta_abs_mean"])
        traces.append({"type": "bar", "name": part, "x": [engines, recipes], "y": y, "marker": {"color": PALETTE[i]},
                       "hovertemplate": "%{x}: mean |β| %{y:.4f}"})
    n = len(traces[0]["y"])  # the bars' categories fill the axis: autorange made room for the note's words too,
    # and left 40% of a phone's plot empty
    layout = plot_layout("trainer recipe, by engine", "mean |β| (nats)", barmode="group",
                         xaxis={"tickangle": 0, "range": [-0.5, n - 0.5]})
    total, precision = traces[0], traces[1]
    at = next((k for k, v in enumerate(precision["y"]) if v == 0), None)
    if at is not None:  # x: the category's place on the two-level axis; the words on the side with more room
        top = max(t["y"][at] for t in traces)
        right = at < n / 2
        layout["annotations"] = [note(at, top, f"{total['x'][1][at]}: no precision part, all kernel", ay=-45,
                                      ax=30 if right else -30, xanchor="left" if right else "right")]
    return figure(traces, layout, "Mean |β| per trainer recipe, and its precision and kernel parts",
                  "β_precision: the recipe against its own forward in the engine's dtype (the shadow); β_kernel: "
                  "that shadow against the engine (same weights and dtype, other kernels). The parts add up to β "
                  "token by token; their sizes do not add, since both hold the shadow's rounding with opposite signs.",
                  ("diagnose", docs))


SPREAD_QUANTILE = 0.99
"""the per-token α axis reaches this quantile of |α| (with SPREAD_MARGIN): Plotly's autorange also makes room for a
note's words, and on a phone it ran the axis to 1.7 nats for points within 0.65 (the histogram's β axis, now the
data's range, to 3.6 for tokens within 0.34), crowding them into a fraction of the width."""
SPREAD_MARGIN = 1.15


def spread_range(values: list[float], keep: list[float] = ()) -> list[float]:
    """An axis range, symmetric about 0, reaching SPREAD_MARGIN times the SPREAD_QUANTILE quantile of |values| and
    every value of `keep` (the trust region's edges, which the figure draws)."""
    mags = sorted(abs(v) for v in values)
    bulk = mags[math.ceil(SPREAD_QUANTILE * (len(mags) - 1))] if mags else 0.0
    reach = SPREAD_MARGIN * max([bulk] + [abs(k) for k in keep]) or 1.0
    return [-reach, reach]


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
"""tokens whose group's rewards were all equal: their loss term is zero on either branch, clipped or not. They are
counted in the caption, not drawn (1024 of the sanity baseline's 1192 logged tokens were these: a grey cloud that hid
the tokens whose gradient flows, and most of the figure's bytes)."""
TOKEN_STYLES = {"gradient flows": ("#999999", "circle", 5), "phantom-clipped": ("#D55E00", "diamond", 9),
                "clipped (α alone too)": ("#0072B2", "square", 7)}
"""outcome -> (colour, marker, size): told apart by shape as well as colour (Okabe-Ito's vermillion and blue against
grey), so a reader who cannot tell the colours apart still can."""


def _token_groups(run: dict) -> tuple[dict[str, tuple[list, list]], int]:
    """α and β of every logged token of `run` whose advantage is not 0, grouped by what the clip did to it, and the
    count of tokens of advantage 0."""
    import torch

    from ..maths.metrics import phantom_clip_mask

    eps_low, eps_high = _epsilons(run)
    groups: dict[str, tuple[list, list]] = {k: ([], []) for k in TOKEN_STYLES}
    zeros = 0
    for t in run["tokens"]:
        alpha_clips = phantom_clip_mask(torch.tensor(t["alpha"], dtype=torch.float64),
                                        torch.tensor(t["advantage"], dtype=torch.float64), eps_low, eps_high).tolist()
        for a, b, adv, c, ac in zip(t["alpha"], t["beta"], t["advantage"], t["clipped"], alpha_clips):
            if adv == 0:
                zeros += 1
                continue
            key = ("clipped (α alone too)" if ac else "phantom-clipped") if c else "gradient flows"
            groups[key][0].append(a)
            groups[key][1].append(b)
    return groups, zeros


def _clipped(groups: dict) -> int:
    return len(groups["phantom-clipped"][0]) + len(groups["clipped (α alone too)"][0])


def _first_clipping_step(runs: list[dict]) -> tuple[dict, dict] | None:
    """(run, its metrics row) of the earliest step at which any of `runs` logged a clipped token."""
    found = [(m["step"], i, m) for i, r in enumerate(runs) for m in r["metrics"] if (m.get("clip/rate") or 0) > 0]
    if not found:
        return None
    _, i, m = min(found, key=lambda f: f[:2])
    return runs[i], m


def _arm(run: dict) -> str:
    return run.get("arm") or run["config"].get("intervention", "")


def fig_alpha_beta_tokens(data) -> dict | None:
    """Per token of the first logged steps of one run: α against β, by outcome. The run is the first whose logged
    tokens hold a phantom-clipped one (then a clipped one), baseline runs first ('none': the sanity experiment's,
    then the FP8 experiment's bf16 engine, the same contract); when none does, the first baseline run, and the
    caption says at which step a run's metrics first record a clip and how to log its tokens."""
    runs = [r for r in data.runs + data.fp8_runs if r.get("tokens")]
    if not runs:
        return None
    runs.sort(key=lambda r: _arm(r) != "none")  # the baseline first; stable otherwise
    grouped = [(r, *_token_groups(r)) for r in runs]
    run, groups, zeros = next(((r, g, z) for r, g, z in grouped if g["phantom-clipped"][0]),
                              next(((r, g, z) for r, g, z in grouped if _clipped(g)), grouped[0]))
    traces = [{"type": "scatter", "mode": "markers", "name": f"{k} ({len(xs)})", "x": xs, "y": ys,
               "marker": {"size": size, "opacity": 0.75, "color": colour, "symbol": symbol}}
              for k, (xs, ys) in groups.items() for colour, symbol, size in [TOKEN_STYLES[k]]]
    every = [a for xs_, _ in groups.values() for a in xs_]
    eps = _epsilons(run)
    x_range = spread_range(every, [math.log1p(-eps[0]), math.log1p(eps[1])])
    layout = plot_layout("α (nats)", "β (nats)", showlegend=True, xaxis={"range": x_range})
    layout["shapes"] = _trust_region_edges(every, eps)
    xs, ys = groups["phantom-clipped"]
    if xs:  # the one furthest out, its words on the side with more room (a phone's plot is 300 px wide)
        k = max(range(len(ys)), key=lambda i: abs(ys[i]))
        right = xs[k] < sum(x_range) / 2
        layout["annotations"] = [note(xs[k], ys[k], "phantom-clipped: α alone inside", ax=50 if right else -50,
                                      ay=-40 if ys[k] < 0 else 40, xanchor="left" if right else "right")]
    steps = [t["step"] for t in run["tokens"]]
    caption = (f"Each token with a gradient to lose, by what the clip did to it. Dashed: α + β at the trust region's "
               f"edges; dotted: α alone at them. Not drawn: {zeros} tokens of advantage 0 (groups whose rewards were "
               "all equal: no gradient to lose).")
    past = sum(not x_range[0] <= a <= x_range[1] for a in every)
    if past:
        caption += (f" The α axis holds {100 * SPREAD_QUANTILE:g}% of the tokens: {past} of {len(every)} lie past "
                    "its ends (double-click the plot to show them).")
    if not _clipped(groups):
        caption += (" No token of these steps was clipped" + (f" in any of the {len(runs)} runs that logged tokens"
                                                              if len(runs) > 1 else "") + ".")
        first = _first_clipping_step([run]) or _first_clipping_step([r for r in data.runs if r["metrics"]])
        if first:
            r, m = first
            where = "this run's metrics" if r is run else f"the metrics of '{r['name']}'"
            caption += (f" The first clip in {where} is at step {m['step']} "
                        f"({100 * m['clip/rate']:.1f}% of tokens, {100 * (m.get('clip/phantom_rate') or 0):.1f}% "
                        f"phantom): log that far with train --token-log-steps {m['step']}.")
    of = f" of experiment {run['experiment']}" if run.get("experiment") not in (None, "sanity") else ""
    title = f"α against β per token, run '{run['name']}'{of}, steps {min(steps)}–{max(steps)}"
    return figure(traces, layout, title, caption, ("runs", [run]))


def fig_trace_depth(data) -> dict | None:
    if not data.traces:
        return None
    t = data.traces[-1]
    sites = [s for s in t["sites"]
             if s["site"].endswith("residual") or s["site"] in ("embed", "final_norm", "logits", "logprobs")]
    labels = [site_label(s["site"]) for s in sites]
    errors = [s["rel_error"] for s in sites]
    layout = plot_layout("site: embedding, the residual stream after each layer, final norm, logits, "
                         "log-probabilities", "‖x − x_ref‖ / ‖x_ref‖", yaxis=log_axis(errors),
                         xaxis=category_axis(labels), showlegend=False)
    # the key point: the largest error and where along the depth it is
    top = max(range(len(errors)), key=errors.__getitem__, default=None)
    if top is not None and errors[top] > 0:
        layout["annotations"] = [note(top, math.log10(errors[top]), f"largest: {errors[top]:.2g} at {labels[top]}",
                                      ax=-60, ay=-10, xanchor="right")]
    return figure([{"type": "scatter", "mode": "lines+markers", "name": "relative error", "x": labels, "y": errors,
                    "text": [s["site"] for s in sites], "hovertemplate": "%{text}: %{y:.3g}",
                    "line": {"color": PALETTE[0]}}], layout,
                  f"{t['recipe']} against {t['against']}: relative error along the depth",
                  "The same tokens through both recipes; at each site, the norm of the difference over the norm of "
                  f"the {t['against']} reference.",
                  ("traces", [t]))
