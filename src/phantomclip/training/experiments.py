"""Named experiment matrices, run over several seeds and read with intervals.

`sanity` is the reference analysis's experiment: reward = −completion length, an fp32 trainer against a bf16
engine, the baseline and every intervention under the same budget. `epsilon` is the ε sweep of the baseline and
of match-bf16. Every arm runs under the same seeds (paired: seed s of every arm samples the same prompt draws at
step 1), so an arm's difference to the baseline is measured seed by seed.

Layout: OUT/experiment.json (the arms and seeds, fixed by the first invocation), OUT/<arm>/seed-<s>/ (one run
directory each), OUT/summary.json and summary.md (rewritten after every run). An interrupted experiment continues
where it stopped: finished runs are read back, a partial one resumes from its checkpoint. A finished run's
checkpoint is deleted unless asked to keep it (the weights are only needed to continue a run).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .. import SCHEMA_VERSION
from ..base.errors import SEED_LIMIT, SEEDS_LIMIT, check_number
from ..base.files import check_output_dir
from ..base.locks import EXPERIMENT_MANIFEST, DirLock
from ..base.owned import check_no_links, make_dirs, remove_owned, write_owned_bytes, write_owned_json
from ..maths.metrics import RUN_WINDOW, run_phantom_summary, t_interval
from ..runs.read import read_json_object
from ..runs.rundir import RunDir
from .config import ADDED_SINCE_SCHEMA_1, RESUME_MAY_CHANGE, TrainConfig, engine_refuses
from .interventions import TrainConfigError
from .trainer import run_config, run_finished, train

SANITY_INTERVENTIONS = (
    "none", "match-bf16", "fp16", "autocast", "fp32-head", "shadow-ratio", "recompute-old", "force-r1", "no-clip",
    "tis", "mis", "icepop",
)
EPSILON_SWEEP = (0.05, 0.1, 0.2, 0.3)
SWEPT = ("none", "match-bf16")
BASELINE = "none"
SANITY_DEFAULTS = {"steps": 30, "stop_after_converged": 3}
"""The budget: 30 steps (force-r1 takes the bundled model from 32 tokens to about 1 in that many), and a run
stops 3 steps after it converged (the rest of its length curve is then carried at its last value)."""
DEFAULT_SEEDS = 3
"""seeds per arm: the fewest that give a t interval (df = 2) of usable width at this budget."""


# ----------------------------------------------------------------------------------------------- matrices


def sanity_arms(base: TrainConfig) -> dict[str, TrainConfig]:
    """Arm name -> config: the baseline and each intervention at the base ε."""
    return {name: replace(base, intervention=name) for name in SANITY_INTERVENTIONS}


def epsilon_arms(base: TrainConfig) -> dict[str, TrainConfig]:
    """Arm name -> config: the ε sweep of the baseline and match-bf16 (the base ε is the plain arm itself)."""
    arms = {}
    for name in SWEPT:
        for eps in EPSILON_SWEEP:
            if math.isclose(eps, base.epsilon):
                arms[name] = replace(base, intervention=name)
            else:
                arms[f"{name},epsilon={eps}"] = replace(base, intervention=f"{name},epsilon={eps}")
    return arms


FP8_QUANT = "fp8-w8a8"
"""the FP8 engine of `experiment fp8`: vLLM's quantization='fp8' (verl rollout.quantization=fp8, NeMo-RL
vllm_cfg.precision=fp8): per-tensor weights, dynamic per-token activations (precision/fp8.py)."""
FP8_CORRECTIONS = ("tis", "mis", "icepop", "shadow-ratio", "force-r1")


def fp8_arms(base: TrainConfig) -> dict[str, TrainConfig]:
    """Arm name -> config: the bf16 engine (the baseline, 'none'), the FP8 engine, and the FP8 engine with each
    correction; the trainer is the base's (fp32 by default)."""
    fp8 = replace(base, engine_quant=FP8_QUANT, intervention="none")
    return {BASELINE: replace(base, intervention="none", engine_quant=""), "fp8": fp8,
            **{f"fp8,{c}": replace(fp8, intervention=c) for c in FP8_CORRECTIONS}}


EXPERIMENTS = {"sanity": sanity_arms, "epsilon": epsilon_arms, "fp8": fp8_arms}


@dataclass(frozen=True)
class Matrix:
    """What an experiment runs: arms × seeds, every arm under every seed."""

    experiment: str
    base: TrainConfig
    arms: dict[str, TrainConfig]
    seeds: tuple[int, ...]
    left_out: dict[str, str] = field(default_factory=dict)
    """arms of the experiment this engine cannot run, with the reason (fp32-head under vLLM)."""

    def runs(self) -> list[tuple[str, int, TrainConfig]]:
        """(arm, seed, config) for every run, seed-major: after each full pass every arm has the same seeds, so an
        experiment stopped early still compares like with like."""
        return [(arm, s, replace(cfg, seed=s)) for s in self.seeds for arm, cfg in self.arms.items()]


def quoted(names) -> str:
    """Arm names in a comma list, each in quotes: a name may hold commas ('fp8,tis'), so a bare list is ambiguous."""
    return ", ".join(f"'{n}'" for n in names)


def build_matrix(experiment: str, base: TrainConfig, seeds: int, only: list[str] | None = None) -> Matrix:
    """The matrix of `experiment` with seeds base.seed .. base.seed + seeds − 1; `only` keeps some arms."""
    if experiment not in EXPERIMENTS:
        raise TrainConfigError(f"unknown experiment {experiment!r}: use one of {', '.join(EXPERIMENTS)}")
    check_number("--seeds", seeds, 1, SEEDS_LIMIT, integer=True, error=TrainConfigError)
    if base.seed + seeds > SEED_LIMIT:
        most = SEED_LIMIT - base.seed  # the most seeds that start at --seed and stay in range
        lower = f"lower --seeds to {most} or less" + (" or --seed" if seeds <= SEED_LIMIT else "")
        raise TrainConfigError(f"--seed {base.seed} with --seeds {seeds} runs seeds up to {base.seed + seeds - 1}, "
                               f"past the largest seed {SEED_LIMIT - 1}: {lower}")
    arms, left_out = EXPERIMENTS[experiment](base), {}
    if only:
        unknown = [n for n in only if n not in arms]
        if unknown:
            raise TrainConfigError(f"--only: unknown run(s) {quoted(unknown)}; the runs are: {quoted(arms)}")
        arms = {n: arms[n] for n in only}  # an arm named here that the engine cannot run is refused by validate
    else:  # the whole experiment: what the engine cannot run is left out, and said
        left_out = {name: engine_refuses(cfg) for name, cfg in arms.items() if engine_refuses(cfg)}
        arms = {name: cfg for name, cfg in arms.items() if name not in left_out}
    for cfg in arms.values():
        cfg.validate()
    return Matrix(experiment=experiment, base=base, arms=arms, seeds=tuple(range(base.seed, base.seed + seeds)),
                  left_out=left_out)


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return out / arm.replace(",", "+").replace("=", "-") / f"seed-{seed}"


def check_manifest(matrix: Matrix, out: Path) -> None:
    """Write OUT/experiment.json on the first invocation; on a later one refuse another arm or seed set, naming the
    runs that differ (continuing must not mix two designs in one summary)."""
    path = out / EXPERIMENT_MANIFEST
    manifest = {"experiment": matrix.experiment, "arms": list(matrix.arms), "seeds": list(matrix.seeds)}
    if not os.path.lexists(path):
        write_owned_json(out, path, manifest)
        return
    old = read_json_object(path, "experiment's manifest")
    if old == manifest:
        return
    have = {f"{a}/seed-{s}" for a in old.get("arms", []) for s in old.get("seeds", [])}
    want = {f"{a}/seed-{s}" for a in manifest["arms"] for s in manifest["seeds"]}
    missing, extra = sorted(have - want), sorted(want - have)
    raise TrainConfigError(
        f"{out} holds a {old.get('experiment')} experiment with other arms or seeds"
        + (f"; not in this command: {quoted(missing)}" if missing else "")
        + (f"; new in this command: {quoted(extra)}" if extra else "")
        + ": rerun with the same --seeds/--only (and seed), or choose another --out")


def run_experiment(matrix: Matrix, out: str | Path, console=None, keep_checkpoints: bool = False) -> dict:
    """Run (or continue) every run of `matrix` under `out`; returns the summary (also summary.json / .md)."""
    out = Path(out)
    check_output_dir(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TrainConfigError(f"cannot create {out} ({e.strerror}): choose a writable --out") from None
    lock = DirLock(out, "experiment")  # one writer per experiment; each run's own directory is locked by train
    try:
        if console is not None:
            for arm, reason in matrix.left_out.items():
                console.print(f"left out: {arm} ({reason})")
        runs = matrix.runs()
        for arm, seed, _ in runs:  # a link at OUT/<arm> or below would take a run's files elsewhere
            check_no_links(out, run_dir(out, arm, seed))
        check_manifest(matrix, out)
        check_continuation(out, runs)
        return _run_all(matrix, out, runs, console, keep_checkpoints)
    finally:
        lock.release()


def check_continuation(out: Path, runs: list[tuple[str, int, TrainConfig]]) -> None:
    """Refuse to continue an experiment whose existing runs were made with another configuration (another --lr, say),
    naming the run and the keys, before any step: finished runs are read back, not rerun, so their numbers would be
    filed under the new settings."""
    from ..models.prompts import read_prompts
    from .tasks import load_reward

    for arm, seed, cfg in runs:
        path = run_dir(out, arm, seed)
        if (path / "config.json").exists():
            cfg.validate()
            if cfg.reward:  # the inputs are hashed into the config: each must load first (one line if not)
                load_reward(cfg.reward)
            if cfg.prompts:
                read_prompts(cfg.prompts)
            RunDir.check_config(path, run_config(cfg), RESUME_MAY_CHANGE, ADDED_SINCE_SCHEMA_1)


def _run_all(matrix: Matrix, out: Path, runs: list[tuple[str, int, TrainConfig]], console,
             keep_checkpoints: bool) -> dict:
    results: list[dict] = []
    for i, (arm, seed, cfg) in enumerate(runs):
        path = run_dir(out, arm, seed)
        done = RunDir(path).metrics() if (path / "config.json").exists() else []
        if console is not None:
            note = f" (continuing at step {len(done)})" if done else ""
            console.print(f"[bold]{i + 1}/{len(runs)}[/bold] {arm} seed {seed}{note}")
        interrupted = False
        if not run_finished(done, cfg.steps, cfg.stop_after_converged):
            make_dirs(out, path)  # beneath OUT without following a link: train then writes inside it
            result = train(cfg, out=path, resume=(path / "config.json").exists(), console=console)
            done, interrupted = result.metrics, result.interrupted
        if not interrupted and not keep_checkpoints:
            remove_owned(out, path / "checkpoint.pt")
        results.append(summarize_run(arm, seed, done, cfg.steps, finished=not interrupted,
                                     patience=max(1, cfg.stop_after_converged)))
        summary = summarize(matrix, results)
        write_summary(summary, out)  # after every run, so an interrupted experiment still has its table
        if interrupted:  # Ctrl-C: the run has its checkpoint; rerunning the command continues from it
            raise KeyboardInterrupt
    return summarize(matrix, results)


# ----------------------------------------------------------------------------------------------- reading


def length_curve(metrics: list[dict], budget: int) -> list[float]:
    """Mean completion length at each of the `budget` steps; a run that stopped early (converged) is carried at the
    mean of its last RUN_WINDOW steps, the level it had settled at."""
    lengths = [r["completion/length_mean"] for r in metrics[:budget]]
    if 0 < len(lengths) < budget:
        tail = lengths[-RUN_WINDOW:]
        lengths += [sum(tail) / len(tail)] * (budget - len(lengths))
    return lengths


def summarize_run(arm: str, seed: int, metrics: list[dict], budget: int, finished: bool = True,
                  patience: int = 1) -> dict:
    """One run's row: its length figures, convergence (censored at the budget) and whole-run clip accounting.
    A run converged at the first step that starts `patience` consecutive converged steps (the run's
    stop_after_converged, so the step it stopped for): one lucky batch below the threshold does not count.
    `finished`: False for a run interrupted before its budget (left out of the per-arm figures)."""
    flags = [bool(r.get("task/converged")) for r in metrics]
    converged = next((metrics[i]["step"] for i in range(len(flags) - patience + 1) if all(flags[i:i + patience])), None)
    last = metrics[-RUN_WINDOW:]
    curve = length_curve(metrics, budget)
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows) if rows else float("nan")  # noqa: E731
    return {
        "run": arm, "seed": seed, "steps_run": len(metrics), "budget": budget,
        "finished": finished,
        "converged": converged is not None,
        "steps_to_converge": converged if converged is not None else budget,
        "final_length": mean(last, "completion/length_mean"),
        "final_reward": mean(last, "reward/mean"),
        "length_auc": sum(curve) / len(curve) if curve else float("nan"),
        **run_phantom_summary(metrics),
        "wall_s": sum(r["time/step_s"] for r in metrics),
    }


ARM_FIGURES = ("final_length", "length_auc", "steps_to_converge", "phantom_rate", "phantom_rate_last",
               "phantom_share_of_clipped", "phantom_adv_share", "beta_abs_mean_start", "beta_abs_mean_end",
               "beta_outside_end")
"""the per-run figures given per arm as mean and 95% t interval over seeds."""
COMPARED = ("final_length", "length_auc", "steps_to_converge", "phantom_rate")
"""the figures compared with the baseline, seed by seed."""


def summarize(matrix: Matrix, results: list[dict]) -> dict:
    """Per arm: mean and 95% t interval over seeds of each figure, the paired difference to the baseline, and a
    verdict that names only the arms whose interval excludes zero."""
    by_arm = {arm: {r["seed"]: r for r in results if r["run"] == arm and r["finished"]} for arm in matrix.arms}
    base = by_arm.get(BASELINE, {})
    arms = []
    for arm, runs in by_arm.items():
        if not runs:
            continue
        row = {"run": arm, "seeds": sorted(runs), "converged": sum(r["converged"] for r in runs.values())}
        row.update({key: t_interval([r[key] for r in runs.values()]) for key in ARM_FIGURES})
        if arm != BASELINE and base:
            paired = sorted(set(runs) & set(base))
            row["vs_baseline"] = {key: t_interval([runs[s][key] - base[s][key] for s in paired]) for key in COMPARED}
        arms.append(row)
    return {"schema": SCHEMA_VERSION, "experiment": matrix.experiment, "base_config": asdict(matrix.base),
            "seeds": list(matrix.seeds),
            "baseline": BASELINE, "interval": "95% Student t over seeds (paired by seed for differences)",
            "left_out": matrix.left_out, "arms": arms, "runs": results, "verdict": arm_verdicts(arms)}


def arm_verdicts(arms: list[dict]) -> list[str]:
    """One line per non-baseline arm: the figures whose paired interval excludes zero (`detected`), or 'no
    detectable difference at N seeds' (also when N < 2, where no interval exists)."""
    lines = []
    for row in arms:
        diffs = row.get("vs_baseline")
        if not diffs:
            continue
        n = diffs["final_length"]["n"]
        seeds = f"{n} seed" + ("" if n == 1 else "s")
        told = [f"{DIFFERENCE_LABELS[key]} {d['mean']:+.3g} [{d['low']:+.3g}, {d['high']:+.3g}]"
                for key, d in detected(diffs).items()]
        lines.append(f"{row['run']}: " + ("; ".join(told) + f" vs {BASELINE} ({seeds})" if told
                                          else f"no detectable difference from {BASELINE} at {seeds}"))
    return lines


def detected(diffs: dict[str, dict]) -> dict[str, dict]:
    """The paired differences (t_interval records, in memory or read back from JSON, where NaN is null) whose 95%
    interval excludes zero; two seeds at least, as one has no interval. The one rule every verdict uses."""
    def finite(x) -> bool:
        return isinstance(x, (int, float)) and math.isfinite(x)

    return {key: d for key, d in diffs.items()
            if d["n"] >= 2 and finite(d["low"]) and finite(d["high"]) and (d["low"] > 0 or d["high"] < 0)}


DIFFERENCE_LABELS = {"final_length": "final length", "length_auc": "mean length over the run",
                     "steps_to_converge": "steps to convergence", "phantom_rate": "phantom-clip rate"}
"""vs_baseline key -> its words in a verdict (the terminal's and the article's)."""


# ----------------------------------------------------------------------------------------------- writing


def write_summary(summary: dict, out: Path) -> None:
    write_owned_json(out, out / "summary.json", summary)
    write_owned_bytes(out, out / "summary.md", summary_markdown(summary).encode())


def _ci(x: dict, scale: float = 1.0, digits: int = 1, bare: bool = False) -> str:
    """'mean [low, high]' (or just the mean with one seed, or `bare`); '-' with no seed or no value."""
    if x["n"] == 0 or x["mean"] is None or x["mean"] != x["mean"]:
        return "-"
    if x["n"] < 2 or bare:
        return f"{scale * x['mean']:.{digits}f}"
    return f"{scale * x['mean']:.{digits}f} [{scale * x['low']:.{digits}f}, {scale * x['high']:.{digits}f}]"


ARM_COLUMNS = (
    ("final length (last 5)", lambda a: _ci(a["final_length"])),
    ("Δ final length vs none", lambda a: _ci(a["vs_baseline"]["final_length"]) if "vs_baseline" in a else "-"),
    ("mean length over the run", lambda a: _ci(a["length_auc"])),
    ("converged", lambda a: f"{a['converged']}/{len(a['seeds'])}"),
    ("steps to convergence*", lambda a: _ci(a["steps_to_converge"], digits=0)),
    ("phantom %, whole run", lambda a: _ci(a["phantom_rate"], 100, 2)),
    ("phantom %, last 5", lambda a: _ci(a["phantom_rate_last"], 100, 2)),
    ("phantom / clipped %", lambda a: _ci(a["phantom_share_of_clipped"], 100, 0)),
    ("mean |β| start → end",
     lambda a: " → ".join(_ci(a[k], digits=4, bare=True) for k in ("beta_abs_mean_start", "beta_abs_mean_end"))),
)
"""the arm table's columns: header -> cell."""


def summary_markdown(summary: dict) -> str:
    cell = lambda text: text.replace("|", "\\|")  # noqa: E731 (|β| inside a Markdown table cell)
    head = "| arm | seeds | " + " | ".join(cell(h) for h, _ in ARM_COLUMNS) + " |\n"
    head += "|---|---:|" + "---:|" * len(ARM_COLUMNS) + "\n"
    rows = "".join(f"| {a['run']} | {len(a['seeds'])} | "
                   + " | ".join(cell(draw(a)) for _, draw in ARM_COLUMNS) + " |\n"
                   for a in summary["arms"])
    notes = (f"\nMean [95% interval]: {summary['interval']}. *Steps to convergence is censored at the budget: a run "
             "that did not converge counts as the budget (a lower bound).\n\n")
    return head + rows + notes + "".join(f"- {line}\n" for line in summary["verdict"])
