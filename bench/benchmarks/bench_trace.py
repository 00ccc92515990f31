"""`phantomclip trace` on the bundled model with default settings: wall time (target < 2 minutes on 2 cores) and
the cost of the forward hooks (the traced recipe's forward with hooks against the same forward without).

    python bench/benchmarks/bench_trace.py [--repeats 1]

Feeds bench/RESULTS.md §5 ("`phantomclip trace`, default settings"), docs/results.md "`trace`'s cost" and docs/trace.md
"Along the depth".
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    walls, overheads = [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "trace.json"
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "phantomclip.cli.main", "trace", "--json", str(out)], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            walls.append(time.perf_counter() - t0)
            result = json.loads(out.read_text())
            overheads.append(result["hook_overhead"])
    print(f"phantomclip trace (bundled model, defaults): wall {', '.join(f'{w:.1f}' for w in walls)} s, median "
          f"{statistics.median(walls):.1f} s (target < 120 s)")
    print(f"hook overhead on the traced forward: {', '.join(f'{100 * o:.0f}%' for o in overheads)}")
    print(f"tokens {result['tokens']}, mean |β| {result['beta']['beta_abs_mean']:.4f}, first order explains "
          f"{100 * result['first_order']['explained_share']:.1f}%")
    for r in result["what_if"]:
        print(f"  keep {','.join(r['keep_fp32']):40s} mean |β| {r['beta_abs_mean']:.4f}  "
              f"outside {100 * r['outside_trust_region']:.2f}%  extra {r['extra_mib']:.1f} MiB  "
              f"forward {r['forward_s']:.2f} s")
    sp = result.get("split")
    if sp:
        print(f"split: weights-only {sp['weights_only']['beta_abs_mean']:.4f}, "
              f"compute-only {sp['compute_only']['beta_abs_mean']:.4f}, whole {sp['whole']['beta_abs_mean']:.4f}, "
              f"weights share of variance {100 * sp['weights_share_of_variance']:.0f}%, "
              f"quadrature ratio {sp['quadrature_ratio']:.2f}")
    for s in result["sites"]:
        if s["site"].endswith("residual") or s["site"] in ("embed", "final_norm", "logits", "logprobs"):
            print(f"  {s['site']:22s} rel {s['rel_error']:.3e}  max|d| {s['max_abs_error']:.3g}  "
                  f"ref rms {s['ref_rms']:.3g}  ref max {s['ref_max_abs']:.3g}")
    for b in result["first_order"]["buckets"]:
        print(f"  p in [{b['p_low']:g}, {b['p_high']:g}): {b['tokens']} tokens, mean |β| {b['beta_abs_mean']:.4f}, "
              f"|dz_y| {b['dz_target_abs_mean']:.4f}, |Σp dz| {b['dz_expected_abs_mean']:.4f}")


if __name__ == "__main__":
    main()
