"""The article's "Expert routing (MoE)" section: what a mixture-of-experts model adds to β, drawn from a diagnose JSON
with a route table (its `routing` block, routing.route_figures; keys in docs/metrics.md) and from a `moe-r3`
experiment (bench/experiments/exp_moe_r3.py: the baseline, rollout routing replay `r3`, and shadow-ratio on an MoE
model).

Three pieces: the share of expert choices each trainer recipe makes differently from the engine, per MoE layer
(`fig_moe_flips`); the first trainer recipe's β split into β_route (its own routes against the engine's) and β_rest,
with how far each alone reaches (`html_route_split`); and what replaying the engine's routes did in training
(`fig_moe_training`, the experiment's arms table, and `moe_result`'s sentence, which the summary's line shares).
"""

from __future__ import annotations

from ..maths.metrics import RUN_WINDOW, t_interval
from .escape import html_text
from .interventions_table import finite, html_arms_table, intervention_words, seed_values
from .plots import PALETTE, category_axis, figure, note, plot_layout
from .training_panel import per_step

DIAGNOSE = "phantomclip diagnose --model tiny-moe --json diagnose-moe.json"
"""what writes the route table (any MoE model of routing/routes.py's families; tiny-moe is a random 2-layer
Qwen3-MoE)."""
EXPERIMENT = "python bench/experiments/exp_moe_r3.py (from a clone of the repository: pip does not ship bench/)"
"""what writes the moe-r3 experiment: a script of the source tree, not a command of the installed package, and the
hint says so."""
SHOWN = ("none", "r3", "shadow-ratio")
"""the experiment's arms, every one shown when the page opens."""
SPLIT_PARTS = (("beta", "β (total)"), ("beta_route", "β_route: its own routes vs the engine's"),
         ("beta_rest", "β_rest: everything else, at the engine's routes"))
"""the route split's parts (route_figures' keys) and their words."""


def moe_diagnose(data) -> dict | None:
    """The last diagnose JSON with a route table, or None."""
    return next((d for d in reversed(data.diagnose) if d.get("routing")), None)


def _recipes(routing: dict) -> dict[str, dict]:
    """The scored recipes of a route table (every key but the engine's)."""
    return {name: r for name, r in routing.items() if name != "engine" and "layers" in r}


def fig_moe_flips(data) -> dict | None:
    """Per MoE layer, the share of expert choices each recipe makes differently from the engine's (flip_rate), as
    grouped bars; the note points at the largest. The caption gives the flipped choices' router margin."""
    doc = moe_diagnose(data)
    if doc is None:
        return None
    routing, engine = doc["routing"], doc["routing"]["engine"]
    recipes = _recipes(routing)
    labels = [f"layer {layer['layer']}" for layer in next(iter(recipes.values()))["layers"]]
    traces = [{"type": "bar", "name": name, "x": labels, "y": [100 * layer["flip_rate"] for layer in r["layers"]],
               "marker": {"color": PALETTE[i]}, "hovertemplate": "%{x}: %{y:.2f}% of choices"}
              for i, (name, r) in enumerate(recipes.items())]
    layout = plot_layout("MoE layer", "% of expert choices", barmode="group", xaxis=category_axis(labels))
    top = max(((v, t["name"], k) for t in traces for k, v in enumerate(t["y"])), default=None)
    if top and top[0] > 0:
        layout["annotations"] = [note(top[2], top[0], f"{top[1]}: {top[0]:.2g}% of choices flipped", ay=-35)]
    margins = [(name, layer["layer"], layer["margin_flipped_median"]) for name, r in recipes.items()
               for layer in r["layers"] if finite(layer.get("margin_flipped_median"))]
    caption = (f"Top-{engine['k']} of {engine['experts']} experts in each of {engine['layers']} layers, at "
               f"{engine['positions']} positions the engine routed as it decoded; a flip is a choice of the trainer's "
               "forward that differs from the engine's at the same position.")
    exact = [name for name, r in recipes.items() if r["flip_rate"] == 0]
    if exact:
        caption += f" {', '.join(exact)} routed exactly as the engine did (no flip)."
    if margins:
        caption += (" Median router margin (k-th minus (k+1)-th logit) of the flipped choices: "
                    + "; ".join(f"{name} layer {layer} {m:.2g}" for name, layer, m in margins)
                    + ": near-ties that rounding tips, or choices a flip upstream moved.")
    return figure(traces, layout, "Expert choices the trainer makes differently from the engine", caption,
                  ("diagnose", [doc]))


def html_route_split(data) -> str | None:
    """The first trainer recipe's β = β_route + β_rest (exact per token) as a table: each part's mean |·|, p99 |·|
    and the share of tokens it alone puts outside the trust region, and the share of tokens a flip touched. None
    without a route table that holds the split."""
    doc = moe_diagnose(data)
    recipes = _recipes(doc["routing"]) if doc else {}
    split = next(((name, r) for name, r in recipes.items() if "beta_route" in r), None)
    if split is None:
        return None
    name, r = split
    rows = "".join(f"<tr><td>{html_text(words)}</td><td>{r[key]['abs_mean']:.4f}</td><td>{r[key]['abs_p99']:.3f}</td>"
                   f"<td>{100 * r[key]['outside_trust_region']:.2f}%</td></tr>" for key, words in SPLIT_PARTS)
    touched = r.get("route_touched_share")
    note_text = (f"The parts add up to β token by token. {100 * touched:.1f}% of the {r['tokens']} tokens have "
                 "β_route ≠ 0: a flipped choice at their own position or earlier reaches them through attention."
                 if finite(touched) else "The parts add up to β token by token.")
    return (f"<p>The {html_text(name)} trainer's β against the {html_text(doc['engine']['dtype'])} engine, split by "
            "one more forward that replays the engine's experts:</p><table><thead><tr><th>part</th><th>mean |·|</th>"
            f"<th>p99 |·|</th><th>outside the trust region alone</th></tr></thead><tbody>{rows}</tbody></table>"
            f'<p class="note">{html_text(note_text)}</p>')


def fig_moe_training(data) -> dict | None:
    """Mean |β| per step of the moe-r3 experiment's arms (training_panel.per_step over its runs)."""
    return per_step(data, "mismatch/beta_abs_mean", "Mean |β| per step on an MoE model, with and without replay",
                    "mean |β| (nats)", runs=data.moe_runs, shown=SHOWN)


def html_moe_table(data, brief: bool = False) -> str | None:
    """The moe-r3 experiment's arms against its baseline (interventions_table.html_arms_table); None without one."""
    return html_arms_table(data.moe[-1], intervention_words, "moe-table", brief) if data.moe else None


MODEL_WORDS = {"tiny-moe": "tiny-moe, a random 2-layer Qwen3-MoE"}
"""a model of the moe-r3 experiment that is not a real MoE, in the words that say so wherever its result is quoted:
its figures show the mechanism, not the size of a trained MoE's routing mismatch."""


def experiment_model(summary: dict) -> str:
    """The experiment's model, with what it is where MODEL_WORDS knows ('tiny-moe:0' -> the random 2-layer model)."""
    name = str(summary.get("base_config", {}).get("model", "?"))
    return MODEL_WORDS.get(name.split(":")[0], name)


def _start(summary: dict, arm: str) -> tuple[float, float, float] | None:
    """(mean, lowest, highest seed) of an arm's mean |β| over its first steps, or None."""
    xs = seed_values(summary, arm, "beta_abs_mean_start")
    return (sum(xs) / len(xs), min(xs), max(xs)) if xs else None


def paired_start(summary: dict) -> dict | None:
    """r3 minus the baseline in mean |β| over the first steps, paired by seed, as maths.metrics.t_interval's record
    (mean, 95% low and high, n): the test every other line of the summary uses (the experiment's summary pairs
    only final length and the like, not this figure). None without a seed both arms measured."""
    def by_seed(arm: str) -> dict:
        return {r.get("seed"): r["beta_abs_mean_start"] for r in summary.get("runs", [])
                if r.get("run") == arm and finite(r.get("beta_abs_mean_start"))}

    base, r3 = by_seed(summary.get("baseline", "none")), by_seed("r3")
    pairs = [r3[s] - base[s] for s in r3 if s in base]
    return t_interval(pairs) if pairs else None


def paired_words(d: dict, short: bool = False) -> tuple[str, bool]:
    """('a detectable cut ... (paired by seed over 3 seeds: −0.037 [−0.082, +0.009] nats)', detected): the verdict
    by experiments.detected, the rule of every interval on the page."""
    from ..training.experiments import detected

    found = bool(detected({"beta_abs_mean_start": d}))
    if d["n"] < 2:
        return f"one seed: a difference of {d['mean']:+.3f} nats with no interval", False
    verdict = (("a detectable cut" if d["high"] < 0 else "a detectable rise") if found
               else "no detectable difference at 95%")
    paired = "paired" if short else "paired by seed over"
    return (f"{verdict} ({paired} {d['n']} seeds: {d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"
            + ("" if short else " nats") + ")"), found


def _baseline_and_r3(data) -> tuple[dict, tuple, tuple] | None:
    """(the moe-r3 summary, _start of its baseline, _start of r3), or None without the experiment or either arm."""
    if not data.moe:
        return None
    summary = data.moe[-1]
    base, r3 = _start(summary, summary.get("baseline", "none")), _start(summary, "r3")
    return None if base is None or r3 is None else (summary, base, r3)


def moe_result(data) -> str:
    """The moe-r3 experiment in one sentence: mean |β| over the first steps with the trainer's own routes (the
    baseline) and with the engine's replayed (r3), each with its seeds' range, and whether every seed of one lies
    below every seed of the other; '' without the experiment or either arm."""
    found = _baseline_and_r3(data)
    if found is None:
        return ""
    summary, base, r3 = found
    seeds = len(seed_values(summary, "r3", "beta_abs_mean_start"))
    apart = ("; every seed of r3 lies below every seed of the baseline" if r3[2] < base[1] else
             "; the seeds' ranges overlap" if seeds > 1 else "; one seed: no range to compare")
    cfg = summary.get("base_config", {})
    d = paired_start(summary)
    verdict = f"; by the paired interval, {paired_words(d)[0]}" if d else ""
    return (f"In training ({experiment_model(summary)}; {cfg.get('trainer', '?')} trainer, "
            f"{cfg.get('engine_dtype', '?')} engine, staleness {cfg.get('staleness', '?')}, task "
            f"{cfg.get('task', '?')}, {seeds} seed{'s' if seeds != 1 else ''}), replaying the engine's experts (r3) "
            f"took the mean |β| of the first {RUN_WINDOW} steps from {base[0]:.3f} (seeds {base[1]:.3f}–{base[2]:.3f}) "
            f"to {r3[0]:.3f} ({r3[1]:.3f}–{r3[2]:.3f}){apart}{verdict}.")


def summary_line(data) -> tuple[str, int, int] | None:
    """The summary's MoE line (HTML), its comparisons (1) and how many exclude zero: the first steps' mean |β|
    without and with routing replay, judged by the paired 95% interval like every other line; None without the
    experiment."""
    found = _baseline_and_r3(data)
    if found is None:
        return None
    summary, base, r3 = found
    d = paired_start(summary)
    if d is None:
        return None
    words, detected = paired_words(d, short=True)
    return (f"On {html_text(experiment_model(summary))}, routing replay (r3) took the first steps' mean |β| from "
            f"{base[0]:.3f} to {r3[0]:.3f}: <b>{html_text(words)}</b> (section 9).", int(d["n"] >= 2), int(detected))
