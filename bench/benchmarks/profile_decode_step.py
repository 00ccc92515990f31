"""Where one LocalEngine decode step goes: process CPU time per step and per sampler call, and torch.profiler's
operator table, on the bundled model.

Per row count: the CPU time of a generate of 1 + S tokens minus that of a generate of 1 token (the prefill and the
first sample), over S, is one decode step; the sampler line is the decode loop's own call (`_Sampler.pick`, its
fp64 buffer reused) on random logits of that batch's shape, median of 9. The operator table is torch.profiler's over
the generate of 1 + S tokens (its prefill included; self time per op, wall-clock based: on a loaded machine read its
shares, not its milliseconds).

    python bench/benchmarks/profile_decode_step.py [--dtype bf16] [--rows 16,64] [--steps 16] [--threads 1] [--ops 14]

Feeds bench/RESULTS.md "2026-12-03 16:16-17:45 UTC: the sampler's CDF in one reused buffer" ("Profile first"); rerun it
when the decode loop changes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from phantomclip.engines.local import LocalEngine, SamplingParams, _Sampler
from phantomclip.models.load import load_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cpu_ms(fn) -> float:
    c0 = time.process_time()
    fn()
    return 1000 * (time.process_time() - c0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--rows", default="16,64", help="row counts, comma-separated")
    ap.add_argument("--steps", type=int, default=16, help="decode steps profiled per row count")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: the engine's own work)")
    ap.add_argument("--ops", type=int, default=14, help="operators shown per table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model("smollm2-135m", progress=lambda *a: None)
    engine = LocalEngine(lm.model, DTYPES[args.dtype])
    print(f"load average {os.getloadavg()[0]:.1f}; {args.dtype}, {args.threads} thread(s), prompts of 24 tokens")
    for rows in (int(n) for n in args.rows.split(",")):
        prompts = torch.randint(100, 49000, (rows, 24), generator=torch.Generator().manual_seed(1)).tolist()
        engine.generate(prompts, SamplingParams(max_tokens=2, seed=0))  # warm-up: packing, allocations
        first = cpu_ms(lambda: engine.generate(prompts, SamplingParams(max_tokens=1, seed=0)))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            whole = cpu_ms(lambda: engine.generate(prompts, SamplingParams(max_tokens=1 + args.steps, seed=0)))
        step = (whole - first) / args.steps
        logits = torch.randn(rows, lm.model.config.vocab_size).to(DTYPES[args.dtype])  # [rows, V]
        sampler = _Sampler(SamplingParams(seed=0), "cpu")
        sampler.pick(0, logits)
        samp = statistics.median(cpu_ms(lambda: sampler.pick(0, logits)) for _ in range(9))
        print(f"\n{rows} rows: one decode step {step:.0f} CPU ms (prefill + first sample {first:.0f}); the sampler "
              f"{samp:.1f} CPU ms per call ({100 * samp / step:.0f}% of a step)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops))


if __name__ == "__main__":
    main()
