"""LocalEngine before and after a change, interleaved in one process: tokens per CPU second and per wall second.

`--before DIR` is a copy of an earlier `src/` (e.g. `cp -r src /tmp/before_src` before editing): its `phantomclip`
is imported under another name beside this tree's, both engines are built from the same master weights, and each
round runs one generate of each (order alternated between rounds: ABBA...) at every row count, so that both share
the machine's noise; the same seed and prompts make both sample the same tokens where the change is exact (checked:
the bench stops if they differ). Prints median [min-max] per path and the after / before ratio of the medians, with
the 1-minute load average before and after. Workload: bench_engine's (bundled SmolLM2-135M, prompts of 24 random
ids, 64 sampled tokens, temperature 1, no stop tokens).

    python bench/benchmarks/ab_engine.py --before /tmp/before_src [--dtype bf16] [--rows 16,64] [--rounds 4]
        [--threads 1]

Feeds the before/after lines of an engine change's bench/RESULTS.md entry (2026-12-03, fourth session: "Whole
generates"; 2026-12-03 16:16-17:45 UTC, the sampler's CDF: "Whole generates, old and new interleaved").
bench_refactor.py is the same A/B from a git commit, each run in a fresh process, on wall time.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from phantomclip.engines.local import LocalEngine, SamplingParams
from phantomclip.models.load import load_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def import_before(src: Path):
    """The `phantomclip` package under `src` as module `phantomclip_before` (its relative imports stay inside it)."""
    pkg = src / "phantomclip"
    spec = importlib.util.spec_from_file_location("phantomclip_before", pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["phantomclip_before"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("phantomclip_before.engines.local")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, type=Path, help="a copy of src/ from before the change")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--rows", default="16,64", help="row counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds after one warm-up (>= 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    if not (args.before / "phantomclip" / "engines/local.py").exists() or args.rounds < 2:
        print(f"ab_engine: {args.before} holds no phantomclip/engines/local.py, or --rounds < 2", file=sys.stderr)
        raise SystemExit(2)
    torch.set_num_threads(args.threads)
    old = import_before(args.before)
    lm = load_model("smollm2-135m", progress=lambda *a: None)
    dtype, rows = DTYPES[args.dtype], [int(n) for n in args.rows.split(",")]
    engines = {"before": old.LocalEngine(lm.model, dtype), "after": LocalEngine(lm.model, dtype)}
    params = {"before": old.SamplingParams(max_tokens=64, seed=0), "after": SamplingParams(max_tokens=64, seed=0)}
    prompts = {n: torch.randint(100, 49000, (n, 24), generator=torch.Generator().manual_seed(1)).tolist() for n in rows}
    load0 = os.getloadavg()[0]
    out = {(k, n): {"cpu": [], "wall": []} for n in rows for k in engines}
    for r in range(args.rounds + 1):  # round 0 is the warm-up
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for n in rows:
            got = {}
            for k in order:
                w0, c0 = time.perf_counter(), time.process_time()
                ro = engines[k].generate(prompts[n], params[k])
                cpu, wall = time.process_time() - c0, time.perf_counter() - w0
                tokens = sum(len(c) for c in ro.completion_ids)
                got[k] = (ro.completion_ids, ro.logp_engine)
                if r:
                    out[k, n]["cpu"].append(tokens / cpu)
                    out[k, n]["wall"].append(tokens / wall)
            if got["before"] != got["after"]:
                print(f"ab_engine: before and after sampled other tokens or log-probs at {n} rows", file=sys.stderr)
                raise SystemExit(1)
        print(f"round {r} done, load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"\n{args.dtype}, {args.threads} thread(s), {args.rounds} rounds (ABBA) after a warm-up; load average "
          f"{load0:.1f} -> {os.getloadavg()[0]:.1f}; tokens and log-probs identical in every generate\n")
    print("| rows | clock | before, tok/s median [min-max] | after | after / before |\n|---:|---|---:|---:|---:|")
    for n in rows:
        for c in ("cpu", "wall"):
            b, a = out["before", n][c], out["after", n][c]
            print(f"| {n} | {c} | {statistics.median(b):.0f} [{min(b):.0f}-{max(b):.0f}] | {statistics.median(a):.0f} "
                  f"[{min(a):.0f}-{max(a):.0f}] | {statistics.median(a) / statistics.median(b):.2f}x |")


if __name__ == "__main__":
    main()
