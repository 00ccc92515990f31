"""The seed article's claims, as data the page can set its own measurements beside: Hugging Face, "Defeating the
trainer-generator precision mismatch in TRL" (April 2026; Qwen3-0.6B, reward = −completion length, an fp32 trainer
against a bf16 vLLM engine; /work/shared/DESIGN.md section 1 summarises it). Only what the article states is here;
every figure of this page's own is computed from the files when the page is built."""

from __future__ import annotations

SEED = ("Hugging Face, \u201cDefeating the trainer-generator precision mismatch in TRL\u201d (April 2026; Qwen3-0.6B, "
        "an fp32 trainer against a bf16 vLLM engine)")
"""the seed article as the page cites it."""
SEED_PHANTOM_SHARE = 0.18
"""'about 18% of tokens phantom-clipped early in training': a share of all tokens, the base rate the summary's
share of clipped tokens is set beside."""

PRECISION_ARMS = ("match-bf16", "match-fp16", "fp16", "autocast", "fp32-head")
"""arms that match or narrow the trainer's precision to the engine's: the seed's first recommended fix."""
CLIP_ARMS = {"shadow-ratio": "the clip ratio from a shadow forward", "force-r1": "forcing r = 1",
             "no-clip": "keeping β but disabling the clip"}
"""arms that take β out of the clipped ratio, the seed's other fixes, in its words."""


def _pearson_interval(xs: list[float], ys: list[float]) -> tuple[float, float, float] | None:
    """(r, low, high): Pearson's r with Fisher's z 95% interval, atanh(r) ± 1.96 / √(n − 3)."""
    import math

    from .correlation import Z975, pearson_and_slope

    fit = pearson_and_slope(xs, ys)
    if fit is None or len(xs) < 4 or abs(fit[0]) >= 1:
        return None
    z, half = math.atanh(fit[0]), Z975 / math.sqrt(len(xs) - 3)
    return fit[0], math.tanh(z - half), math.tanh(z + half)


def beta_bias(data) -> str:
    """The seed's 'consistent negative bias' of β, tested on the β section 4's histogram draws (the last diagnose
    file's first recipe, α = 0): the mean β with its 95% t interval over tokens. Tokens of one completion are not
    independent, so the interval is narrower than the truth; the sentence says so."""
    from ..maths.metrics import t_interval

    if not data.diagnose:
        return ""
    doc = data.diagnose[-1]
    name, arr = next(iter((doc.get("tokens") or {}).get("per_recipe", {}).items()), (None, {}))
    def verdict(t: dict) -> str:
        return ("negative, as the seed reports" if t["high"] < 0 else "positive, against the seed's negative bias"
                if t["low"] > 0 else "no detectable bias")

    def figure(t: dict) -> str:
        return f"mean β = {t['mean']:+.4f} nats [{t['low']:+.4f}, {t['high']:+.4f}], {verdict(t)}"

    parts = []
    t = t_interval([b for b in arr.get("beta") or [] if b is not None])
    if t["n"] >= 2:
        parts.append(f"over the {t['n']} tokens of section 4's histogram ({name} trainer, before training), "
                     + figure(t))
    for r in _baseline_token_runs(data):
        t = t_interval([b for tok in r["tokens"] for b in tok["beta"] if b is not None])
        if t["n"] >= 2:
            parts.append(f"over the {t['n']} logged training tokens of {r.get('experiment') or 'run'} "
                         f"{r['name']}, " + figure(t))
    if not parts:
        return ""
    return ("β's sign. The seed reports a consistent negative bias (the trainer gives the sampled tokens lower "
            "log-probabilities than the engine did). Here, with 95% t intervals over tokens (tokens of one "
            "completion are not independent, so each interval is, if anything, too narrow): "
            + "; ".join(parts) + ".")


def _baseline_token_runs(data) -> list[dict]:
    """The baseline ('none') runs that logged per-token β and advantages: the data of the per-token α-β figure."""
    return [r for r in data.runs + data.fp8_runs if r.get("tokens")
            and (r.get("arm") or r["config"].get("intervention")) == "none"]


def beta_advantage(data) -> str:
    """The seed's 'β correlated with the advantage', tested on the tokens the per-token α-β figure draws from: every
    logged token of the baseline's runs ('none') whose advantage is not 0, Pearson's r with its Fisher interval."""
    runs = _baseline_token_runs(data)
    pairs = [(b, a) for r in runs for t in r["tokens"] for b, a in zip(t["beta"], t["advantage"])
             if b is not None and a]
    found = _pearson_interval([p[0] for p in pairs], [p[1] for p in pairs])
    if found is None:
        return ""
    r, low, high = found
    verdict = ("a detectable link, as the seed reports" if low > 0 or high < 0 else
               "no detectable link, where the seed found one")
    return (f"β and the advantage. Over the {len(pairs)} logged tokens of the baseline's {len(runs)} "
            f"run{'s' if len(runs) > 1 else ''} with a non-zero advantage, Pearson's r between β and the advantage "
            f"is {r:+.3f}, 95% interval [{low:+.3f}, {high:+.3f}] (Fisher's z; the tokens of one completion share "
            f"its advantage, so the interval is too narrow if anything): {verdict}.")


def _first_last(run: dict) -> tuple[int, float, float] | None:
    rows = [m for m in run["metrics"] if m.get("completion/length_mean") is not None]
    return (rows[-1]["step"], rows[0]["completion/length_mean"], rows[-1]["completion/length_mean"]) if rows else None


def stall_and_fixes(data) -> str:
    """The seed's run that never converges and the fixes that restore it, against the sanity experiment: whether
    the baseline's length fell from its first to its last step (paired by seed, a t interval), how many of its seeds
    converged, and per fix the arms that ended detectably shorter than the baseline (experiments.detected) and
    converged."""
    from ..maths.metrics import t_interval
    from ..training.experiments import detected
    from .interventions_table import and_join

    if not data.sanity:
        return ""
    summary = data.sanity[-1]
    arms = {a["run"]: a for a in summary["arms"]}
    base = arms.get(summary.get("baseline", "none"))
    ends = [e for r in data.runs if (r.get("arm") or r["config"].get("intervention")) == "none"
            for e in [_first_last(r)] if e]
    if base is None or not ends:
        return ""
    moved = t_interval([last - first for _, first, last in ends])
    fell = moved["n"] >= 2 and moved["high"] < 0
    text = (f"The stall. The seed's baseline never converges. Here the baseline's mean completion length went from "
            f"{sum(e[1] for e in ends) / len(ends):.1f} to {sum(e[2] for e in ends) / len(ends):.1f} tokens by step "
            f"{max(e[0] for e in ends)} (" + (f"by seed {moved['mean']:+.1f} [{moved['low']:+.1f}, "
                                               f"{moved['high']:+.1f}]" if moved["n"] >= 2 else "one seed") + "): "
            + ("it learns, it does not stall" if fell else "no detectable fall: a stall, as the seed's")
            + f"; {base['converged']} of {len(base['seeds'])} seeds converged.")

    def said(names) -> str:
        out = []
        for name in names:
            a = arms[name]
            d = (a.get("vs_baseline") or {}).get("final_length")
            shorter = bool(d and detected({"final_length": d}) and d["high"] < 0)
            out.append(f"{name} ({'ended shorter than the baseline' if shorter else 'no detectable difference'}, "
                       f"{a['converged']} of {len(a['seeds'])} seeds converged)")
        return and_join(out)

    precision = [a for a in PRECISION_ARMS if a in arms]
    clip = [a for a in CLIP_ARMS if a in arms]
    if precision:
        text += f" Precision matching, the seed's first fix: {said(precision)}."
    if clip:
        text += (" Taking β out of the clip (" + "; ".join(f"{a}: {CLIP_ARMS[a]}" for a in clip) + f"): {said(clip)}.")
    converged = [a for a in arms if arms[a]["converged"] == len(arms[a]["seeds"]) and arms[a]["converged"]]
    if converged:
        text += (f" Every seed converged only under {and_join(converged)}"
                 + ("; no precision-matching arm converged, where the seed reports that matching fixes the run."
                    if precision and not set(precision) & set(converged) else "."))
    return text


def phantom_share(data) -> str:
    """The seed's ~18% of tokens phantom-clipped early, against the baseline's phantom-clip rate (the share of all
    tokens; the sanity summary's mean over seeds and its 95% t interval)."""
    if not data.sanity:
        return ""
    summary = data.sanity[-1]
    base = next((a for a in summary["arms"] if a["run"] == summary.get("baseline", "none")), None)
    rate = (base or {}).get("phantom_rate") or {}
    if not isinstance(rate.get("mean"), (int, float)):
        return ""
    bounds = (f" [{100 * rate['low']:.2f}%, {100 * rate['high']:.2f}%]"
              if all(isinstance(rate.get(k), (int, float)) for k in ("low", "high")) and rate.get("n", 0) >= 2
              else "")
    return (f"Phantom clipping. The seed: about {100 * SEED_PHANTOM_SHARE:.0f}% of tokens early in training. Here the "
            f"baseline phantom-clips {100 * rate['mean']:.2f}% of all tokens{bounds} over {len(base['seeds'])} "
            f"seed{'s' if len(base['seeds']) != 1 else ''}: " + ("far fewer" if rate["mean"] < SEED_PHANTOM_SHARE / 2
                                                                  else "of the same order") + ".")


def seed_compared(data) -> str:
    """The closing section's sentences, each computed from the data on the page ('' where its data is missing)."""
    return " ".join(t for t in (beta_bias(data), beta_advantage(data), phantom_share(data), stall_and_fixes(data))
                    if t)
