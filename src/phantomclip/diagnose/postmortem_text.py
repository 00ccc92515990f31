"""A post-mortem's rows as terminal lines (the figures are diagnose's `postmortem` key, diagnose/postmortem.py; nothing
here recomputes one), and the one sentence that says how the share outside the trust region moved from the first step to
the last, in numbers."""

from __future__ import annotations

import math

from ..maths.proportions import difference_interval


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


def outside_count(row: dict) -> int | None:
    """The step's tokens outside the trust region, from its share and its token count (the share is count/tokens)."""
    v, n = row.get("outside_trust_region"), row.get("tokens")
    if v is None or not math.isfinite(v) or not isinstance(n, int) or n <= 0:
        return None
    return round(v * n)


def change_test(rows: list[dict]) -> dict | None:
    """The first and the last step's shares outside the trust region compared as two independent shares of tokens
    (maths.proportions.difference_interval, Newcombe's 95% interval): {'first', 'last' (their rows), 'k1', 'n1',
    'k2', 'n2', 'diff', 'low', 'high', 'word'}, `word` being 'a clear rise' or 'a clear fall' only where the
    interval excludes zero and 'no detectable change' where it holds it. None where either share is unmeasured."""
    first, last = rows[0], rows[-1]
    k1, k2 = outside_count(first), outside_count(last)
    if k1 is None or k2 is None:
        return None
    n1, n2 = first["tokens"], last["tokens"]
    diff, low, high = difference_interval(k1, n1, k2, n2)
    word = "a clear rise" if low > 0 else "a clear fall" if high < 0 else "no detectable change"
    return {"first": first, "last": last, "k1": k1, "n1": n1, "k2": k2, "n2": n2, "diff": diff, "low": low,
            "high": high, "word": word}


def change_words(rows: list[dict]) -> str:
    """The short form the post-mortem figure's note carries: 'no detectable change, step 1 to 3 (+0.55 pp, 95%
    [−1.0, +2.2])'."""
    t = change_test(rows)
    if t is None:
        return "not measured at the first or the last step"
    return (f"{t['word']}, step {t['first']['step']} to {t['last']['step']} ({100 * t['diff']:+.2f} pp, 95% "
            f"[{100 * t['low']:+.1f}, {100 * t['high']:+.1f}])")


def change_sentence(rows: list[dict]) -> str:
    """How the share outside the trust region moved between the first and the last step, with the counts it rests
    on and the test that reads it (change_test): a rise or a fall only where the 95% interval of the difference
    excludes zero, else 'no detectable change'; one step apart the sentence says that is all it shows."""
    t = change_test(rows)
    if t is None:
        return "the share outside the trust region is not measured at the first or the last step"
    first, last = t["first"], t["last"]
    lagged = [r["step"] for r in rows if r.get("contains_alpha", r["lag"] != 0)]
    why = (f"; step{'s' if len(lagged) > 1 else ''} {', '.join(map(str, lagged))} measured against other weights "
           "than those that sampled them: their figures hold the policy's change too" if lagged else "")
    return (f"the share outside the trust region went from {_pct(first['outside_trust_region'])} ({t['k1']} of "
            f"{t['n1']} tokens) at step {first['step']} to {_pct(last['outside_trust_region'])} ({t['k2']} of "
            f"{t['n2']}) at step {last['step']}: {t['word']} (difference {100 * t['diff']:+.2f} pp, 95% interval "
            f"[{100 * t['low']:+.2f}, {100 * t['high']:+.2f}] pp, Newcombe's score interval for two shares; "
            f"{len(rows)} steps, {sum(r['tokens'] for r in rows)} tokens{why})")
