"""The async fix's ratio, compared where deleting the clip is not the optimum (integrations.trl_async.ratio): TRL's
own ratio ("trl", no fix), "trust-region" (the default: the clip on the policy's move since the sample's version in
the trainer's fp32, β in a weight capped at 2), "trust-region-kept2" (the same keeping 2 of the 4 versions a token may
have), "shadow" (the clip on α from two bf16 copies) and "decoupled"
(AReaL/verl decoupled PPO: with one step per sample its clip never fires), each trained in TRL 1.16's real
AsyncGRPOTrainer on the bundled SmolLM2-135M (fp32 trainer, the bf16 LocalEngine standing in for the vLLM server:
integrations.trl_async.cpu), 8 completions per group, two groups sampled per fill (staleness 0, 1, 1, 2, 1, 2, ...,
max_staleness 2), ε 0.2, one thread, on two tasks whose optimum is interior:

- "target-length": the bundled prompts, up to 32 tokens, reward −|L − 16| / 16 (L: completion tokens); solved:
  |L − 16| <= 3. The model's completions run to 45-55 tokens at 64 (earlier runs), so most start at the 32-token
  limit: it must shorten, and stop shortening.
- "add": "What is a + b?" for 64 fixed pairs 2 <= a, b <= 49, up to 16 tokens, reward 1 when the completion's last
  integer is a + b, else 0; solved: reward 1.

Completions are short because a step costs about 19 s of one core's time at 48 tokens on this 2-core machine
(measured: 3 steps of "trust-region" on target-length, 56 s CPU, load average about 5 from other work).

The earlier comparison (reward −length) was won by the arm that collapses fastest: its optimum is the empty
completion, which a loss without a clip reaches first. Here each run records, per group sampled, the mean reward,
the solved share and the mean length, and per step TRL's own ratio/clip figures and the fix's offpolicy/* figures.

Grid: tasks x learning rates (1e-4, 3e-4) x arms x seeds, 30 steps each, paired by seed (the same seed draws the
same prompts and, for the first fill, the same completions in every arm). One JSON per task/lr/arm/seed under --out,
written atomically; rerun to continue (each run its own process; a killed run restarts from its start). Cells run
one after another (a cell: one task at one lr), seeds within a cell, arms within a seed, so paired seeds complete
early. --summary only reads what is there and prints the comparison.

Run: nice -n 10 python bench/experiments/exp_async_ratio.py [--out results/trl-async-ratio] [--steps 30]
     [--seeds 5] [--cells target-length@1e-4,add@1e-4,target-length@3e-4,add@3e-4] [--budget-s 2400]

Writes summary.json under --out, which docs/results.md "The async fix's ratio, compared over seeds" and docs/trl.md
"The async trainer: monitor and fix" read.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))  # the cost bench, a helper here
from bench_trl_async_monitor import cpu_kind  # noqa: E402  (the same CPU line as the cost bench)

ARMS = ("trust-region", "decoupled", "trl", "shadow", "trust-region-kept2")
"""the fix's ratios by name, TRL's own ("trl"), and "trust-region-keptK": the cheaper form keeping the newest K versions
only (with_async_shadow_ratio(versions_kept=K); here 2 of the 4 a token may have)."""
REFERENCE = "trust-region"
"""the arm every other is paired against: the default."""
CELLS = ("target-length@1e-4", "add@1e-4", "target-length@3e-4", "add@3e-4")
FINAL_GROUPS = 8
"""final figures: the mean over the last FINAL_GROUPS groups sampled (the last four fills); beside them the mean over
every group the run sampled (the whole run, no window chosen)."""
TARGET, TARGET_TOL = 16, 3


def _add_prompts() -> list[tuple[str, int]]:
    rng = random.Random(57)
    pairs = [(rng.randint(2, 49), rng.randint(2, 49)) for _ in range(64)]
    return [(f"What is {a} + {b}?", a + b) for a, b in pairs]


def task(name: str):
    """(prompts, max_tokens, score(prompt, completion text, ids) -> (reward, solved))."""
    if name == "target-length":
        from phantomclip.models.prompts import bundled_prompts

        return bundled_prompts(), 32, lambda p, text, ids: (-abs(len(ids) - TARGET) / TARGET,
                                                             abs(len(ids) - TARGET) <= TARGET_TOL)
    if name == "add":
        answers = dict(_add_prompts())

        def score(p, text, ids):
            numbers = re.findall(r"-?\d+", text)
            ok = bool(numbers) and int(numbers[-1]) == answers[p]
            return float(ok), ok

        return list(answers), 16, score
    raise SystemExit(f"unknown task {name!r}: target-length or add")


def build(arm: str, task_name: str, lr: float, seed: int, steps: int, out_dir: str, groups: list):
    import torch
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from phantomclip.engines.local import LocalEngine
    from phantomclip.integrations.trl_async.cpu import LocalRolloutWorker, LocalWeightTransfer, use_cpu_stand_ins
    from phantomclip.integrations.trl_async.monitor import with_async_shadow_ratio
    from phantomclip.models.load import load_model

    use_cpu_stand_ins()
    lm = load_model("smollm2-135m")
    engine = LocalEngine(copy.deepcopy(lm.model), torch.bfloat16)
    prompts, max_tokens, score = task(task_name)

    def reward(ps, completions, ids):
        scored = [score(p, c, i) for p, c, i in zip(ps, completions, ids, strict=True)]
        groups.append({"version": worker.model_version, "reward": statistics.fmean(r for r, _ in scored),
                       "solved": statistics.fmean(float(s) for _, s in scored),
                       "length": statistics.fmean(len(i) for i in ids)})
        return [r for r, _ in scored]

    worker = LocalRolloutWorker(engine, lm.tokenizer, prompts, reward, num_generations=8, max_tokens=max_tokens,
                                groups_per_fill=2, seed=seed)
    ratio, _, kept = arm.partition("-kept")
    cls = AsyncGRPOTrainer if arm == "trl" else with_async_shadow_ratio(AsyncGRPOTrainer, ratio=ratio,
                                                                        versions_kept=int(kept) if kept else None)
    config = AsyncGRPOConfig(output_dir=out_dir, per_device_train_batch_size=8, num_generations=8,
                             max_completion_length=max_tokens, learning_rate=lr, max_steps=steps, logging_steps=1,
                             report_to=[], save_strategy="no", bf16=False, use_cpu=True, token_budget=0,
                             max_staleness=2, seed=seed)
    return cls(model=lm.path, args=config, reward_funcs=[], processing_class=lm.tokenizer,
               train_dataset=Dataset.from_dict({"prompt": prompts}), rollout_worker=worker,
               weight_transfer=LocalWeightTransfer(engine))


ROW_KEYS = ("ratio", "kl", "clip_ratio/region_mean", "loss", "grad_norm")


def run_one(arm: str, task_name: str, lr: float, seed: int, steps: int) -> dict:
    groups = []
    with tempfile.TemporaryDirectory() as out:
        trainer = build(arm, task_name, lr, seed, steps, out, groups)
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.train()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    rows = [{"step": h["step"], **{k: v for k, v in h.items() if k in ROW_KEYS or k.startswith("offpolicy/")}}
            for h in trainer.state.log_history if "loss" in h]
    last = groups[-FINAL_GROUPS:]
    return {"arm": arm, "task": task_name, "lr": lr, "seed": seed, "steps": steps, "wall_s": wall, "cpu_s": cpu,
            "rows": rows, "groups": groups, **{f"final_{k}": statistics.fmean(g[k] for g in last)
                                               for k in ("reward", "solved", "length")},
            **{f"run_{k}": statistics.fmean(g[k] for g in groups) for k in ("reward", "solved", "length")}}


def _path(out: Path, cell: str, arm: str, seed: int) -> Path:
    return out / cell / arm / f"seed-{seed}.json"


FIGURES = ("final_reward", "run_reward", "final_solved", "run_solved", "final_length", "run_length")
SIGNALS = ("clip_ratio/region_mean", "offpolicy/clip_rate", "offpolicy/weight_ess", "offpolicy/capped_share",
           "offpolicy/alpha_abs_mean_s1", "offpolicy/alpha_abs_mean_s2")


def summary(out: Path) -> dict:
    """Per cell (task@lr): each arm's figures over seeds (95% t intervals, metrics.t_interval), each arm's paired
    difference from "trust-region" over the seeds where both ran, and the mean of each logged signal over steps."""
    from phantomclip.maths.metrics import t_interval

    if not out.is_dir():
        raise SystemExit(f"no runs under {out}: run without --summary first (or pass the --out they were written to)")
    cells = {}
    for cell_dir in sorted(p for p in out.iterdir() if p.is_dir() and "@" in p.name):
        runs = {(r["arm"], r["seed"]): r for r in (json.loads(p.read_text()) for p in cell_dir.glob("*/seed-*.json"))}
        if not runs:
            continue
        arms = [a for a in ARMS if any(k[0] == a for k in runs)]
        seeds = sorted({s for (_, s) in runs})
        c = {"arms": {}, "paired_vs_trust_region": {}, "runs": len(runs)}
        for a in arms:
            mine = [runs[(a, s)] for s in seeds if (a, s) in runs]
            c["arms"][a] = {"seeds": [r["seed"] for r in mine],
                            "wall_s_mean": statistics.fmean(r["wall_s"] for r in mine),
                            **{k: t_interval([r[k] for r in mine]) for k in FIGURES},
                            **{k: statistics.fmean(statistics.fmean(row[k] for row in r["rows"] if k in row)
                                                   for r in mine if any(k in row for row in r["rows"]))
                               for k in SIGNALS if any(k in row for r in mine for row in r["rows"])}}
            if a != REFERENCE:
                both = [s for s in seeds if (a, s) in runs and (REFERENCE, s) in runs]
                c["paired_vs_trust_region"][a] = {"seeds": both, **{
                    k: t_interval([runs[(a, s)][k] - runs[(REFERENCE, s)][k] for s in both]) for k in FIGURES}}
        cells[cell_dir.name] = c
    return cells


def _ci(x: dict, scale: float = 1.0, digits: int = 3) -> str:
    if x["n"] < 2:
        return f"{scale * x['mean']:.{digits}f} (n={x['n']})"
    return f"{scale * x['mean']:.{digits}f} [{scale * x['low']:.{digits}f}, {scale * x['high']:.{digits}f}]"


def markdown(cells: dict) -> str:
    """Per cell: each arm's reward and solved share (final and over the run) and mean length, with 95% t intervals
    over seeds, and the paired difference from "trust-region"; then the mean signals."""
    lines = []
    for name, c in cells.items():
        lines += [f"**{name}** ({c['runs']} runs)", "",
                  "| ratio | seeds | final reward | − trust-region | reward over the run | − trust-region "
                  "| final solved | − trust-region | length over the run | TRL clip rate | fix's clip rate "
                  "| weight ESS | capped |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for a, f in c["arms"].items():
            d = c["paired_vs_trust_region"].get(a)
            diff = (lambda k: "—") if d is None else (lambda k, d=d: _ci(d[k]))
            sig = [f"{f[k]:.4f}" if k in f else "—" for k in ("clip_ratio/region_mean", "offpolicy/clip_rate",
                                                              "offpolicy/weight_ess", "offpolicy/capped_share")]
            lines.append(f"| {a} | {f['seeds']} | {_ci(f['final_reward'])} | {diff('final_reward')} | "
                         f"{_ci(f['run_reward'])} | {diff('run_reward')} | {_ci(f['final_solved'])} | "
                         f"{diff('final_solved')} | {_ci(f['run_length'], digits=1)} | {' | '.join(sig)} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/trl-async-ratio")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--budget-s", type=float, default=None, help="start no run after this many seconds")
    ap.add_argument("--summary", action="store_true", help="only summarise the runs already there")
    ap.add_argument("--one", nargs=4, metavar=("ARM", "TASK", "LR", "SEED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    from phantomclip.base.files import atomic_write

    out = Path(args.out)
    if args.one:
        import torch

        torch.set_num_threads(1)
        arm, task_name, lr, seed = args.one[0], args.one[1], float(args.one[2]), int(args.one[3])
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        result = {**run_one(arm, task_name, lr, seed, args.steps), "commit": os.environ.get("EXP_COMMIT", "?"),
                  "started": started, "cpu": cpu_kind(), "loadavg_end": os.getloadavg()}
        path = _path(out, f"{task_name}@{args.one[2]}", arm, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(result, indent=1)))
        print(f"{task_name}@{args.one[2]} {arm} seed {seed}: final reward {result['final_reward']:.3f}, solved "
              f"{result['final_solved']:.2f}, length {result['final_length']:.1f}, {result['wall_s']:.0f} s",
              flush=True)
        return
    if not args.summary:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        t0 = time.perf_counter()
        todo = [(cell, seed, arm) for cell in args.cells.split(",") for seed in range(args.seeds)
                for arm in args.arms.split(",") if not _path(out, cell, arm, seed).exists()]
        for done, (cell, seed, arm) in enumerate(todo):
            if args.budget_s is not None and time.perf_counter() - t0 > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: {len(todo) - done} runs left, stopped before {cell} "
                      f"{arm} seed {seed}")
                break
            task_name, lr = cell.split("@")
            subprocess.run([sys.executable, __file__, "--one", arm, task_name, lr, str(seed), "--out", str(out),
                            "--steps", str(args.steps)], check=True, env={**os.environ, "EXP_COMMIT": commit})
    s = summary(out)
    atomic_write(out / "summary.json", lambda tmp: Path(tmp).write_text(json.dumps(s, indent=1)))
    print(markdown(s))


if __name__ == "__main__":
    main()
