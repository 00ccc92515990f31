"""End-to-end wall time of `phantomclip diagnose` with default settings on the bundled model.

Runs `phantomclip diagnose --json /tmp/bench_diag.json` as a subprocess (64 prompts x up to 48 tokens sampled
by a bf16 engine, then re-scored under every trainer recipe), twice, and reports the median wall time, which
includes interpreter start-up and model loading. Target: under 180 s on this 2-core CPU. From the JSON of the
last run it also prints the engine's tokens/s and each recipe's scoring `seconds`.

    python bench/benchmarks/bench_diagnose.py [--quick]

Feeds bench/RESULTS.md §3 ("`phantomclip diagnose`, default settings") and docs/results.md "How long `diagnose` takes".
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

JSON_PATH = "/tmp/bench_diag.json"


def command() -> list[str]:
    exe = shutil.which("phantomclip") or str(Path(sys.executable).with_name("phantomclip"))
    return [exe, "diagnose", "--json", JSON_PATH]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one run instead of two")
    args = ap.parse_args()
    runs = 1 if args.quick else 2
    walls = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(command(), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        walls.append(time.perf_counter() - t0)
    wall = statistics.median(walls)
    result = json.loads(Path(JSON_PATH).read_text())
    e = result["engine"]

    print(f"command: {' '.join(command())}  ({runs} runs)\n")
    print("| runs (s) | median wall (s) | target | met |\n|---|---:|---:|---|")
    print(f"| {', '.join(f'{w:.1f}' for w in walls)} | {wall:.1f} | < 180 s | {'yes' if wall < 180 else 'NO'} |\n")
    print(f"engine: {e['dtype']} ({e['matmul']} matmul), {e['sequences']} sequences, {e['tokens']} tokens sampled in "
          f"{e['seconds']:.1f} s = {e['tokens_per_s']:.0f} tokens/s (last run)\n")
    print("| stage | seconds (last run) |\n|---|---:|")
    print(f"| sampling ({e['dtype']} engine) | {e['seconds']:.1f} |")
    for name, stats in result["recipes"].items():
        print(f"| scoring {name} | {stats['seconds']:.1f} |")
    accounted = e["seconds"] + sum(s["seconds"] for s in result["recipes"].values())
    print(f"| rest (start-up, model load, metrics, JSON) | {walls[-1] - accounted:.1f} |")


if __name__ == "__main__":
    main()
