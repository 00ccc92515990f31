"""`diagnose --rollouts` against diagnose's own scoring of the same recipes on the same tokens, and the memory of
reading a large rollout file.

    python bench/benchmarks/bench_rollouts.py [--rounds 3] [--n 32] [--records 20000] [--allow-load]

Speed: one sampled run writes its tokens (`--save-rollouts`); then, in alternating order each round, the sampled run
again and the recorded run on its file, each in a fresh process (bundled model, fp32 and bf16 recipes, no batch
invariance). Per run: the recipes' scoring seconds (the JSON's `seconds`, model layout included) and, for the
recorded run, the reading and checking of the file (`engine.seconds`); the figure compared is tokens per second of
everything after sampling. Target: recorded >= 1.0x of sampled (ratio of medians, and the median of per-round
ratios).

Memory: a synthetic file of `--records` records (tiny-random:0's vocabulary, 32-token prompts, 64-token
completions) read and packed by `recorded.read_sampled` in a fresh process: its peak resident memory above the
process's baseline, against the file's size and what the packed tensors hold.

Feeds bench/RESULTS.md "2026-12-04: `diagnose --rollouts` against diagnose's own sampled run".
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import Load, refuse_if_loaded  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECIPES = "fp32,bf16"


def diagnose(args: list[str], out: Path) -> dict:
    """One `phantomclip diagnose` in a fresh process, its JSON."""
    cmd = [sys.executable, "-m", "phantomclip.cli.main", "diagnose", "--trainer", RECIPES, "--no-batch-invariance",
           "--json", str(out), *args]
    subprocess.run(cmd, check=True, capture_output=True, env={"PYTHONPATH": str(ROOT / "src"), **_env()})
    return json.loads(out.read_text())


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def after_sampling(d: dict, recorded: bool) -> tuple[float, int]:
    """(seconds of everything after sampling, tokens): the recipes' scoring, and a recorded run's reading."""
    seconds = sum(r["seconds"] for r in d["recipes"].values())
    if recorded:
        seconds += d["engine"]["seconds"]
    return seconds, d["engine"]["tokens"]


def speed(rounds: int, n: int, load: Load, tmp: Path) -> dict[str, list[float]]:
    path = tmp / "r.jsonl"
    sampled_args = ["--n", str(n), "--save-rollouts", str(path)]
    diagnose(sampled_args, tmp / "warm.json")  # the dense cache, the file
    rates: dict[str, list[float]] = {"sampled": [], "recorded": []}
    for i in range(rounds):
        order = ["sampled", "recorded"] if i % 2 == 0 else ["recorded", "sampled"]
        for name in order:
            load.start()
            args = ["--n", str(n)] if name == "sampled" else ["--rollouts", str(path)]
            seconds, tokens = after_sampling(diagnose(args, tmp / f"{name}.json"), name == "recorded")
            load.stop()
            rates[name].append(tokens / seconds)
    return rates


MEMORY_CHILD = """
import json, resource, sys, time
from phantomclip.diagnose.config import DiagnoseConfig
from phantomclip.models.load import load_model
from phantomclip.diagnose.recorded import read_sampled
lm = load_model("tiny-random:0")
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
s = read_sampled(DiagnoseConfig(model="tiny-random:0", rollouts=sys.argv[1], n=0), lm)
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
packed = sum(t.numel() * t.element_size() for p in s.packed for t in p.values())
held = packed + sum(t.numel() * t.element_size() for t in (s.mask, s.logp_engine, s.logp_engine_processed))
print(json.dumps({"tokens": int(s.mask.sum()), "seconds": seconds, "peak_above_base": (peak - base) * 1024,
                  "tensors": held}))
"""


def memory(records: int, tmp: Path) -> dict:
    """Peak memory of reading a synthetic file of `records` records (a fresh process)."""
    rng = random.Random(0)
    path = tmp / "big.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps({"phantomclip_rollouts": 1, "engine": {"dtype": "bfloat16"}}) + "\n")
        for _ in range(records):
            f.write(json.dumps({"prompt_ids": [rng.randrange(256) for _ in range(32)],
                                "completion_ids": [rng.randrange(256) for _ in range(64)],
                                "logp_engine": [-rng.random() * 5 for _ in range(64)]}) + "\n")
    out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(path)], check=True, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT / "src"), **_env()})
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "file_bytes": path.stat().st_size}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--records", type=int, default=20_000)
    p.add_argument("--allow-load", action="store_true", help="print the tables even if other jobs used the machine")
    args = p.parse_args()
    load = Load()
    load.read()
    with tempfile.TemporaryDirectory() as tmp:
        rates = speed(args.rounds, args.n, load, Path(tmp))
        mem = memory(args.records, Path(tmp))
    refuse_if_loaded(load, args.allow_load, "the timed runs")
    med = {k: statistics.median(v) for k, v in rates.items()}
    per_round = statistics.median(r / s for r, s in zip(rates["recorded"], rates["sampled"]))
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {load.line()}")
    print(f"after sampling, tokens/s (bundled model, recipes {RECIPES}, n {args.n}, {args.rounds} rounds):")
    for k, v in rates.items():
        print(f"  {k:<9} median {med[k]:.0f} (rounds: {', '.join(f'{x:.0f}' for x in v)})")
    print(f"  recorded / sampled: {med['recorded'] / med['sampled']:.2f}x (ratio of medians), "
          f"{per_round:.2f}x (median of per-round ratios); target >= 1.0x")
    print(f"memory: {args.records} records, {mem['tokens']} completion tokens, file {mem['file_bytes'] / 1e6:.1f} MB, "
          f"read and packed in {mem['seconds']:.1f} s; peak resident memory above the process's baseline "
          f"{mem['peak_above_base'] / 1e6:.1f} MB, of which the packed tensors {mem['tensors'] / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
