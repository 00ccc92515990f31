"""What `diagnose` says and prints: the verdict paragraph and the tables, read from the result dict alone.

`diagnose.run_diagnose` measures and returns figures; this surface module turns them into words (`verdict`,
`with_verdict`) and terminal tables (`render_diagnose`). It reads nothing but the dict (a JSON file written earlier
renders the same), so the wording can change without touching the measurement. Figures: docs/metrics.md.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rich.markup import escape

from .answer import answer, answer_lines, bound, engine_label, epsilon_advice, ranking, region_text, user_recipe
from .fp8_text import QUANT_CELLS, fp8_lines, fp8_split_head, split_title
from .frameworks import THRESHOLDS, judge
from .metrics import HIGH_P, LOW_P
from .numerics import parse_dtype
from .recipes import engine_recipe, get_recipe
from .routing_text import routing_lines

if TYPE_CHECKING:
    from rich.console import Console

ANTI_CORRELATED = -0.3
"""a correlation of β_precision and β_kernel below this is told as anti-correlation: 0.3 is Cohen's (1988) "medium"
effect size for r; a weaker one says little about whether the shadow shares the engine's rounding."""
SMALL_GAIN = 0.8
"""a lever that would leave more than this share of today's mean |β| is told as shrinking the gap "only a little":
removing less than a fifth of β is not worth a change of recipe or kernels (a judgement, not a measured bound)."""
SAME_GAP_SPREAD = 1.25
"""recipes whose mean |β| lie within this factor of each other (25%) are told as one gap: no recipe is then a lever
worth a change, β is the engine's own rounding noise (a judgement, the same scale as SMALL_GAIN's fifth)."""


def with_verdict(result: dict) -> dict:
    """`result` with its 'answer' block (answer.py: status and changes, the first lines printed) and its 'verdict'
    paragraph (the long explanation) added: the keys the JSON output and `render_diagnose` read."""
    result["answer"] = answer(result)
    result["verdict"] = verdict(result)
    return result


def verdict(result: dict) -> str:
    """One paragraph about the user's recipe (the first measured): how it compares with the best measured one
    (answer.ranking), what its figures mean for PPO clipping, and what to change (answer.epsilon_advice)."""
    recs = result["recipes"]
    eng = result["engine"]["dtype"]
    usable = {k: v for k, v in recs.items() if v["tokens"] > 0}
    engine_missing = result["engine"].get("nonfinite_logprobs", 0)
    if not usable:
        lost = max([engine_missing, *(v.get("nonfinite", 0) for v in recs.values())])
        if lost:  # tokens were sampled, but no recipe has a finite log-prob for any of them
            return (f"No β could be measured: {lost} completion tokens were sampled but their log-probs are not finite "
                    "(NaN or inf) in the engine or in every trainer recipe. The weights hold NaN/inf, or the dtype "
                    "overflows: check the model, or try a wider engine dtype (bf16 or fp32).")
        return "No completion tokens were scored: raise --max-tokens or --n."

    def overflow(k: str) -> int:  # the recipe's own non-finite log-probs, not the tokens the engine left without one
        return recs[k]["nonfinite"] - engine_missing

    region = region_text(result)
    best, mine = ranking(result)[0], user_recipe(result)
    b = usable[best]
    parts = [
        f"Fewest tokens outside {region} against the {eng} engine: {best} ({100 * b['outside_trust_region']:.2f}%, "
        f"mean |β| {b['beta_abs_mean']:.4f})."
    ]
    w = usable.get(mine)
    if w is not None and w["outside_trust_region"] > 0:
        parts.append(
            f"With your {mine} trainer, {100 * w['outside_trust_region']:.2f}% of tokens leave the trust region before "
            f"the policy has moved ({100 * w['outside_below']:.2f}% below, {100 * w['outside_above']:.2f}% above): "
            f"in PPO/GRPO each of them gets zero gradient whenever its advantage has the matching sign (phantom "
            f"clipping)"
            + (f", and low-probability tokens (p < {LOW_P:g}) carry {w['lowp_highp_ratio']:.1f}x the |β| of confident "
               f"ones (p > {HIGH_P:g})." if math.isfinite(w["lowp_highp_ratio"]) else ".")
        )
        parts.append(_advice(result, usable, best))
    elif w is not None:
        parts.append(f"Your {mine} trainer pushes no measured token outside the trust region {region}: precision "
                     "alone will not cause phantom clipping here.")
    # The split and the truncation bias are told for the user's recipe (for the shadow recipe, whose precision part
    # is zero by definition, the split says all of the gap is kernels).
    told = mine if mine in usable else next(iter(usable))
    parts += [_split_verdict(result, told), _batch_verdict(result, told), _truncation_verdict(result, told),
              _drift_verdict(result)]
    if engine_missing:
        parts.append(f"The engine returned no finite log-prob for {engine_missing} sampled tokens; "
                     "they are left out of every figure.")
    bad = [k for k in recs if overflow(k) > 0]
    if bad:
        listed = ", ".join(f"{k} ({overflow(k)})" for k in bad)
        parts.append(f"Non-finite log-probs (overflow) in: {listed}.")
    return " ".join(p for p in parts if p)


def _kernels(kind: str) -> str:
    """How an engine of this kind computes differently from the trainer's one-pass forward in the same dtype."""
    return "one prefill pass against token-by-token decode" if kind == "local" else f"{kind}'s own kernels and decode"


def _split_verdict(result: dict, name: str) -> str:
    """Which lever is bigger for recipe `name`: matching the precision leaves β_kernel, matching the kernels
    leaves β_precision; compare what each leaves with the gap now."""
    split = result["recipes"][name].get("split")
    if not split:
        return ""
    now = result["recipes"][name]["beta_abs_mean"]
    prec, kern = split["precision"]["beta_abs_mean"], split["kernel"]["beta_abs_mean"]
    shadow, eng = result["shadow"]["recipe"], result["engine"]
    what = _kernels(eng["kind"])
    if result.get("fp8") and "quant" in split:  # an FP8 engine: β = β_precision + β_quant + β_kernel (diagnose_fp8)
        head, prec = fp8_split_head(result, name, now, split, what)
    else:
        head = (f"β = β_precision + β_kernel: for {name} (mean |β| {now:.4f}), β_precision ({name} against its own "
                f"{shadow} forward) has mean |·| {prec:.4f} and β_kernel (that {shadow} forward against the "
                f"{eng['dtype']} engine: {what}) {kern:.4f}.")
    if prec == 0:
        return head + f" {name} already matches the engine's precision: all of its gap is kernels."
    corr = split.get("correlation")
    if corr is not None and math.isfinite(corr) and corr < ANTI_CORRELATED:
        head += (f" The parts are anti-correlated ({corr:.2f}): the {shadow} forward's own rounding enters both with "
                 f"opposite signs, i.e. it does not share the engine's rounding.")
    left = {"matching the precision": kern, "matching the kernels": prec}
    lever = min(left, key=left.get)
    other = next(k for k in left if k != lever)
    if round(left[lever], 4) >= round(now, 4):  # compared as printed: "0.0352 -> 0.0352" shrinks nothing
        return head + (f" Neither lever alone shrinks the gap ({lever} would leave {left[lever]:.4f}, {other} "
                       f"{left[other]:.4f}): tolerate or correct β instead.")
    worse = ", more than now" if left[other] > now else ""
    rest = f"{other} alone would leave {left[other]:.4f}{worse}"
    lever_cap = lever[0].upper() + lever[1:]
    if left[lever] > SMALL_GAIN * now:
        return head + (f" {lever_cap} would shrink it only a little (mean |β| {now:.4f} -> "
                       f"{left[lever]:.4f}) and {rest}: tolerate or correct β instead.")
    return head + f" {lever_cap} is the bigger lever (mean |β| {now:.4f} -> {left[lever]:.4f}); {rest}."


def _as_float(v) -> float:
    """A figure as a float: JSON null (NaN written out) reads as NaN."""
    return math.nan if v is None else float(v)


def _batch_verdict(result: dict, name: str) -> str:
    """One sentence when batch layout alone (recipe `name` in the run's batch against the same sequences scored one
    at a time) puts more tokens outside the trust region than β_precision does."""
    split = result["recipes"][name].get("split", {})
    if "batch" not in split:
        return ""
    batch = _as_float(split["batch"]["outside_trust_region"])
    prec = _as_float(split["precision"]["outside_trust_region"])
    if not batch > prec:  # NaN (no token scored alone) says nothing
        return ""
    return (f"Batch layout alone puts {100 * batch:.2f}% of {name}'s tokens outside the trust region ({name} in the "
            f"run's padded batch of {result['config']['batch_size']} against the same sequences scored one at a "
            f"time), more than β_precision does ({100 * prec:.2f}%): the trainer's micro-batch layout moves the ratio "
            f"more than its precision; batch-invariant kernels, or one layout on both sides, remove that part.")


def _truncation_verdict(result: dict, name: str) -> str:
    """What top-p / top-k / min-p do to recipe `name`'s ratio against the engine's processed log-probs."""
    trunc = result["recipes"][name].get("truncation")
    if not trunc:
        return ""
    c = result["config"]
    rule = ", ".join(f"{k} {c[k]:g}" for k in ("top_p", "top_k", "min_p") if (c[k] != 1 if k == "top_p" else c[k] > 0))
    rebuilt = result["engine"].get("rebuilt_column") == "logp_engine_processed"
    return (f"Truncated sampling ({rule}): the processed log-probs are renormalised over the kept tokens, so a "
            f"ratio against them carries log S (mean {trunc['log_kept_mean']:.4f}, kept mass ≥ "
            f"{trunc['kept_mass_p10']:.2f} for 90% of tokens); for {name} that pushes {100 * trunc['pushed_out']:.2f}% "
            f"of tokens out of the trust region ({100 * trunc['naive']['outside_trust_region']:.2f}% outside in all). "
            f"Renormalising the trainer's log-probs over its own kept set (logp − log S) brings it to "
            f"{100 * trunc['corrected']['outside_trust_region']:.2f}%"
            + (f" (the engine's processed log-probs rebuilt from the {result['shadow']['recipe']} shadow's S: vLLM "
               "reported raw ones)." if rebuilt else "."))


def _drift_verdict(result: dict) -> str:
    """One sentence on --drift: an engine whose log-probs move under unchanged weights is defective (every β above
    carries the defect, and no trainer recipe removes it); one that stays put is said to, with how it was read."""
    d = result.get("drift")
    if not d:
        return ""
    e = result["engine"]
    if not d["moving"]:
        return (f"Drift: {d['syncs']} pushes of unchanged weights left the {e['dtype']} {e['kind']} engine's log-probs "
                f"of the same {d['tokens']} tokens bit-identical ({DRIFT_METHODS[d['method']]}).")
    first = next(s for s in d["steps"] if s["max_abs"] > 0 or s["changed_share"] > 0 or s["token_changed_share"] > 0)
    tokens = (f", {100 * d['token_changed_share']:.2f}% of sampled tokens differ" if d["token_changed_share"] else "")
    return (f"Engine defect: the same weights pushed {d['syncs']} times into the {e['dtype']} {e['kind']} engine moved "
            f"its log-probs of the same tokens (from push {first['sync']}; max |Δ| {fmt_figure(d['max_abs'])}, "
            f"{100 * d['changed_share']:.2f}% of tokens changed{tokens}; {DRIFT_METHODS[d['method']]}). Every β above "
            "carries this and no trainer recipe removes it: check the engine's weight sync (every parameter group, "
            "tied embeddings, cached prefixes).")


DRIFT_METHODS = {"rescore": "the fixed tokens teacher-forced through its decode path after each push",
                 "resample": "the same prompts re-sampled with the same seeds after each push"}
"""how --drift read the tokens again (engines/drift.py), as the verdict and the printed block say it."""


def epsilon_words(result: dict) -> str:
    """The ε advice (answer.epsilon_advice, the one rule) as words: the ε to set, or that the current one suffices."""
    eps = epsilon_advice(result.get("knobs"))
    if eps is None:
        keep = (result.get("knobs") or {}).get("keep_share")
        return (f"the current ε already keeps {100 * keep:g}% of tokens inside" if keep is not None
                else "no ε advice (a result without the knob figures)")
    return (f"ε_low {eps['epsilon_low']:g}, ε_high {eps['epsilon_high']:g} keep {100 * eps['keep_share']:g}% of "
            "tokens inside")


def _advice(result: dict, recs: dict[str, dict], best: str) -> str:
    """What to change, from the figures: is a trainer recipe the lever, or is β the engine's own noise?"""
    eng, kind = result["engine"]["dtype"], result["engine"]["kind"]
    widen = epsilon_words(result)
    tolerate = (f"so the clip must tolerate it: widen ε ({widen}), correct with importance sampling (TIS/MIS), "
                f"or sample in a wider dtype (compare --engine-dtype fp16 or fp32).")
    gaps = [v["beta_abs_mean"] for v in recs.values()]
    spread = max(gaps) / min(gaps) if min(gaps) > 0 else math.inf
    same = engine_recipe(parse_dtype(eng)).name
    same = same if same in recs else None
    if len(recs) > 1 and spread < SAME_GAP_SPREAD:
        why = f", {same} included (the engine's own dtype, with other kernels: {_kernels(kind)})" if same else ""
        return (f"No trainer recipe removes the gap: all {len(recs)} are within {100 * (spread - 1):.0f}% of each "
                f"other{why}. β here is the {eng} engine's rounding noise, amplified through the network, " + tolerate)
    if best == user_recipe(result):
        return (f"{best} is already the best measured recipe: compute the clip ratio from a {eng} shadow forward, or "
                f"widen ε ({widen}).")
    if get_recipe(best).compute_dtype == parse_dtype(eng):
        return (f"Change: train with {best}, which matches the engine's {eng} arithmetic; else compute the clip "
                f"ratio from a {eng} shadow forward, or widen ε ({widen}).")
    return f"Change: train with {best}; or compute the clip ratio from a {eng} shadow forward, or widen ε ({widen})."


# ------------------------------------------------------------------------------------------- rendering

GLOSSARY_LINE = "terms (β, α, β_kernel, shadow, TIS, MIS, IcePop, GSPO, nats): docs/metrics.md#glossary"
"""the last printed line: where every term of the output is defined."""
TOKEN_COLUMNS = ["tokens", "nonfinite", "beta_mean", "beta_abs_mean", "beta_abs_p50", "beta_abs_p90", "beta_abs_p99",
                 "beta_abs_max", "outside_trust_region", "outside_below", "outside_above"]
SHAPE_COLUMNS = ["beta_abs_mean_lowp", "beta_abs_mean_highp", "lowp_highp_ratio", "seq_logratio_mean",
                 "seq_product_ratio_median", "seq_geo_ratio_mean", "seq_mask_drop_share", "kl_k1", "kl_k2", "kl_k3",
                 "chi2", "ess_token", "ess_seq"]
PERCENT = {"outside_trust_region", "outside_below", "outside_above", "seq_mask_drop_share"}
SPLIT_CELLS = {"precision |β|": ("split", "precision", "beta_abs_mean"),
               "kernel |β|": ("split", "kernel", "beta_abs_mean"),
               "precision out": ("split", "precision", "outside_trust_region"),
               "kernel out": ("split", "kernel", "outside_trust_region")}
"""the split table's columns: the path to each figure inside a recipe's result."""
BATCH_CELLS = {"batch |β|": ("split", "batch", "beta_abs_mean"),
               "batch out": ("split", "batch", "outside_trust_region")}
"""the split table's further columns when rows were scored alone (split.batch: the run's batch against micro-batch
1)."""
TRUNCATION_CELLS = {"mean log S": ("truncation", "log_kept_mean"), "pushed out": ("truncation", "pushed_out"),
                    "naive out": ("truncation", "naive", "outside_trust_region"),
                    "corrected out": ("truncation", "corrected", "outside_trust_region")}
"""the split table's further columns when sampling truncated."""
LABEL_WIDTH, CELL_WIDTH = 16, 14
"""terminal columns a row label and a figure take: a table wider than the terminal is printed transposed."""
FIXED_FROM = 1e-2
"""figures of this size or more print as 3 significant digits, smaller ones in scientific notation."""
FRAMEWORK_HEADLINE = {
    "trl": "sampling/sampling_logp_difference/mean",
    "verl": "training/rollout_probs_diff_mean",
    "nemo-rl": "token_mult_prob_error",
    "slime": "train_rollout_logprob_abs_diff",
    "skyrl": "policy/rollout_train_logprobs_abs_diff_mean",
    "prime-rl": "mismatch_kl/all/mean",
    "openrlhf": "vllm_kl",
}
"""each framework's figure the printed table always shows (its mean mismatch, the one its docs and users watch);
the table adds every figure with a published bound (frameworks.THRESHOLDS), the JSON holds them all."""


def _fmt(key: str, v) -> str:
    if isinstance(v, int):
        return str(v)
    if v is None or not math.isfinite(v):
        return "n/a"
    if key in PERCENT:
        return f"{100 * v:.2f}%"
    return f"{v:.3g}" if abs(v) >= FIXED_FROM or v == 0 else f"{v:.1e}"


def _table(title: str, rows: list[str], cols: list[str], cell):
    from rich import box
    from rich.table import Table

    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    table.add_column("", style="bold", no_wrap=True)  # a figure name or a recipe, whole (at most 24 characters)
    for c in cols:
        table.add_column(c, justify="right", overflow="fold", min_width=8)
    for r in rows:
        table.add_row(r, *(cell(r, c) for c in cols))
    return table


def _measured_line(result: dict) -> str:
    """What was measured: the model, the completions and tokens, the engine as measured, the trust region."""
    e = result["engine"]
    label = engine_label(e, (result.get("fp8") or {}).get("engine_recipe"))
    if e["kind"] == "recorded":
        how = f"{e['logprobs']} log-probs from {e['file']}" + (f", {e['recorded_at']}" if e["recorded_at"] else "")
        done = f"{e['tokens']} tokens sampled by a {label} ({how})"
    else:
        how = (f"{e['matmul']} matmul" if e["kind"] == "local"
               else f"{e['logprobs_mode']} log-probs, started in {e['startup_seconds']:.0f} s")
        done = f"{e['tokens']} tokens sampled by a {label} ({how}, {e['tokens_per_s']:.0f} tok/s)"
    tr = result["trust_region"]
    return (f"{result['model']['name']}: {e['sequences']} completions, {done}; ε_low={tr['epsilon_low']:g}, "
            f"ε_high={tr['epsilon_high']:g}")


def _machine_line(result: dict) -> str:
    """The machine the recipes were scored on (the kernels decide the figures: every run names it): the GPU where
    the run used one, else the CPU and the low-precision kernels it picked."""
    dev = result.get("device") or {}
    if dev.get("name", "cpu") != "cpu":
        return (f"device: {dev['name']} (capability {dev['capability']}, torch {dev['torch']}, CUDA {dev['cuda']}); "
                "matmul: cuBLAS")
    cpu = result.get("cpu")
    if not cpu:
        return ""
    has = ", ".join(f"{d} {'yes' if ok else 'no'}" for d, ok in cpu["native"].items())
    picked = ", ".join(f"{d} {k}" for d, k in cpu["kernels"].items())
    return f"CPU: {cpu['model']} (native low-precision matmul: {has}); kernels: {picked}"


def render_diagnose(result: dict, console: Console) -> None:
    """Print the figures and the verdict: one row per recipe on a wide terminal, one row per figure otherwise."""
    for line in answer_lines(result.get("answer") or answer(result)):  # the answer first; a bare result too
        console.print(line, markup=False)
    console.print()
    console.print("[bold]phantomclip diagnose[/] " + escape(_measured_line(result)))
    for note in result["engine"].get("notes") or []:
        console.print(f"note: {note}", markup=False)
    console.print(_machine_line(result), markup=False)
    recs = result["recipes"]
    titles = ("β = logp − logp_engine per token, at α = 0",
              "where β lives: probability buckets, sequences, divergences")
    for title, cols in zip(titles, (TOKEN_COLUMNS, SHAPE_COLUMNS)):
        if console.width >= LABEL_WIDTH + CELL_WIDTH * len(cols):
            console.print(_table(title, list(recs), cols, lambda r, c: _fmt(c, recs[r][c])))
        else:
            console.print(_table(title, cols, list(recs), lambda c, r: _fmt(c, recs[r][c])))
    truncated = any("truncation" in r for r in recs.values())
    batched = any("batch" in r.get("split", {}) for r in recs.values())
    split = (SPLIT_CELLS | (QUANT_CELLS if result.get("fp8") else {}) | (BATCH_CELLS if batched else {})
             | (TRUNCATION_CELLS if truncated else {}))

    def cell(r: str, c: str) -> str:
        v = recs[r]
        for key in split[c]:
            v = v.get(key) if isinstance(v, dict) else None  # a recipe without the part: n/a
        return _fmt("outside_trust_region" if c.endswith("out") else c, v)

    title = (split_title(result)
             + ("; β_batch (the run's batch vs one sequence at a time)" if batched else "")
             + ("; truncation bias log S" if truncated else ""))
    console.print(_table(title, list(recs), list(split), cell))
    if "frameworks" in next(iter(recs.values()), {}):  # a JSON written before the framework figures has none
        console.print(_framework_rich_table(result))
        console.print()
    if "knobs" in result:  # a JSON written before the knob advice has none
        knobs = result["knobs"]
        console.print(f"[bold]for your config[/] ({knobs['recipe']} trainer's β; every figure: JSON knobs):")
        for line in knob_lines(knobs):
            console.print("  " + line, markup=False)
        console.print()
    for lines in optional_blocks(result):
        for line in lines:
            console.print(line, markup=False)
        console.print()
    console.print(f"[bold]verdict:[/] {result.get('verdict') or verdict(result)}")  # a bare run_diagnose result too
    console.print(GLOSSARY_LINE, markup=False)


def optional_blocks(result: dict) -> list[list[str]]:
    """The blocks a run has only with some settings, in print order: --drift, an FP8 engine (--engine-quant,
    fp8_text.py), an MoE model's route table (routing_text.py), a post-mortem's rows (postmortem_text.py)."""
    from .postmortem_text import postmortem_lines

    makers = {"drift": lambda: drift_lines(result["drift"]), "fp8": lambda: fp8_lines(result),
              "routing": lambda: routing_lines(result), "postmortem": lambda: postmortem_lines(result)}
    return [make() for key, make in makers.items() if key in result]


def framework_rows(result: dict) -> list[tuple[str, str, float | None, str | None, str]]:
    """(framework, figure, value, published threshold, verdict) for the first trainer recipe (the user's): each
    framework's headline figure and every figure with a published bound, in the JSON's order."""
    figs = next(iter(result["recipes"].values()))["frameworks"]
    return [(fw, figure, value, *judge(fw, figure, value))
            for fw, by_figure in figs.items() for figure, value in by_figure.items()
            if figure == FRAMEWORK_HEADLINE.get(fw) or (fw, figure) in THRESHOLDS]


def fmt_figure(v: float | None) -> str:
    """4 significant digits (a bound such as NeMo-RL's 1.05 needs the third decimal), scientific below FIXED_FROM."""
    if v is None or not math.isfinite(v):
        return "n/a"
    return f"{v:.4g}" if abs(v) >= FIXED_FROM or v == 0 else f"{v:.2e}"


def _framework_rich_table(result: dict):
    from rich import box
    from rich.table import Table

    recipe = next(iter(result["recipes"]))
    table = Table(title=f"what each framework would log: {recipe} trainer against the {result['engine']['dtype']} "
                  f"engine (every figure: JSON recipes.{recipe}.frameworks)",
                  title_justify="left", box=box.SIMPLE_HEAD, padding=0, show_edge=False)
    # figure names run to 43 characters: one space between columns (the box's) and a two-line header fit 80 columns
    for name, justify in (("framework", "left"), ("figure", "left"), ("value", "right"),
                          ("published\nthreshold", "right"), ("verdict", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    for fw, figure, value, threshold, verdict_ in framework_rows(result):
        table.add_row(fw, figure, fmt_figure(value), threshold or "-",
                      "[bold red]over[/]" if verdict_ == "over" else verdict_)
    return table


KNOB_LABELS = {"clip": "PPO clip", "token_truncate": "TIS (token_truncate)", "token_mask": "token_mask",
               "sequence_mask": "sequence_mask", "geo_mask": "geo-mean mask (GSPO)", "icepop": "IcePop"}
"""the knobs of the "for your config" block, in print order, with their labels (keys of the JSON's knobs)."""
KNOB_VERBS = {"clip": "clips", "token_truncate": "truncates"}
"""what a knob does to what it touches; the others drop it."""


def _bound(x, up: bool) -> str:
    """x to 3 significant digits, rounded up (a lower bound on a setting, '≥') or down ('≤'), so the printed setting
    still does what the line says; n/a for NaN or null."""
    return "n/a" if x is None or math.isnan(x) else f"{bound(x, up):g}"


def _knob_now(setting: dict) -> str:
    """A knob's current setting as the user writes it."""
    if "cap" in setting:
        return f"C = {setting['cap']:g}"
    if "low" in setting:
        return f"[{setting['low']:g}, {setting['high']:g}]"
    return f"ε {setting['epsilon_low']:g}/{setting['epsilon_high']:g}"


def _knob_advice(keep: dict) -> str:
    """The advised setting as inequalities, each bound rounded so that it still holds."""
    if "cap" in keep:
        return f"C ≥ {_bound(keep['cap'], True)}"
    if "low" in keep:
        return f"low ≤ {_bound(keep['low'], False)}, high ≥ {_bound(keep['high'], True)}"
    return f"ε_low ≥ {_bound(keep['epsilon_low'], True)}, ε_high ≥ {_bound(keep['epsilon_high'], True)}"


def knob_lines(knobs: dict) -> list[str]:
    """One line per knob of a result's `knobs` block: its current setting -> what it touches; the setting that
    leaves `keep_share` untouched. Sequence figures extrapolated to the target length say so."""
    keep = f"{100 * knobs['keep_share']:g}%"
    n = knobs["length"]["target"]
    pct = lambda v: _fmt("outside_trust_region", _as_float(v))  # noqa: E731 (a share, as the tables print it)
    lines = []
    for name, label in KNOB_LABELS.items():
        k = knobs.get(name)
        if k is None:
            continue
        at, verb = k.get("at_length"), KNOB_VERBS.get(name, "drops")
        longer = f"; {pct(at['sequences'])} of {n}-token ones (extrapolated)" if at else ""
        if name == "clip":  # the one ε rule (answer.epsilon_advice): never narrower than the current ε
            eps = epsilon_advice(knobs)
            touched = f"{verb} {pct(k['tokens'])} of tokens, {pct(k['sequences'])} of sequences{longer}"
            advice = (f"ε already leaves {keep} of tokens untouched" if eps is None else
                      f"ε_low ≥ {eps['epsilon_low']:g}, ε_high ≥ {eps['epsilon_high']:g} for {keep} of tokens "
                      "untouched")
        elif k["unit"] == "token":
            touched = f"{verb} {pct(k['tokens'])} of tokens, {pct(k['sequences'])} of sequences{longer}"
            advice = f"{_knob_advice(k['keep'])} for {keep} of tokens untouched"
        else:
            touched = f"{verb} {pct(k['sequences'])} of sequences ({pct(k['tokens'])} of tokens){longer}"
            advice = (f"{_knob_advice(at['keep'])} for {keep} of {n}-token sequences untouched (extrapolated)" if at
                      else f"{_knob_advice(k['keep'])} for {keep} of sequences untouched")
        lines.append(f"{label} {_knob_now(k['setting'])}: {touched} -> {advice}")
    return lines


def drift_lines(drift: dict) -> list[str]:
    """The printed --drift block: a heading with its cost, then one line per push (the JSON's `drift`)."""
    pct = lambda v: _fmt("outside_trust_region", _as_float(v))  # noqa: E731 (a share, as the tables print it)
    head = (f"drift: {drift['syncs']} pushes of unchanged weights, {drift['sequences']} sequences ({drift['tokens']} "
            f"tokens) read by {drift['method']}; cost {drift['seconds']:.1f} s; "
            + ("MOVING: engine defect" if drift["moving"] else "no movement"))
    lines = [head]
    for s in drift["steps"]:
        max_abs = fmt_figure(_as_float(s["max_abs"]))
        lines.append(f"  push {s['sync']}: max |Δ logp| {max_abs}, {pct(s['changed_share'])} "
                     f"of tokens changed, {pct(s['token_changed_share'])} of sampled tokens differ; weights changed "
                     f"{pct(s['weights_changed_share'])}; {s['seconds']:.2f} s")
    return lines
