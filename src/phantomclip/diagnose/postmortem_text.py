"""A post-mortem's rows as terminal lines (the figures are diagnose's `postmortem` key, diagnose/postmortem.py; nothing
here recomputes one), and the one sentence that says how the share outside the trust region moved from the first step to
the last, in numbers."""

from __future__ import annotations

import math


def _pct(v) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{100 * v:.2f}%"


def _num(v, digits: int = 4) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:.{digits}f}"


def postmortem_lines(result: dict) -> list[str]:
    """One row per step: its checkpoint and lag, tokens, the user's recipe's mean β, mean and p99 |β|, the share
    outside the trust region and phantom-clipped at α = 0, the kernel part; then the first-to-last sentence."""
    pm = result["postmortem"]
    rows = pm["steps"]
    against = (f"each step against the checkpoint in {pm['checkpoints']} whose weights sampled it" if pm["checkpoints"]
               else f"every step against {rows[0]['checkpoint']}")
    lines = [f"post-mortem, {pm['recipe']} trainer, {against}; the tables above are step {rows[-1]['step']}'s:",
             f"  {'step':>6} {'tokens':>7} {'mean β':>8} {'mean |β|':>8} {'p99 |β|':>7} {'outside':>7} "
             f"{'phantom':>7} {'|β_ker|':>7} {'weights':>8}"]
    for r in rows:
        lines.append(f"  {r['step']:>6} {r['tokens']:>7} {_num(r['beta_mean']):>8} {_num(r['beta_abs_mean']):>8} "
                     f"{_num(r['beta_abs_p99'], 3):>7} {_pct(r['outside_trust_region']):>7} "
                     f"{_pct(r['phantom_share_at_alpha0']):>7} {_num(r['beta_kernel_abs_mean']):>7} "
                     f"{weights_cell(r):>8}")
    lines.append("  (phantom: share clipped at α = 0 on the recorded advantages, n/a without them; weights: own = the "
                 "step's own, sN = step N's served them, ~ = the policy moved less than the gap, α = none given "
                 "sampled them: the row holds α too)")
    probe = [(r["step"], r["canary"]) for r in rows if r.get("canary")]
    if probe:
        cells = ", ".join(f"step {s} " + (f"{_num(c['beta_abs_median'])} {c['state']}"
                                          if c.get("beta_abs_median") is not None else c["state"]) for s, c in probe)
        lines.append(f"  canary (the fixed probe, median |β| against each step's own checkpoint): {cells}")
    return lines + [f"  {change_sentence(rows)}"]


def weights_cell(row: dict) -> str:
    """The weights column: whose weights sampled the step's records (which_weights' verdict)."""
    w = row.get("weights") or {}
    verdict, by = w.get("verdict"), w.get("sampled_by")
    if verdict == "served":
        return f"s{by}"
    return {"matched": "own", "ambiguous": "~", "missing": "α"}.get(verdict, "-")


def change_sentence(rows: list[dict]) -> str:
    """How the share outside the trust region moved between the first and the last step, in numbers; the direction
    word is the numbers' own (up, down or unchanged), and one step apart the sentence says that is all it shows."""
    first, last = rows[0], rows[-1]
    a, b = first["outside_trust_region"], last["outside_trust_region"]
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return "the share outside the trust region is not measured at the first or the last step"
    word = "rose" if b > a else "fell" if b < a else "stayed"
    lagged = [r["step"] for r in rows if r.get("contains_alpha", r["lag"] != 0)]
    why = (f" (step{'s' if len(lagged) > 1 else ''} {', '.join(map(str, lagged))} measured against other weights than "
           "those that sampled them: their figures hold the policy's change too)" if lagged else "")
    return (f"the share outside the trust region {word} from {_pct(a)} at step {first['step']} to {_pct(b)} at step "
            f"{last['step']} ({len(rows)} steps, {sum(r['tokens'] for r in rows)} tokens){why}")
