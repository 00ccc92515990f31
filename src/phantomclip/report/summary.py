"""The page's words that come from the data rather than from article.md: the source line under every figure (which
file, which engine, which model, which machine) and the summary at the top ("In short", up to four lines).

Every number here is read from the files at build time: with other data the summary says other things, and a line
whose data is missing is left out rather than filled with the demo's numbers. Paths are shown relative to the
directory given to --from (or as a bare file name), never as this machine's absolute path.
"""

from __future__ import annotations

from pathlib import Path

from ..answer.decide import measured_engine
from ..models.load import BUNDLED_NAME, BUNDLED_ORIGIN
from ..precision.fp8_layers import EMULATED
from .escape import html_text
from .interventions_table import finite, seed_values
from .prose import fp8_verdicts
from .seed_article import SEED_PHANTOM_SHARE


def short_path(path: str, roots: list[Path]) -> str:
    """`path` relative to the --from directory it was found under, else its last two parts."""
    p = Path(path)
    for root in roots:
        try:
            rel = p.relative_to(root)
        except ValueError:
            continue
        return f"{root.name}/{rel}" if str(rel) != "." else root.name
    return "/".join(p.parts[-2:])


def machine(doc: dict) -> str:
    """'CPU (AMD EPYC; bf16 emulated)' / 'GPU (NVIDIA H100, CUDA 12.8)' from what a file recorded of its machine."""
    device = doc.get("device") or {}
    if isinstance(device, dict) and str(device.get("device", "")).startswith("cuda"):
        return f"GPU ({device.get('name')}, CUDA {device.get('cuda')})"
    cpu = doc.get("cpu")
    if isinstance(cpu, dict):
        kernels = cpu.get("kernels", {})
        return f"CPU ({cpu.get('model')}; bf16 {kernels.get('bf16', '?')})"
    if isinstance(device, dict) and device.get("device"):
        return f"{str(device['device']).upper()} (torch {device.get('torch', '?')})"
    torch_version = str((doc.get("versions") or doc.get("config", {}).get("versions") or {}).get("torch", ""))
    if torch_version.endswith("+cpu"):
        return f"CPU (torch {torch_version})"
    return "machine not recorded"


def _diagnose_source(doc: dict, roots: list[Path]) -> str:
    """A diagnose file's data line; a post-mortem's counts the tokens of every recorded step the figure covers, with
    the last step's (its tables') beside them."""
    e = doc.get("engine", {})
    tokens = f"{e.get('tokens', '?')} tokens"
    steps = (doc.get("postmortem") or {}).get("steps") or []
    if len(steps) > 1 and all(isinstance(r.get("tokens"), int) for r in steps):
        tokens = (f"{sum(r['tokens'] for r in steps)} tokens over {len(steps)} recorded steps (step "
                  f"{steps[-1]['step']}'s tables: {steps[-1]['tokens']})")
    return (f"{short_path(doc['_path'], roots)}: {e.get('kind', '?')} engine in {e.get('dtype', '?')}, model "
            f"{model_words(doc.get('model', {}).get('name', '?'))}, {tokens}; {machine(doc)}")


def _runs_source(runs: list[dict], roots: list[Path]) -> str:
    arms = sorted({r.get("arm") or r["config"].get("intervention", r["name"]) for r in runs})
    quants = sorted({str(r["config"]["engine_quant"]) for r in runs if r["config"].get("engine_quant")})
    cfg = next((r for r in runs if (r.get("arm") or r["config"].get("intervention")) == "none"), runs[0])["config"]
    if len(runs) == 1:
        where = [short_path(runs[0]["_path"], roots)]
    else:  # OUT/<arm>/seed-<s>: name the experiment directories, not every run
        where = sorted({short_path(str(Path(r["_path"]).parents[1] if "/" in r["name"] else r["_path"]), roots)
                        for r in runs})
    return (f"{', '.join(where)}: {len(runs)} run{'s' if len(runs) > 1 else ''} ({len(arms)} arm"
            f"{'s' if len(arms) > 1 else ''}), model {model_words(cfg.get('model', '?'))}, "
            f"{cfg.get('trainer', '?')} trainer "
            f"against a {cfg.get('engine_dtype', '?')} engine{' in the baseline' if len(arms) > 1 else ''}"
            f"{' (the FP8 arms: ' + ', '.join(quants) + ', ' + EMULATED + ')' if quants else ''}, task "
            f"{cfg.get('task', '?')}; {machine(cfg)}")


def _trace_source(doc: dict, roots: list[Path]) -> str:
    cfg = doc.get("config", {})
    return (f"{short_path(doc['_path'], roots)}: recipe {doc.get('recipe')} against {doc.get('against')}, model "
            f"{model_words(cfg.get('model', '?'))}; {machine(doc)}")


def _growth_source(docs: list[dict], roots: list[Path]) -> str:
    folders = {str(Path(d["_path"]).parent) for d in docs}
    if len(docs) > 2 and len(folders) == 1:
        names = f"{len(docs)} files in {short_path(folders.pop(), roots)}/"
    else:
        names = ", ".join(short_path(d["_path"], roots) for d in docs)
    return (f"{names}: trace --run of {len(docs)} run{'s' if len(docs) > 1 else ''}, model "
            f"{model_words(docs[0].get('model'))}; {machine(docs[0])}")


def model_words(name) -> str:
    """A model's name as a source line gives it: the bundled model says what it is (models.BUNDLED_ORIGIN)."""
    return f"{name} ({BUNDLED_ORIGIN})" if name == BUNDLED_NAME else str(name)


def source_line(kind: str, docs: list[dict], roots: list[Path]) -> str:
    """The 'Data: ...' line under a figure or table drawn from `docs` of `kind` ('diagnose', 'runs', 'traces',
    'growths', 'summary': an experiment's summary followed by its runs, 'framework': diagnose JSONs and verl logs, or
    'computed' for a figure computed on the spot)."""
    if kind == "computed":
        return "Data: computed when the page was built (torch's own rounding), no measurement."
    if kind == "summary":
        summary, *runs = docs
        text = f"{short_path(summary['_path'], roots)}, the summary of experiment {summary.get('experiment', '?')}"
        return f"Data: {text}" + (f"; {_runs_source(runs, roots)}." if runs else ".")
    if kind == "diagnose":
        text = "; ".join(_diagnose_source(d, roots) for d in docs)
    elif kind == "framework":  # the last diagnose JSON, if any, then the last verl log
        text = "; ".join(_diagnose_source(d, roots) if "recipes" in d else
                         f"{short_path(d['_path'], roots)}, a verl run's file log of {len(d['steps'])} steps"
                         for d in docs)
    elif kind == "runs":
        text = _runs_source(docs, roots)
    elif kind == "traces":
        text = "; ".join(_trace_source(d, roots) for d in docs)
    else:
        text = _growth_source(docs, roots)
    return f"Data: {text}."


def _pct(x: float, digits: int = 0) -> str:
    return f"{100 * x:.{digits}f}%"


def _diagnose_line(doc: dict) -> str:
    name, stats = next(iter(doc["recipes"].items()))
    tr = doc["trust_region"]
    outside = stats.get("outside_trust_region")
    steps = (doc.get("postmortem") or {}).get("steps")
    when = (f"At step {html_text(steps[-1]['step'])}, the last recorded step of your run," if steps
            else "Before training,")  # a post-mortem's recipes table is its last step's, not step 0's
    line = (f"{when} a {html_text(name)} trainer and a {html_text(measured_engine(doc))} differ by "
            f"<b>{stats['beta_abs_mean']:.3g} <a href=\"#glossary-nats\">nats</a></b> per token (mean |β|)")
    if finite(outside):
        line += (f"; <b>{_pct(outside, 1)}</b> of tokens already lie outside the trust region "
                 f"(ε = {tr['epsilon_low']:g})")
    return line + " (section 4)."


def _training_line(summary: dict) -> str | None:
    base = next((a for a in summary["arms"] if a["run"] == summary.get("baseline")), None)
    if base is None or not finite(base["phantom_share_of_clipped"].get("mean"), base["phantom_rate"].get("mean")):
        return None  # the baseline clipped no token (no share), or no seed finished
    seeds = len(base["seeds"])
    return (f"In training, <b>{_pct(base['phantom_share_of_clipped']['mean'])}</b> of the tokens the clip zeroed "
            f"were phantom-clipped: <b>{_pct(base['phantom_rate']['mean'], 2)}</b> of all tokens (baseline, "
            f"{seeds} seed{'s' if seeds > 1 else ''}; the seed article: about {_pct(SEED_PHANTOM_SHARE)} of all "
            "tokens; section 5).")


def _interventions_line(summary: dict) -> tuple[str, int, int] | None:
    """(the interventions' line, its comparisons, how many exclude zero); None when no arm has an interval."""
    from ..training.experiments import detected

    helped, hurt, none = [], [], []
    for a in summary["arms"]:
        vs = a.get("vs_baseline", {}).get("final_length")
        if not vs or not finite(*(vs.get(k) for k in ("low", "high", "mean"))):
            continue
        with_mean = html_text(a["run"])
        if not detected({"final_length": vs}):
            none.append(html_text(a["run"]))
        elif vs["high"] < 0:
            helped.append(with_mean)
        else:
            hurt.append(with_mean)
    if not (helped or hurt or none):
        return None
    line = (f"Shorter than the baseline at 95%: <b>{', '.join(helped)}</b>" if helped
            else "No arm ended shorter than the baseline at 95%")
    if hurt:
        line += f"; longer: {', '.join(hurt)}"
    if none:
        line += f"; {len(none)} other arm{'s' if len(none) > 1 else ''}: no difference detected"
    return line + " (section 7).", len(helped) + len(hurt) + len(none), len(helped) + len(hurt)


def _fp8_line(summary: dict) -> tuple[str, int, int] | None:
    """(the FP8 experiment's line, its comparisons, how many exclude zero): the arms whose interval excludes zero by
    prose.fp8_verdicts (section 8's rule, FP8_COMPARED), the others counted; None with fewer than two seeds (no
    interval: nothing to say in a line) or nothing compared. The engine is said to be emulated (fp8_layers.EMULATED's
    short form): its figures are a CPU's."""
    verdicts = fp8_verdicts(summary)
    if verdicts is None or verdicts.seeds[-1] < 2 or not verdicts.compared:
        return None
    words = (("ended shorter", "ended longer"), ("had fewer phantom clips", "had more phantom clips"))
    said = []
    for (lower, higher, _), (below, above) in zip(verdicts.by_key, words):
        said += [f"{w} with <b>{', '.join(html_text(run) for run, _ in group)}</b>"
                 for group, w in ((lower, below), (higher, above)) if group]
    line = ("Against the bf16 engine, the emulated FP8 engine " + ("; ".join(said) if said else
                                                                      "showed no detectable difference")
            + " (section 8).")
    return line, verdicts.compared, verdicts.found


def html_summary(diagnose: list[dict], sanity: list[dict], fp8: list[dict] = (),
                 moe: tuple[str, int, int] | None = None) -> str:
    """Up to six short lines (the page's first box, about 120 words): the gap before training, phantom clipping
    during training, what the interventions did, what the FP8 arms did, what routing replay did on an MoE model
    (`moe`: the line, its comparisons and how many exclude zero, from moe_panel.summary_line), and one note on the
    intervals of sections 7, 8 and 9 counting the comparisons of all."""
    lines = []
    if diagnose:
        lines.append(_diagnose_line(diagnose[-1]))
    if sanity and (training := _training_line(sanity[-1])):
        lines.append(training)
    compared = [found for found in (sanity and _interventions_line(sanity[-1]), fp8 and _fp8_line(fp8[-1]), moe)
                if found]
    lines += [line for line, _, _ in compared]
    m, found = sum(c for _, c, _ in compared), sum(f for *_, f in compared)
    if m > 1:
        lines.append(f"These {m} intervals are 95% each, uncorrected: about {0.05 * m:.2g} would exclude zero by "
                     f"chance; {found} do.")
    if not lines:
        return ""
    items = "".join(f"<li>{line}</li>" for line in lines)
    return f'<section class="summary" id="summary"><h2>In short</h2><ul>{items}</ul></section>'


def _seed_range(summary: dict, arm: str, key: str) -> str:
    xs = seed_values(summary, arm, key)
    return f"{min(xs):.4f}–{max(xs):.4f}" if xs else "no seeds"


def _why_orders_differ(summary: dict, match_arm: str, baseline: str, tokens: int) -> str:
    """What the files can and cannot say when sections 3 and 7 order the two trainers differently."""
    a = seed_values(summary, match_arm, "beta_abs_mean_start")
    b = seed_values(summary, baseline, "beta_abs_mean_start")
    text = ("The two orders disagree. They were measured on different tokens: other prompts, other samples, and "
            "in training the rollouts of a policy that starts to move. ")
    if len(a) > 1 and len(b) > 1 and (max(a) < min(b) or max(b) < min(a)):
        lower = match_arm if max(a) < min(b) else baseline
        return text + (f"In training every seed of {lower} is below every seed of the other arm; section 3's order "
                       f"rests on one sample of {tokens} tokens, with no seeds to tell whether it holds on others.")
    return text + ("Neither order is settled by these files: the seeds of section 7 overlap, and section 3 is one "
                   "sample.")


def html_sections_compared(diagnose: list[dict], sanity: list[dict]) -> str:
    """Sections 3 and 7 both rank a trainer in the engine's dtype against the baseline's trainer; say, with their
    numbers, what each measured and whether their orders agree. Empty without both files or without the pair."""
    if not diagnose or not sanity:
        return ""
    diag, summary = diagnose[-1], sanity[-1]
    base_trainer = str(summary.get("base_config", {}).get("trainer", ""))
    engine_dtype = str(summary.get("base_config", {}).get("engine_dtype", ""))
    match_arm = f"match-{engine_dtype}"
    arms = {a["run"]: a for a in summary["arms"]}
    recipes = diag["recipes"]
    baseline = summary.get("baseline", "none")
    if not (base_trainer in recipes and engine_dtype in recipes and match_arm in arms and baseline in arms):
        return ""
    d_match, d_base = recipes[engine_dtype]["beta_abs_mean"], recipes[base_trainer]["beta_abs_mean"]
    t_match = arms[match_arm]["beta_abs_mean_start"]["mean"]
    t_base = arms[baseline]["beta_abs_mean_start"]["mean"]
    if not finite(d_match, d_base, t_match, t_base):
        return ""  # a figure not measured (null): no order to compare
    agree = (d_match > d_base) == (t_match > t_base)
    text = (f"Sections 3 and 7 both compare a trainer in the engine's {engine_dtype} with the {base_trainer} "
            f"trainer. Section 3 measured the {diag['engine']['tokens']} tokens that diagnose sampled once, before "
            f"training: mean |β| {d_match:.4f} ({engine_dtype}) against {d_base:.4f} ({base_trainer}). Section 7 "
            f"measured each run's own rollouts at its first logged steps (task "
            f"{summary.get('base_config', {}).get('task', '?')}): {t_match:.4f} for {match_arm} (seeds "
            f"{_seed_range(summary, match_arm, 'beta_abs_mean_start')}) against {t_base:.4f} for {baseline} "
            f"(seeds {_seed_range(summary, baseline, 'beta_abs_mean_start')}). ")
    if agree:
        text += "Both put the two trainers in the same order."
    else:
        text += _why_orders_differ(summary, match_arm, baseline, diag["engine"]["tokens"])
    return f'<p class="note" id="sections-compared">{html_text(text)}</p>'
