"""diagnose's route table on an MoE model, as terminal lines (the figures are diagnose's `routing` key, computed by
routing.route_figures; nothing here recomputes one)."""

from __future__ import annotations

import math

from .routes import REPLAY_FLAGS


def _pct(v) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{100 * v:.2f}%"


def _num(v) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:.3g}"


def routing_lines(result: dict) -> list[str]:
    """The route table: per recipe the share of expert choices that differ from the engine's, per layer, and for
    the first trainer recipe β's split into β_route and the rest, then the flags that replay the engine's routes."""
    r = result["routing"]
    e = r["engine"]
    how = "captured as it decoded" if e.get("source", "local engine decode") == "local engine decode" else e["source"]
    lines = [f"expert routing ({e['layers']} MoE layers, top-{e['k']} of {e['experts']} experts; the engine's routes "
             f"{how}, {e['positions']} positions, {e['route_bytes']:,} bytes of ids):"]
    recipes = [name for name in r if name != "engine"]
    for name in recipes:
        s = r[name]
        per_layer = ", ".join(f"{_pct(row['flip_rate'])}" for row in s["layers"])
        lines.append(f"  {name}: {_pct(s['flip_rate'])} of choices differ from the engine's (by layer: {per_layer}); "
                     f"{_pct(s['any_flip_share'])} of positions differ in some layer")
    for name in recipes:
        s = r[name]
        if "beta_route" not in s:
            continue
        b, br, rest = s["beta"], s["beta_route"], s["beta_rest"]
        lines.append(f"  {name} β = β_route + β_rest over {s['tokens']} tokens: mean |β_route| {_num(br['abs_mean'])} "
                     f"(outside the trust region alone: {_pct(br['outside_trust_region'])}), mean |β_rest| "
                     f"{_num(rest['abs_mean'])} ({_pct(rest['outside_trust_region'])}), mean |β| {_num(b['abs_mean'])} "
                     f"({_pct(b['outside_trust_region'])}); {_pct(s['route_touched_share'])} of tokens follow a "
                     "flipped choice")
        margins = "; ".join(f"layer {row['layer']} p10 {_num(row['margin_p10'])}, flipped median "
                            f"{_num(row['margin_flipped_median'])}" for row in s["layers"])
        lines.append(f"  {name} router top-k margins (k-th − (k+1)-th logit): {margins}")
    lines.append("  routing replay gives the trainer the engine's experts (removes β_route): "
                 + "; ".join(f"{fw} {flags}" for fw, flags in REPLAY_FLAGS.items()))
    return lines
