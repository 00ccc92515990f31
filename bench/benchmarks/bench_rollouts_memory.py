"""The peak resident memory of a whole `diagnose --rollouts` run, per completion token.

    python bench/benchmarks/bench_rollouts_memory.py [--rounds 3] [--sizes 2048,8192,32768] [--steps 4]
                                                     [--model tiny-random:0] [--length 64]

A recorded run is synthesised from one real sampled run: `diagnose --model M --n 64 --max-tokens LENGTH
--save-rollouts` on this machine (so every record passes the checkpoint check: these weights sampled it), its records
then repeated until the file holds SIZE completion tokens, split evenly over `--steps` steps (each record given a
`step`, docs/rollouts.md). Each file is diagnosed by `phantomclip diagnose --model M --rollouts FILE --json OUT` (the
default recipes; a post-mortem, since the file holds several steps) in a fresh process, `--rounds` times per size,
sizes interleaved. The child resets the high-water mark VmHWM (/proc/self/clear_refs) after its imports, so its
peak is of the run alone (model load included); the figure is the slope between sizes of the median peaks, in bytes
per completion token: the model's and the recipes' fixed cost cancels, what is left grows with the tokens.

`--per-step` keeps each step's size fixed (the smallest size) and grows the number of steps instead (steps, 2x, 4x
steps): a slope there is memory the run keeps from one step to the next, not one step's own working set.

Feeds bench/RESULTS.md "13. The memory of a whole `diagnose --rollouts` run, per completion token".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
import torch  # noqa: F401  the imports are not the run's memory
from phantomclip.cli.main import main
from phantomclip.diagnose import postmortem  # noqa: F401

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current resident set
base = kib("VmRSS")
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "base_kib": base, "peak_kib": kib("VmHWM")}))
"""


def _env() -> dict:
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(ROOT / "src")}


def sampled_records(model: str, length: int, tmp: Path) -> tuple[str, list[dict]]:
    """(header line, records) of one real sampled run of `model` (64 sequences of up to `length` tokens)."""
    path = tmp / "sampled.jsonl"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "phantomclip.cli.main",
            "diagnose",
            "--model",
            model,
            "--n",
            "64",
            "--max-tokens",
            str(length),
            "--trainer",
            "fp32",
            "--no-batch-invariance",
            "--save-rollouts",
            str(path),
        ],
        check=True,
        capture_output=True,
        env=_env(),
    )
    lines = path.read_text().splitlines()
    return lines[0], [json.loads(line) for line in lines[1:]]


def write_run(path: Path, header: str, records: list[dict], tokens: int, steps: int) -> int:
    """A file of `steps` steps holding at least `tokens` completion tokens (the records repeated in order, each step
    at least tokens / steps of them); returns the completion tokens written."""
    per_step, written = -(-tokens // steps), 0
    with open(path, "w") as f:
        f.write(header + "\n")
        i = 0
        for step in range(steps):
            held = 0
            while held < per_step:
                r = records[i % len(records)]
                f.write(json.dumps({**r, "step": step}) + "\n")
                held += len(r["completion_ids"])
                i += 1
            written += held
    return written


def peak(model: str, path: Path, out: Path, extra: list[str]) -> dict:
    """One whole `diagnose --rollouts` in a fresh process: its peak resident memory (bytes) after its imports."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            "diagnose",
            "--model",
            model,
            "--rollouts",
            str(path),
            "--json",
            str(out),
            *extra,
        ],
        check=True,
        capture_output=True,
        text=True,
        env=_env(),
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if got["rc"] not in (0, 1):  # 1: a --fail-if gate or the answer's own status; the run itself completed
        raise SystemExit(f"diagnose exited {got['rc']}: {done.stderr[-2000:]}")
    return {"peak": got["peak_kib"] * 1024, "base": got["base_kib"] * 1024}


def slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares slope of ys on xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def measure(
    model: str, header: str, records: list[dict], plan: list[tuple[int, int]], rounds: int, tmp: Path, extra: list[str]
) -> list[dict]:
    """For each (tokens, steps) of `plan`: the file, and the median peak of `rounds` runs (plans interleaved)."""
    files = []
    for tokens, steps in plan:
        path = tmp / f"run-{tokens}-{steps}.jsonl"
        files.append(
            {"tokens": write_run(path, header, records, tokens, steps), "steps": steps, "path": path, "peaks": []}
        )
    for _ in range(rounds):
        for f in files:
            f["peaks"].append(peak(model, f["path"], tmp / "out.json", extra)["peak"])
    for f in files:
        f["median"] = statistics.median(f["peaks"])
    return files


def table(title: str, files: list[dict]) -> None:
    print(title)
    print("| completion tokens | steps | peak RSS per run (MB) | **median (MB)** |")
    print("|---:|---:|---|---:|")
    for f in files:
        runs = ", ".join(f"{p / 1e6:.1f}" for p in f["peaks"])
        print(f"| {f['tokens']:,} | {f['steps']} | {runs} | **{f['median'] / 1e6:.1f}** |")
    xs, ys = [f["tokens"] for f in files], [f["median"] for f in files]
    pairs = ", ".join(
        f"{a['tokens']:,}->{b['tokens']:,}: {slope([a['tokens'], b['tokens']], [a['median'], b['median']]):.0f}"
        for a, b in zip(files, files[1:])
    )
    print(f"bytes per completion token (slope of the medians): {slope(xs, ys):.0f} (least squares); {pairs}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sizes", default="2048,8192,32768", help="completion tokens of each run, comma-separated")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--model", default="tiny-random:0")
    p.add_argument("--length", type=int, default=64, help="the sampled completions' --max-tokens")
    p.add_argument("--per-step", action="store_true", help="also grow the number of steps at a fixed step size")
    p.add_argument("--no-batch-invariance", action="store_true", help="pass it to diagnose (no single-row pass)")
    args = p.parse_args()
    extra = ["--no-batch-invariance"] if args.no_batch_invariance else []
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        header, records = sampled_records(args.model, args.length, Path(tmp))
        grown = measure(args.model, header, records, [(s, args.steps) for s in sizes], args.rounds, Path(tmp), extra)
        if args.per_step:
            each = sizes[0] // args.steps
            steps = [args.steps, 2 * args.steps, 4 * args.steps]
            more = measure(args.model, header, records, [(each * s, s) for s in steps], args.rounds, Path(tmp), extra)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; commit {commit.strip()}; model {args.model}, "
        f"default recipes{' --no-batch-invariance' if extra else ''}, {len(records)} sampled records of up to "
        f"{args.length} tokens repeated; "
        f"{args.rounds} rounds, a fresh process each"
    )
    table(f"whole run, {args.steps} steps, growing the steps' size:", grown)
    if args.per_step:
        table(f"fixed step size ({each:,} tokens), growing the number of steps:", more)


if __name__ == "__main__":
    main()
