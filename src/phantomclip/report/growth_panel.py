"""The article's "The gap along training" section: what `phantomclip trace --run` measured along training runs, drawn
from its JSON alone (trace/growth.py writes it; every key is defined in docs/metrics.md,
"Metrics of `phantomclip trace --run`").

Four pieces: mean |β| and its parts at each snapshot on the fixed reference tokens (`fig_growth`); mean |β| per
engine-probability bucket at the first and the last snapshot (`fig_growth_buckets`); the engine recipe's relative
error against the trainer's along the depth at those two snapshots (`fig_growth_depth`); and the exact split of mean
|β|'s change since the first snapshot into mix, within-bucket and interaction parts, as stacked bars and as a table
whose last column names the part that carries most of the change in that run (`fig_growth_split`,
`html_growth_table`). A run is one seed: the table says how many runs agree, and the page claims nothing the runs
do not all show.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..maths.proportions import wilson_interval
from .escape import html_text
from .plots import PALETTE, arm_colour, category_axis, figure, log_axis, note, plot_layout, seed_symbol, step_axis
from .sources import seed_group

COMMAND = "phantomclip train --keep-snapshots 5 --out runs/r && phantomclip trace --run runs/r --json growth.json"
"""what writes the data of this section."""
PARTS = ("mix", "within", "interaction")
"""the three terms of `metrics.shift_share`, in the order they are stacked."""
PART_WORDS = {"mix": "the token mix (which probability buckets the sampled tokens fall in)",
              "within": "the network (|β| at a given token probability)",
              "interaction": "the two together (their interaction)"}


def run_name(doc: dict) -> str:
    """'none/seed-0' for OUT/none/seed-0, else the run directory's name."""
    p = Path(doc["run"])
    return f"{p.parent.name}/{p.name}" if p.name.startswith("seed-") else p.name


def bucket_labels(edges: list[float]) -> list[str]:
    """'0–0.01', '0.01–0.1', ... for engine-probability bucket edges."""
    return [f"{a:g}–{b:g}" for a, b in zip(edges[:-1], edges[1:])]


def site_label(site: str) -> str:
    """A depth site as a tick label: 'layers.12.residual' -> '12', 'final_norm' -> 'norm'; others as they are."""
    m = re.fullmatch(r"layers\.(\d+)\.residual", site)
    return m.group(1) if m else {"final_norm": "norm"}.get(site, site)


def arm_and_seed(doc: dict) -> tuple[str, int]:
    """('none', 0) for a run named none-seed0 or none/seed-0; (its name, 0) when the name carries no seed: the group
    and seed the training figures give the same run (sources.seed_group)."""
    group, seed = seed_group(run_name(doc))
    return group, seed or 0


def _line(growths: list[dict], i: int, name: str, xy: tuple[list, list], dash: str) -> dict:
    """Run i's line: its arm's colour, its seed's marker, grouped in the legend with the run's other lines. The
    legend names the run once (its solid line; clicking it shows or hides all its lines) and the title says what
    each dash is: one entry per line took 18 entries for 6 runs, half the figure on a phone. Hover names the line."""
    arm, seed = arm_and_seed(growths[i])
    arms = [arm_and_seed(d)[0] for d in growths]
    return {"type": "scatter", "mode": "lines+markers", "name": run_name(growths[i]), "x": xy[0], "y": xy[1],
            "legendgroup": str(i), "showlegend": dash == "solid", "text": [name] * len(xy[0]),
            "hovertemplate": "%{text}: %{y:.4g} at %{x}<extra></extra>",
            "line": {"dash": dash, "color": arm_colour(arm, arms) if arm in arms else PALETTE[i % len(PALETTE)]},
            "marker": {"symbol": seed_symbol(seed), "size": 7}}


def _reference_rows(doc: dict) -> list[dict]:
    """The snapshots that measured the reference tokens, in step order."""
    return [s for s in doc["snapshots"] if "reference" in s]


def fig_growth(growths: list[dict]) -> dict | None:
    """Mean |β|, |β_precision| and |β_kernel| on the reference tokens at each snapshot, one colour per run; the note
    points at the run whose |β| grew most."""
    if not growths:
        return None
    traces, grew = [], []
    for i, doc in enumerate(growths):
        rows = _reference_rows(doc)
        for key, dash, label in (("beta_abs_mean", "solid", "|β|"), ("beta_precision_abs_mean", "dash", "precision"),
                                 ("beta_kernel_abs_mean", "dot", "kernel")):
            traces.append(_line(growths, i, f"{run_name(doc)}: {label}",
                                ([s["step"] for s in rows], [s["reference"][key] for s in rows]), dash))
        if rows and rows[0]["reference"]["beta_abs_mean"]:
            first, last = rows[0]["reference"]["beta_abs_mean"], rows[-1]["reference"]["beta_abs_mean"]
            grew.append((last / first, run_name(doc), rows[-1]["step"], last))
    layout = plot_layout("step", "mean |·| (nats)", xaxis=step_axis([s["step"] for d in growths
                                                                       for s in _reference_rows(d)]))
    if grew:
        factor, name, step, last = max(grew)
        layout["annotations"] = [note(step, last, f"{name}: ×{factor:.1f} since the first snapshot", ax=-80, ay=-20)]
    return figure(traces, layout, "Mean |β| and its parts along each run, on fixed tokens",
                  "Solid: |β|; dashed: its precision part; dotted: its kernel part. The tokens are those sampled at "
                  "the first snapshot, re-read at every snapshot, so every change is the network's.",
                  ("growths", growths))


def fig_growth_buckets(growths: list[dict]) -> dict | None:
    """Mean |β| per engine-probability bucket on the reference tokens, at the first and the last snapshot."""
    if not growths:
        return None
    traces = []
    for i, doc in enumerate(growths):
        rows = _reference_rows(doc)
        for s, dash in ((rows[0], "dot"), (rows[-1], "solid")):
            traces.append(_line(growths, i, f"{run_name(doc)}, step {s['step']}",
                                (bucket_labels(doc["prob_edges"]), s["reference"]["bucket_beta_abs_mean"]), dash))
    return figure(traces, plot_layout("engine probability of the token", "mean |β| (nats)",
                                      yaxis=log_axis([y for t in traces for y in t["y"] if y is not None]),
                                      xaxis=category_axis(bucket_labels(growths[0]["prob_edges"]))),
                  "Mean |β| by the engine's probability of the token, first and last snapshot",
                  "Dotted: the first snapshot; solid: the last; the fixed tokens of each run.", ("growths", growths))


def fig_growth_depth(growths: list[dict]) -> dict | None:
    """The engine recipe's relative error against the trainer's along the depth, on the fixed tokens, at the first
    and the last snapshot of each run (runs analysed before this figure existed carry no depth and are left out)."""
    traces = []
    for i, doc in enumerate(growths):
        rows = [s for s in _reference_rows(doc) if "depth" in s["reference"]]
        if not rows:
            continue
        for s, dash in ((rows[0], "dot"), (rows[-1], "solid")):
            depth = s["reference"]["depth"]
            traces.append(_line(growths, i, f"{run_name(doc)}, step {s['step']}",
                                ([site_label(d["site"]) for d in depth], [d["rel_error"] for d in depth]), dash))
    if not traces:
        return None
    sites = list(dict.fromkeys(x for t in traces for x in t["x"]))
    return figure(traces, plot_layout("site: embedding, the residual stream after each layer, final norm",
                                      "‖x_engine − x_trainer‖ / ‖x_trainer‖",
                                      yaxis=log_axis([y for t in traces for y in t["y"]]), xaxis=category_axis(sites)),
                  "Relative error of the engine's recipe along the depth, first and last snapshot",
                  "Against the trainer's recipe, on each run's fixed tokens; dotted: the first snapshot, solid: the "
                  "last.", ("growths", growths))


def last_changes(doc: dict) -> dict[str, tuple[int, dict]]:
    """token set -> (step, change_since_first) at the last snapshot that measured that set."""
    out = {}
    for s in doc["snapshots"]:
        for which in ("reference", "own"):
            if which in s:
                out[which] = (s["step"], s[which]["change_since_first"])
    return out


def fig_growth_split(growths: list[dict]) -> dict | None:
    """The change of mean |β| since the first snapshot, at the last one, as stacked mix / within / interaction bars,
    one pair of bars (reference and own tokens) per run."""
    if not growths:
        return None
    runs, sets, parts = [], [], {p: [] for p in PARTS}  # a two-level axis: token sets grouped under their run
    for doc in growths:
        for which, (step, d) in last_changes(doc).items():
            runs.append(run_name(doc))
            sets.append(which)
            for p in PARTS:
                parts[p].append(d[p])
    traces = [{"type": "bar", "name": p, "x": [runs, sets], "y": parts[p], "marker": {"color": PALETTE[i]}}
              for i, p in enumerate(PARTS)]
    x_title = "run; tokens: reference (the first snapshot's) or own (each snapshot's)"
    return figure(traces, plot_layout(x_title, "Δ mean |β| (nats)", barmode="relative", xaxis={"tickangle": 0}),
                  "Change of mean |β| since the first snapshot = mix + within + interaction",
                  "At each run's last snapshot: the token mix (which probability buckets the tokens fall in), the "
                  "network within a bucket, and the two together, which add up to the change exactly.",
                  ("growths", growths))


def token_counts(doc: dict, which: str, step: int) -> str:
    """'256 → 8': how many tokens of set `which` the first snapshot and the snapshot at `step` measured, the counts
    the row's means rest on ('?' where a file did not record one)."""
    def count(s: dict) -> str:
        n = s.get(which, {}).get("tokens")
        return str(n) if isinstance(n, int) else "?"

    first = next(s for s in doc["snapshots"] if which in s)
    last = next((s for s in doc["snapshots"] if s["step"] == step and which in s), {})
    return f"{count(first)} → {count(last)}"


def dominant_part(d: dict) -> str:
    """The part of `shift_share`'s split with the largest share of the change, by absolute size."""
    return max(PARTS, key=lambda p: abs(d[p]))


def html_growth_table(growths: list[dict]) -> str | None:
    """Per run and token set: mean |β| at the first and last snapshot, the three parts of the change, and which part
    carries most of it; then one sentence over all runs, claiming only what every run shows."""
    if not growths:
        return None
    head = ("<table><thead><tr><th>run</th><th>tokens</th><th>steps</th><th>counted</th><th>mean |β| first</th>"
            "<th>last</th>"
            "<th>change</th>" + "".join(f"<th>{p}</th>" for p in PARTS) + "<th>most of it</th></tr></thead><tbody>")
    body, reference_parts, names, mix_smallest = "", [], [], 0
    for doc in growths:
        first = next(s["step"] for s in doc["snapshots"])
        for which, (step, d) in last_changes(doc).items():
            part = dominant_part(d)
            if which == "reference":
                reference_parts.append(part)
                names.append(run_name(doc))
                mix_smallest += abs(d["mix"]) == min(abs(d[p]) for p in PARTS)
            body += (f"<tr><td>{html_text(run_name(doc))}</td><td>{html_text(which)}</td>"
                     f"<td>{html_text(first)} → {html_text(step)}</td><td>{token_counts(doc, which, step)}</td>"
                     f"<td>{d['mean_a']:.4f}</td><td>{d['mean_b']:.4f}</td><td>{d['change']:+.4f}</td>"
                     + "".join(f"<td>{d[p]:+.4f}</td>" for p in PARTS) + f"<td>{html_text(part)}</td></tr>")
    verdict = growth_verdict(reference_parts, names, mix_smallest)
    note = (f"{verdict}. The reference tokens are the same at every snapshot, so every change there is the "
            "network's: their mix moves only as the engine's probability of them moves. The own tokens also change "
            "with the policy, and there are fewer of them as completions shorten: 'counted' gives the tokens at the "
            "first and the last snapshot, and a mean over a few dozen tokens is a rough one.")
    return head + body + "</tbody></table>" + f'<p class="note">{html_text(note)}</p>'


def growth_verdict(parts: list[str], names: list[str], mix_smallest: int) -> str:
    """One sentence over the runs' dominant parts (fixed tokens): what all share, or how many runs say what, and
    how often the mix part was the smallest. Counts only: a majority is reported as a majority, never as all."""
    n = len(parts)
    counts = {p: parts.count(p) for p in PARTS if p in parts}
    if n == 1:
        verdict = (f"On the fixed reference tokens of this one run, most of the change in mean |β| is "
                   f"{PART_WORDS[parts[0]]}; one run is one seed, not yet a finding")
    elif len(counts) == 1:
        verdict = (f"On the fixed reference tokens, most of the change in mean |β| is {PART_WORDS[parts[0]]}, in "
                   f"each of the {n} runs ({', '.join(names)}; each run is one seed)")
    elif 2 * max(counts.values()) <= n:
        split = "; ".join(f"{p} in {', '.join(nm for nm, q in zip(names, parts) if q == p)}" for p in counts)
        verdict = (f"The {n} runs disagree on which part carries the change of mean |β| on the fixed reference tokens "
                   f"({split}): no single explanation holds at this number of runs")
    else:
        top = max(counts, key=counts.get)
        others = "; ".join(f"{p} in {', '.join(nm for nm, q in zip(names, parts) if q == p)}"
                           for p in counts if p != top)
        verdict = (f"On the fixed reference tokens, most of the change in mean |β| is {PART_WORDS[top]} in "
                   f"{counts[top]} of the {n} runs; the others differ ({others})")
    return verdict + (f". The mix part is the smallest of the three in {mix_smallest} of {n} run"
                      + ("s" if n != 1 else "") + " on the fixed tokens")


POSTMORTEM_COMMAND = "phantomclip diagnose --rollouts rollouts/ --checkpoints checkpoints/ --json postmortem.json"
"""what writes the post-mortem figure's data: a diagnose JSON over a run's recorded rollouts (docs/rollouts.md)."""


def _share_bars(rows: list[dict], key: str) -> dict:
    """Plotly error bars of each step's share `key` (in %): its Wilson 95% interval over the step's tokens, so the
    reader sees how far a step's share could move by sampling alone."""
    lows, highs = [], []
    for r in rows:
        v, n = r.get(key), r.get("tokens")
        if v is None or not isinstance(n, int) or n <= 0:
            lows.append(None)
            highs.append(None)
            continue
        lo, hi = wilson_interval(round(v * n), n)
        lows.append(100 * (v - lo))
        highs.append(100 * (hi - v))
    return {"type": "data", "symmetric": False, "array": highs, "arrayminus": lows, "thickness": 1, "width": 4}


def fig_postmortem(diagnose: list[dict]) -> dict | None:
    """A post-mortem of the user's own run (`diagnose --rollouts DIR` over several steps, against their real engine):
    the share of tokens outside the trust region and, where the records carry advantages, the share phantom-clipped
    at α = 0, per recorded step, each with its Wilson 95% interval; the y axis starts at zero, so a change of half a
    point between two steps of 1000 tokens does not fill the plot. The note on the last step is
    postmortem_text.change_words, the test change_sentence states in full."""
    from ..diagnose.postmortem_text import change_words

    docs = [d for d in diagnose if d.get("postmortem")]
    if not docs:
        return None
    doc = docs[-1]
    rows = doc["postmortem"]["steps"]
    steps = [r["step"] for r in rows]
    traces = [{"type": "scatter", "mode": "lines+markers", "name": name, "x": steps,
               "y": [None if r[key] is None else 100 * r[key] for r in rows], "line": {"dash": dash},
               "error_y": _share_bars(rows, key), "customdata": [r["tokens"] for r in rows],
               "hovertemplate": "step %{x}: %{y:.2f}% of %{customdata} tokens<extra></extra>"}
              for key, name, dash in (("outside_trust_region", "outside the trust region", "solid"),
                                      ("phantom_share_at_alpha0", "phantom-clipped at α = 0", "dot"))
              if any(r[key] is not None for r in rows)]
    layout = plot_layout("step", "% of tokens", xaxis=step_axis(steps), yaxis={"rangemode": "tozero"})
    last = rows[-1]
    layout["annotations"] = [note(last["step"], 100 * (last["outside_trust_region"] or 0), change_words(rows),
                                  ax=-120, ay=-30, xanchor="right")]
    engine, tr = doc["engine"], doc["trust_region"]
    checkpoints = doc["postmortem"].get("checkpoints")
    against = ("each step's own checkpoint" if checkpoints else
               f"one set of weights for every step ({rows[0].get('checkpoint') or 'the model given'})")
    return figure(traces, layout, "Your run, step by step, against the engine that sampled it",
                  f"The {doc['postmortem']['recipe']} trainer's tokens outside [{1 - tr['epsilon_low']:g}, "
                  f"{1 + tr['epsilon_high']:g}] per recorded step, scored at {against}, against the log-probs "
                  f"{engine.get('name') or 'the engine'} recorded ({engine.get('source') or 'a rollout file'}). Bars: "
                  "each step's 95% interval (Wilson's, over its tokens); the axis starts at zero.",
                  ("diagnose", [doc]))
