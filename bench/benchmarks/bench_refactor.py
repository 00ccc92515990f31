"""No regression from a change: the CPU hot paths of an older commit against this tree, on the same machine.

The older commit is checked out into a temporary git worktree. Each workload runs in a fresh subprocess with
PYTHONPATH at one tree's src/, the two trees alternating in ABBA order (old, new, new, old, ...) so both see the same
machine noise and neither always runs first; each run prints one figure and the medians over runs are compared.

Workloads (bundled SmolLM2-135M, 2 threads unless the machine has fewer):
  engine-fp32, engine-bf16  `LocalEngine.generate` (`--matmul auto`), 16 prompts of 24 random ids (seed 1), 64 sampled
                            tokens each (no stop tokens: every row runs to 64); tokens/s, median of 3 calls after a
                            warm-up (the workload of bench_engine.py's 16-row rows).
  scoring-bf16              `scoring.score` with the bf16 recipe on 8 x 256 random ids (seed 0); tokens/s, median of 5
                            calls after a warm-up (bench_scoring.py's workload).
  train                     `phantomclip train`, 5 steps of 8 completions x 32 tokens (fp32 trainer, bf16 engine);
                            steps/s = 1 / median `time/step_s` of steps 2-5; completion lengths printed (the same
                            seed and numbers give the same lengths on both trees, so the work compared is equal).
  diagnose                  `phantomclip diagnose --n 32 --max-tokens 32 --trainer fp32,bf16,bf16-autocast,fp32-head`
                            (fp16 left out: since 9e3e6ef `--matmul auto` picks another fp16 kernel on CPUs without
                            fp16 instructions); 1 / wall seconds.
Higher is better for every figure; new / old is the ratio of medians.

    python bench/benchmarks/bench_refactor.py [--old 56b808e^] [--repeats 3] [--workloads engine-fp32,engine-bf16,...]

Feeds bench/RESULTS.md "2026-12-02, seventh session: the CPU hot paths before and after `--device`" and (2026-12-01) "No
regression from the refactor", and docs/results.md "Before and after `--device` on the CPU". The workloads import this
tree's module paths (the packages since e7918ce), so --old must be e7918ce or later: the default, 56b808e^, is older
and no longer runs.
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

PRELUDE = """
import json, statistics, time, torch
torch.manual_seed(0)
torch.set_num_threads(min(2, torch.get_num_threads()))
from phantomclip.models.load import load_model
master = load_model("smollm2-135m", progress=lambda *a, **k: None).model.float().eval()
def median_rate(call, units, repeats):
    call()  # warm-up: kernels chosen, weights packed
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter(); call(); times.append(time.perf_counter() - t0)
    return units / statistics.median(times)
"""

ENGINE = PRELUDE + """
from phantomclip.engines.local import LocalEngine, SamplingParams
from phantomclip.precision.recipes import engine_recipe
engine = LocalEngine(master, recipe=engine_recipe({dtype}), matmul="auto")
g = torch.Generator().manual_seed(1)
prompts = torch.randint(100, 49000, (16, 24), generator=g).tolist()
params = SamplingParams(max_tokens=64)
rate = median_rate(lambda: engine.generate(prompts, params), 16 * 64, 3)
print(json.dumps({{"figure": rate, "unit": "tokens/s"}}))
"""

SCORING = PRELUDE + """
from phantomclip.precision.recipes import apply_recipe, get_recipe
from phantomclip.precision.scoring import score
recipe = get_recipe("bf16")
model = apply_recipe(master, recipe, matmul="auto")
g = torch.Generator().manual_seed(0)
ids = torch.randint(100, 49000, (8, 256), generator=g)
attn, mask = torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool)
with torch.no_grad():
    rate = median_rate(lambda: score(model, recipe, ids, attn, mask), 8 * 256, 5)
print(json.dumps({"figure": rate, "unit": "tokens/s"}))
"""

TRAIN_FLAGS = ["train", "--steps", "5", "--group-size", "8", "--max-tokens", "32", "--checkpoint-every", "100"]
DIAGNOSE_FLAGS = ["diagnose", "--n", "32", "--max-tokens", "32", "--trainer", "fp32,bf16,bf16-autocast,fp32-head"]


def _env(src: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(src)}


def _snippet(code: str, src: Path, tmp: Path) -> tuple[float, str]:
    out = subprocess.run([sys.executable, "-c", code], env=_env(src), check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["figure"], ""


def _train(src: Path, tmp: Path) -> tuple[float, str]:
    run = tmp / f"run-{time.monotonic_ns()}"
    subprocess.run([sys.executable, "-m", "phantomclip.cli.main", *TRAIN_FLAGS, "--out", str(run)], env=_env(src),
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["time/step_s"] for r in rows if r["step"] >= 2]
    lengths = [round(r["completion/length_mean"], 2) for r in rows if "completion/length_mean" in r]
    return 1 / statistics.median(steps), f"lengths {lengths}"


def _diagnose(src: Path, tmp: Path) -> tuple[float, str]:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "phantomclip.cli.main", *DIAGNOSE_FLAGS, "--json", str(tmp / "d.json")],
                   env=_env(src), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return 1 / (time.perf_counter() - t0), ""


WORKLOADS = {
    "engine-fp32": lambda src, tmp: _snippet(ENGINE.format(dtype="torch.float32"), src, tmp),
    "engine-bf16": lambda src, tmp: _snippet(ENGINE.format(dtype="torch.bfloat16"), src, tmp),
    "scoring-bf16": lambda src, tmp: _snippet(SCORING, src, tmp),
    "train": _train,
    "diagnose": _diagnose,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default="56b808e^", help="the commit before the change")
    ap.add_argument("--repeats", type=int, default=3, help="(old, new) pairs per workload")
    ap.add_argument("--workloads", default="engine-fp32,engine-bf16,scoring-bf16,train")
    args = ap.parse_args()
    names = args.workloads.split(",")
    old_commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.old], check=True,
                                capture_output=True, text=True).stdout.strip()
    new_commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(old_tree), old_commit],
                       check=True, capture_output=True)
        try:
            figures = {n: {"old": [], "new": []} for n in names}
            for name in names:
                for i in range(args.repeats):
                    pair = (("old", old_tree / "src"), ("new", ROOT / "src"))
                    for side, src in pair if i % 2 == 0 else pair[::-1]:  # ABBA: the order favours neither
                        value, note = WORKLOADS[name](src, Path(tmp))
                        figures[name][side].append(value)
                        print(f"  {name} {side}: {value:.3f} {note}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old_tree)], check=False)
    print(f"\nold: {old_commit}; new: this tree at {new_commit}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| workload | old (runs) | new (runs) | new / old (medians) |\n|---|---|---|---:|")
    for name in names:
        old, new = (figures[name][s] for s in ("old", "new"))
        print(f"| {name} | {', '.join(f'{v:.2f}' for v in old)} | {', '.join(f'{v:.2f}' for v in new)} | "
              f"{statistics.median(new) / statistics.median(old):.3f} |")


if __name__ == "__main__":
    main()
