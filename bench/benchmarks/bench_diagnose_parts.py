"""What the frameworks' figures, the knob advice, batch invariance and drift cost inside one `phantomclip diagnose`
run with default settings on the bundled model.

One run of diagnose's phases (`diagnose.measure`, then `figures`) in this process: 64 prompts x up to 48 tokens,
every default recipe. From it:
- batch invariance: the recipes' `seconds_alone` (their sampled rows scored again one at a time), against the wall
  time of the run without them (target: under 30%);
- the framework figures (every framework, every recipe) and the knob advice, each timed again on the run's own
  tensors (median of 5 calls), against the same wall time (target: under 5% together).
The wall time counts model loading, sampling, scoring and figures; interpreter start-up is outside it.

    python bench/benchmarks/bench_diagnose_parts.py

Feeds bench/RESULTS.md (2026-12-01, third session) "diagnose's parts", docs/results.md "How long `diagnose` takes" and
docs/metrics.md "Batch invariance".
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path


def median_seconds(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
    from conftest import cpu_kind
    from phantomclip.diagnose.job import DiagnoseConfig, figures, measure
    from phantomclip.diagnose.knobs import knob_figures
    from phantomclip.maths.frameworks import framework_figures

    cfg = DiagnoseConfig()
    cfg.validate()
    t0 = time.perf_counter()
    prep, sampled, scored, ref = measure(cfg)
    figures(cfg, scored, ref, sampled.mask)
    wall = time.perf_counter() - t0
    mask = sampled.mask
    alone = sum(s.seconds_alone for s in scored.values())
    frameworks = median_seconds(lambda: [framework_figures(scored[n].logp, ref.logp_engine, mask, cfg.framework)
                                         for n in cfg.trainer])
    first = cfg.trainer[0]
    knobs = median_seconds(lambda: knob_figures(scored[first].logp - ref.logp_engine, mask, cfg.knob_settings(),
                                                cfg.keep_share, cfg.knob_length or cfg.max_tokens))
    base = wall - alone - frameworks - knobs  # the run without the three additions
    print(f"CPU kind: {cpu_kind()}; diagnose defaults ({cfg.n} x {cfg.max_tokens} tokens, recipes "
          f"{','.join(cfg.trainer)}): wall {wall:.1f} s, of which sampling {sampled.seconds:.1f} s")
    print("| part | seconds | share of the run without them | target |")
    print("|---|---|---|---|")
    print(f"| batch invariance (rows scored alone) | {alone:.2f} | {100 * alone / base:.1f}% | < 30% |")
    print(f"| framework figures ({len(cfg.framework)} frameworks x {len(cfg.trainer)} recipes) | {frameworks:.3f} | "
          f"{100 * frameworks / base:.2f}% | |")
    print(f"| knob advice | {knobs:.3f} | {100 * knobs / base:.2f}% | |")
    print(f"| framework figures + knob advice | {frameworks + knobs:.3f} | {100 * (frameworks + knobs) / base:.2f}% "
          "| < 5% |")


if __name__ == "__main__":
    main()
