"""Named experiment matrices. `sanity` is the reference analysis's experiment: reward = −completion length, an
fp32 trainer against a bf16 engine, and every intervention under the same seeds and budget, plus an ε sweep.

Each run lives in its own directory under the experiment's; an interrupted experiment continues where it
stopped (finished runs are read back, a partial one resumes from its checkpoint).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from . import SCHEMA_VERSION
from .runs import RunDir, atomic_write_bytes, write_json
from .trainer import TrainConfig, TrainConfigError, finished_early, train

SANITY_INTERVENTIONS = (
    "none", "match-bf16", "fp16", "autocast", "fp32-head", "shadow-ratio", "recompute-old", "force-r1", "no-clip",
    "tis", "mis", "icepop",
)
EPSILON_SWEEP = (0.05, 0.1, 0.2, 0.3)
SWEPT = ("none", "match-bf16")
SANITY_DEFAULTS = {"steps": 30, "stop_after_converged": 3}
"""The sanity budget: 30 steps (force-r1 takes the bundled model from 32 tokens to about 1 in that many), and a
run stops 3 steps after it converged, so the 18 runs fit in under 90 minutes on 2 cores."""
PHANTOM_WINDOW = 5
"""phantom-clip rate is averaged over the first steps, where α is still small (the analysis's window)."""


def sanity_runs(base: TrainConfig, only: list[str] | None = None) -> dict[str, TrainConfig]:
    """Run name -> config: each intervention at the base ε, then the ε sweep for `SWEPT`."""
    runs = {name: replace(base, intervention=name) for name in SANITY_INTERVENTIONS}
    for name in SWEPT:
        for eps in EPSILON_SWEEP:
            if not math.isclose(eps, base.epsilon):
                runs[f"{name},epsilon={eps}"] = replace(base, intervention=f"{name},epsilon={eps}")
    if only:
        unknown = [n for n in only if n not in runs]
        if unknown:
            raise TrainConfigError(f"--only: unknown run(s) {', '.join(unknown)}; the runs are: {', '.join(runs)}")
        runs = {n: runs[n] for n in only}
    return runs


def summarize(name: str, metrics: list[dict], steps: int) -> dict:
    """One row of the comparison table from a run's metrics."""
    converged = next((r["step"] for r in metrics if r.get("task/converged")), None)
    last = metrics[-3:]
    first = metrics[:PHANTOM_WINDOW]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows) if rows else float("nan")  # noqa: E731
    return {
        "run": name,
        "steps_run": len(metrics),
        "steps_to_converge": converged,
        "converged": converged is not None,
        "final_reward": mean(last, "reward/mean"),
        "final_length": mean(last, "completion/length_mean"),
        "phantom_rate_first5": mean(first, "clip/phantom_rate"),
        "clip_rate_first5": mean(first, "clip/rate"),
        "beta_abs_mean_first5": mean(first, "mismatch/beta_abs_mean"),
        "wall_s": sum(r["time/step_s"] for r in metrics),
        "budget": steps,
    }


def _dir_name(run: str) -> str:
    return run.replace(",", "+").replace("=", "-")


def run_sanity(base: TrainConfig, out: str | Path, only: list[str] | None = None, console=None) -> list[dict]:
    """Run (or continue) the sanity matrix under `out`; returns the summary rows and writes summary.json/.md."""
    runs = sanity_runs(base, only)
    for cfg in runs.values():
        cfg.validate()
    out = Path(out)
    rows = []
    for i, (name, cfg) in enumerate(runs.items()):
        path = out / _dir_name(name)
        done = RunDir(path).metrics() if (path / "config.json").exists() else []
        if console is not None:
            console.print(f"[bold]{i + 1}/{len(runs)}[/bold] {name}" + (f" (continuing at step {len(done)})" if done else ""))
        interrupted = False
        if len(done) < cfg.steps and not finished_early(done, cfg.stop_after_converged):
            result = train(cfg, out=path, resume=(path / "config.json").exists(), console=console)
            done, interrupted = result.metrics, result.interrupted
        rows.append(summarize(name, done, cfg.steps))
        write_summary(rows, base, out)  # after every run, so an interrupted experiment still has its table
        if interrupted:  # Ctrl-C: the run has its checkpoint; rerunning the command continues from it
            raise KeyboardInterrupt
    return rows


def write_summary(rows: list[dict], base: TrainConfig, out: Path) -> None:
    write_json({"schema": SCHEMA_VERSION, "base_config": vars(base), "runs": rows}, out / "summary.json")
    atomic_write_bytes(out / "summary.md", summary_markdown(rows).encode())


def _converged_cell(r: dict) -> str:
    return str(r["steps_to_converge"]) if r["converged"] else f"not converged in {r['steps_run']}"


def summary_markdown(rows: list[dict]) -> str:
    head = "| run | steps to convergence | final reward (last 3) | final length | phantom-clip rate, first 5 steps | clip rate, first 5 | mean abs β, first 5 | wall (s) |\n"
    head += "|---|---|---:|---:|---:|---:|---:|---:|\n"
    return head + "".join(
        f"| {r['run']} | {_converged_cell(r)} | {r['final_reward']:.2f} | {r['final_length']:.1f} | "
        f"{100 * r['phantom_rate_first5']:.2f}% | {100 * r['clip_rate_first5']:.2f}% | {r['beta_abs_mean_first5']:.4f} | {r['wall_s']:.0f} |\n"
        for r in rows
    )


def render_summary(rows: list[dict], console) -> None:
    from rich import box
    from rich.table import Table

    table = Table(title="experiment sanity", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("run", "steps to convergence", "final reward", "final len", "phantom % (first 5)", "clip % (first 5)", "|β| (first 5)", "wall s"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for r in rows:
        table.add_row(r["run"], _converged_cell(r), f"{r['final_reward']:.2f}", f"{r['final_length']:.1f}",
                      f"{100 * r['phantom_rate_first5']:.2f}", f"{100 * r['clip_rate_first5']:.2f}",
                      f"{r['beta_abs_mean_first5']:.4f}", f"{r['wall_s']:.0f}")
    console.print(table)
