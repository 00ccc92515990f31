"""No regression from a refactor: `phantomclip diagnose` wall time of an older commit against this tree.

The older commit is checked out into a temporary git worktree; both trees run the same command in a subprocess,
alternating (old, new, old, new, ...) so both see the same machine noise, and the medians are compared. The fp16
recipe is left out: since 9e3e6ef `--matmul auto` picks another fp16 kernel on CPUs without fp16 instructions, so
its time is not the refactor's.

    python bench/bench_refactor.py [--old 57c664d] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["diagnose", "--n", "32", "--max-tokens", "32", "--trainer", "fp32,bf16,bf16-autocast,fp32-head"]


def timed(src: Path, out: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(src)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "phantomclip.cli", *FLAGS, "--json", str(out)], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default="57c664d", help="the commit before the refactor")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(old_tree), args.old],
                       check=True, capture_output=True)
        try:
            times: dict[str, list[float]] = {"old": [], "new": []}
            for _ in range(args.repeats):
                for name, src in (("old", old_tree / "src"), ("new", ROOT / "src")):
                    times[name].append(timed(src, Path(tmp) / f"{name}.json"))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old_tree)], check=False)
    old, new = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"phantomclip {' '.join(FLAGS)}")
    for name in times:
        runs = ", ".join(f"{t:.1f}" for t in times[name])
        print(f"{name}: median {statistics.median(times[name]):.1f} s over {runs}")
    print(f"new / old: {new / old:.3f}  (commit {args.old} against this tree; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")


if __name__ == "__main__":
    main()
