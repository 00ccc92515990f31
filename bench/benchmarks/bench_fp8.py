"""FP8 engine recipes against the plain bf16 recipe on the bundled model: scoring (what diagnose runs for the FP8
shadow) and the local engine's sampling (what the FP8 arms of `experiment fp8` run).

Target (issue: FP8 rollouts): FP8 scoring in diagnose at most 2x the time of the bf16 engine recipe; the FP8 arms of
the experiment within 1.5x the bf16 arms' time.

Every time is CPU seconds of the process (`time.process_time`, both threads): the machine this was written on was
shared with a dozen other jobs (load average 15-20), under which a wall clock measures the queue, not the recipe.

Workload: bundled SmolLM2-135M. Scoring: 4 x 128 random token ids (seed 0, ids in [100, 49000)), every position
scored with the entropy, as diagnose's `score_recipe` does; each recipe's time includes laying the model out
(`apply_recipe`) and its first forward, where the FP8 weights are quantised (diagnose pays both once per recipe),
then the median of 2 warm calls. Sampling: `LocalEngine.generate`, the first 4 bundled prompts, 8 tokens, seed 0,
one warm-up call, median of 2. Recipes are timed in rounds, bf16 first then the FP8 ones, then in reverse order
(ABBA), so machine noise hits all alike; the ratio is each recipe's median over bf16's.

    python bench/benchmarks/bench_fp8.py [--rounds 2] [--recipes bf16,bf16+fp8-w8a8]
    python bench/benchmarks/bench_fp8.py --rows 64 --tokens 80 --scoring-only   # diagnose's own shape (below)

`--rows 64 --tokens 80` is what a default `phantomclip diagnose` scores per recipe: its 64 prompts in one batch of 64
(`DiagnoseConfig.batch_size`), each up to 48 completion tokens after a bundled prompt of about 30 tokens; diagnose
lays the model out and scores that batch once, which is this bench's "cold" column.

Feeds bench/RESULTS.md "2026-12-03: FP8 engine recipes against bf16" and the FP8 entries after it, and docs/results.md
"FP8 engines: the tiny model's experiment, the cost, what was not run" (**Cost**).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from phantomclip.engines.local import LocalEngine, SamplingParams
from phantomclip.models.load import load_model
from phantomclip.models.prompts import bundled_prompts, encode_within
from phantomclip.precision.recipes import apply_recipe, get_recipe
from phantomclip.precision.scoring import score

RECIPES = ("bf16", "bf16+fp8-w8a8", "bf16+fp8-w8a8+fp8-kv", "bf16+fp8-w8a16")
B, T, PROMPTS, TOKENS = 4, 128, 4, 8
clock = time.process_time
"""CPU seconds of this process (all its threads): on a shared machine whose load changes within a run, the CPU time a
recipe takes moves far less than its wall time, which counts the time other jobs held the cores."""


def time_scoring(master, name: str, ids, attn) -> tuple[float, float]:
    """(seconds of layout + first call, median seconds of 2 warm calls)."""
    recipe = get_recipe(name)
    t0 = clock()
    model = apply_recipe(master, recipe)
    score(model, recipe, ids, attn)
    cold = clock() - t0
    warm = []
    for _ in range(2):
        t0 = clock()
        score(model, recipe, ids, attn)
        warm.append(clock() - t0)
    return cold, statistics.median(warm)


def time_sampling(master, name: str, prompts) -> float:
    engine = LocalEngine(master, recipe=get_recipe(name))
    params = SamplingParams(max_tokens=TOKENS, seed=0)
    engine.generate(prompts, params)
    runs = []
    for _ in range(2):
        t0 = clock()
        engine.generate(prompts, params)
        runs.append(clock() - t0)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--rows", type=int, default=B, help="scored sequences (diagnose's default run: 64)")
    ap.add_argument("--tokens", type=int, default=T, help="tokens per scored sequence (diagnose's default run: ~80)")
    ap.add_argument("--scoring-only", action="store_true", help="skip the sampling timings")
    args = ap.parse_args()
    lm = load_model("smollm2-135m")
    master = lm.model
    ids = torch.randint(100, 49000, (args.rows, args.tokens), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    prompts = encode_within(lm.tokenizer, bundled_prompts()[:PROMPTS], TOKENS, lm.context_length, "the model's context")
    recipes = tuple(args.recipes.split(","))
    cold, warm, sample = ({n: [] for n in recipes} for _ in range(3))
    for r in range(args.rounds):
        order = recipes if r % 2 == 0 else tuple(reversed(recipes))
        for name in order:
            c, w = time_scoring(master, name, ids, attn)
            cold[name].append(c), warm[name].append(w)
            sample[name].append(float("nan") if args.scoring_only else time_sampling(master, name, prompts))
            print(f"round {r + 1} {name}: CPU s: scoring cold {c:.2f}, warm {w:.2f}; sampling {sample[name][-1]:.2f}",
                  flush=True)
    med = {k: {n: statistics.median(v[n]) for n in recipes} for k, v in
           (("cold", cold), ("warm", warm), ("sample", sample))}
    print(f"\n| recipe | scoring, layout + first call (CPU s) | ratio | scoring, warm (CPU s) | ratio | "
          f"sampling {PROMPTS} x {TOKENS} (CPU s) | ratio |\n|---|---|---|---|---|---|---|")
    for n in recipes:
        print(f"| {n} | {med['cold'][n]:.2f} | {med['cold'][n] / med['cold']['bf16']:.2f}x | {med['warm'][n]:.2f} | "
              f"{med['warm'][n] / med['warm']['bf16']:.2f}x | {med['sample'][n]:.2f} | "
              f"{med['sample'][n] / med['sample']['bf16']:.2f}x |")


if __name__ == "__main__":
    main()
