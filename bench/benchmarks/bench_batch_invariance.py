"""What the default-on batch-invariance pass (`--no-batch-invariance` turns it off) costs in one `phantomclip diagnose`
run with default settings on the bundled model: the same run with and without it, median wall time of --repeats
runs each, interleaved (on, off, off, on, ...) so that a change of the shared machine's load falls on both; and, from
the runs with it, each recipe's `seconds_alone` (its rows scored one at a time) against its batched scoring
(`seconds`).

    python bench/benchmarks/bench_batch_invariance.py [--repeats 3]

Feeds bench/RESULTS.md "The batch-invariance pass's cost" (2026-12-07), the --no-batch-invariance help
(diagnose/config.py) and docs/diagnose.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs with and without the pass, each (default 3)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
    from conftest import cpu_kind
    from phantomclip.diagnose.job import DiagnoseConfig, run_diagnose

    walls: dict[bool, list[float]] = {True: [], False: []}
    ratios: list[float] = []  # per recipe and run: seconds_alone / seconds
    for i in range(args.repeats):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            t0 = time.perf_counter()
            result = run_diagnose(DiagnoseConfig(batch_invariance=on))
            walls[on].append(time.perf_counter() - t0)
            recs = result["recipes"].values()
            alone, batched = sum(r.get("seconds_alone", 0.0) for r in recs), sum(r["seconds"] for r in recs)
            if on:
                ratios += [r["seconds_alone"] / r["seconds"] for r in recs if r.get("seconds")]
            each = ", ".join(f"{r.get('seconds_alone', 0.0) / r['seconds']:.2f}x" for r in recs)
            print(f"run {i} batch_invariance={on}: wall {walls[on][-1]:.1f} s, sampling "
                  f"{result['engine']['seconds']:.1f} s, batched scoring {batched:.1f} s, rows alone {alone:.1f} s "
                  f"({each} of each recipe's batched scoring)", flush=True)
    with_it, without = statistics.median(walls[True]), statistics.median(walls[False])
    cfg = DiagnoseConfig()
    print(f"CPU kind: {cpu_kind()}; diagnose defaults ({cfg.model}, {cfg.n} x {cfg.max_tokens} tokens, recipes "
          f"{','.join(cfg.trainer)}), {args.repeats} runs each")
    print(f"with the pass: median {with_it:.1f} s ({', '.join(f'{w:.1f}' for w in walls[True])})")
    print(f"without: median {without:.1f} s ({', '.join(f'{w:.1f}' for w in walls[False])})")
    print(f"the pass costs {with_it - without:.1f} s = {100 * (with_it - without) / without:.1f}% of the run without "
          f"it; rows alone / batched scoring per recipe: {min(ratios):.2f}-{max(ratios):.2f}x (median "
          f"{statistics.median(ratios):.2f}x)")


if __name__ == "__main__":
    main()
