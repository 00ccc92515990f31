"""Experiment on the tiny MoE: none, r3 (rollout routing replay) and shadow-ratio, 3 seeds, read with 95% t intervals
(experiments.summarize, as `phantomclip experiment sanity` reads its arms). Random weights: the figures show the
mechanism (what replay removes from β, what it does to phantom clipping), not a real MoE's size.

Run: nice -n 15 python bench/experiments/exp_moe_r3.py [--out results/moe-r3] [--steps 40] [--lr 3e-3]; rerun to
continue.

Writes results/moe-r3 (its README records the run), which docs/results.md "Expert routing on the tiny MoE: what replay
removes" and the report's MoE section (docs/report.md; scripts/make_demo_data.py --moe) read.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from phantomclip.training.config import TrainConfig
from phantomclip.training.experiments import Matrix, run_experiment

ARMS = ("none", "r3", "shadow-ratio")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/moe-r3")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=3e-3, help="the tiny model learns within the budget at 3e-3 (the "
                    "experiments' default 3e-5 leaves its length at the 16-token cap for 20 steps: measured)")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    base = TrainConfig(model="tiny-moe:0", steps=args.steps, max_tokens=16, lr=args.lr, stop_after_converged=3)
    matrix = Matrix(experiment="moe-r3", base=base, arms={a: replace(base, intervention=a) for a in ARMS},
                    seeds=tuple(range(base.seed, base.seed + args.seeds)))
    summary = run_experiment(matrix, args.out)
    for row in summary.get("arms", []):
        print({k: v for k, v in row.items() if not isinstance(v, (list, dict))})


if __name__ == "__main__":
    main()
