"""What `diagnose` prints: the answer first, the tables, the knob advice and the verdict, read from the result dict
alone.

`diagnose.run_diagnose` measures and returns figures; this surface module adds the words (`with_verdict`:
answer/decide.py's block and answer/verdict_text.py's paragraph) and prints terminal tables (`render_diagnose`). It
reads nothing but the dict (a JSON file written earlier renders the same), so the wording can change without touching
the measurement. Figures: docs/metrics.md.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rich.markup import escape

from ..answer.changes import bound, epsilon_advice
from ..answer.decide import answer, answer_lines, measured_engine
from ..answer.fp8_text import QUANT_CELLS, fp8_lines, split_title
from ..answer.verdict_text import FIXED_FROM, as_float, fmt_figure, verdict
from ..maths.frameworks import THRESHOLDS, judge
from ..routing.text import routing_lines

if TYPE_CHECKING:
    from rich.console import Console


def with_verdict(result: dict) -> dict:
    """`result` with its 'answer' block (answer/decide.py: status and changes, the first lines printed) and its
    'verdict' paragraph (the long explanation) added: the keys the JSON output and `render_diagnose` read."""
    result["answer"] = answer(result)
    result["verdict"] = verdict(result)
    return result


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
    label = measured_engine(result)
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
        mean = as_float(knobs["length"].get("sampled_mean"))
        sampled = f" on the sampled completions, mean {mean:.0f} tokens" if math.isfinite(mean) else ""
        console.print(f"[bold]for your config[/] ({knobs['recipe']} trainer's β{sampled}; every figure: JSON knobs):")
        for line in knob_lines(knobs):
            console.print("  " + line, markup=False)
        console.print()
    for lines in optional_blocks(result):
        for line in lines:
            console.print(line, markup=False)
        console.print()
    # the verdict quotes what a file said (its engine's name): printed as text, never as markup
    console.print("[bold]verdict:[/] " + escape(result.get("verdict") or verdict(result)))  # a bare result too
    console.print(GLOSSARY_LINE, markup=False)


def optional_blocks(result: dict) -> list[list[str]]:
    """The blocks a run has only with some settings, in print order: --drift, an FP8 engine (--engine-quant,
    answer/fp8_text.py), an MoE model's route table (routing/text.py), records that carry the trainer's own
    log-probs (`recorded_trainer_lines`), a post-mortem's rows (diagnose/postmortem_text.py)."""
    from .postmortem_text import postmortem_lines

    makers = {"drift": lambda: drift_lines(result["drift"]), "fp8": lambda: fp8_lines(result),
              "routing": lambda: routing_lines(result), "recorded_trainer": lambda: recorded_trainer_lines(result),
              "postmortem": lambda: postmortem_lines(result)}
    return [make() for key, make in makers.items() if key in result]


def recorded_trainer_lines(result: dict) -> list[str]:
    """The printed block of records that carry the user's trainer's own log-probs (the JSON's recorded_trainer): β as
    that trainer computed it, then per recipe our re-score's β and the gap between the two trainers' log-probs."""
    t, pct = result["recorded_trainer"], lambda v: _fmt("outside_trust_region", as_float(v))  # noqa: E731
    num = lambda v: _fmt("beta_abs_mean", as_float(v))  # noqa: E731 (a figure, as the tables print it)
    b, of = t["beta"], t["tokens_of_run"]
    lines = [f"your trainer's own log-probs, recorded with the tokens ({t['source'] or 'the file'}): {b['tokens']} "
             f"tokens{'' if b['tokens'] == of else f' of {of}'} (every figure: JSON recorded_trainer)",
             f"  β as your trainer computed it (its log-probs − the engine's): mean |β| {num(b['beta_abs_mean'])}, "
             f"max {num(b['beta_abs_max'])}, outside the trust region {pct(b['outside_trust_region'])}"]
    for name, g in t["gap"].items():
        r = result["recipes"][name]
        lines.append(f"  {name} re-scored here: mean |β| {num(r['beta_abs_mean'])}, outside "
                     f"{pct(r['outside_trust_region'])}{'' if b['tokens'] == of else f' (all {of} tokens)'}; your "
                     f"trainer − this re-score: mean |Δ| {num(g['abs_mean'])}, max |Δ| {num(g['abs_max'])}")
    return lines


def framework_rows(result: dict) -> list[tuple[str, str, float | None, str | None, str]]:
    """(framework, figure, value, published threshold, verdict) for the first trainer recipe (the user's): each
    framework's headline figure and every figure with a published bound, in the JSON's order."""
    figs = next(iter(result["recipes"].values()))["frameworks"]
    return [(fw, figure, value, *judge(fw, figure, value))
            for fw, by_figure in figs.items() for figure, value in by_figure.items()
            if figure == FRAMEWORK_HEADLINE.get(fw) or (fw, figure) in THRESHOLDS]


def _framework_rich_table(result: dict):
    from rich import box
    from rich.table import Table

    recipe = next(iter(result["recipes"]))
    table = Table(title=escape(f"what each framework would log: {recipe} trainer against the "  # a file's words
                               f"{measured_engine(result)} (every figure: JSON recipes.{recipe}.frameworks)"),
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
    leaves `keep_share` untouched. A sequence knob's setting names its length: the sampled one (measured), and the
    target length where the figures were extrapolated to it (they say so)."""
    keep = f"{100 * knobs['keep_share']:g}%"
    n, mean = knobs["length"]["target"], as_float(knobs["length"].get("sampled_mean"))
    sampled = f" at the sampled length (mean {mean:.0f} tokens)" if math.isfinite(mean) else ""
    pct = lambda v: _fmt("outside_trust_region", as_float(v))  # noqa: E731 (a share, as the tables print it)
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
        else:  # both lengths named: the measured setting at the sampled length, the extrapolated one at n
            touched = f"{verb} {pct(k['sequences'])} of sequences ({pct(k['tokens'])} of tokens){longer}"
            advice = f"{_knob_advice(k['keep'])} for {keep} of sequences untouched{sampled}" + (
                f"; {_knob_advice(at['keep'])} for {keep} of {n}-token ones (extrapolated)" if at else "")
        lines.append(f"{label} {_knob_now(k['setting'])}: {touched} -> {advice}")
    return lines


def drift_lines(drift: dict) -> list[str]:
    """The printed --drift block: a heading with its cost, then one line per push (the JSON's `drift`)."""
    pct = lambda v: _fmt("outside_trust_region", as_float(v))  # noqa: E731 (a share, as the tables print it)
    head = (f"drift: {drift['syncs']} pushes of unchanged weights, {drift['sequences']} sequences ({drift['tokens']} "
            f"tokens) read by {drift['method']}; cost {drift['seconds']:.1f} s; "
            + ("MOVING: engine defect" if drift["moving"] else "no movement"))
    lines = [head]
    for s in drift["steps"]:
        max_abs = fmt_figure(as_float(s["max_abs"]))
        lines.append(f"  push {s['sync']}: max |Δ logp| {max_abs}, {pct(s['changed_share'])} "
                     f"of tokens changed, {pct(s['token_changed_share'])} of sampled tokens differ; weights changed "
                     f"{pct(s['weights_changed_share'])}; {s['seconds']:.2f} s")
    return lines
