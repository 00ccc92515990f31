"""Overhead of PrecisionMonitor (interval 1, bf16 shadow) per TRL GRPOTrainer step on the bundled model, CPU, fp32
trainer, at 1 process and at 2 (torchrun, gloo): the target (<= 15% of a plain step; the cross-rank collectives
< 1% of a step). Plain and monitored runs alternate in one invocation (plain, monitored, plain, monitored, ...).

Each rank: 1 prompt x 8 completions per step, all forced to max_completion_length (min_new_tokens), the first step of
every run is a warm-up and not timed. Threads: 2 with one process, 1 per process with two (2 cores).

    python bench/benchmarks/bench_trl_monitor.py [--steps 4] [--repeats 2] [--procs 1,2]

Timed per step (own callback, on_step_begin -> on_step_end, so generation and the optimizer step are in it):
the step; the monitor's `_measure` (shadow sync + shadow forward + precision_stats); `precision_stats` alone; its
two collectives (`ranks._all_reduce_sum`, `ranks._all_gather`; in a real run that includes waiting for the slower
rank); and, after training, `precision_stats` on a batch-sized input after a barrier (the collectives' own cost).
Also the CPU seconds other processes used during each step (/proc/stat minus this bench's process tree): the tables
are printed over the quiet steps (others < QUIET of the step's wall time) and over all timed steps.

Feeds bench/RESULTS.md §7 ("`PrecisionMonitor` overhead inside TRL's `GRPOTrainer`") and "2026-12-02, sixth session:
`PrecisionMonitor`'s cost in TRL at 1 and 2 processes", docs/results.md "`PrecisionMonitor`'s cost inside TRL" and
docs/trl.md "Cost".
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve()
MAX_LEN = 32
GROUP = 8


def cpu_kind() -> tuple[str, str]:
    text = Path("/proc/cpuinfo").read_text()
    flags, model = set(), "?"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags" and not flags:
            flags = set(value.split())
        if key.strip() == "model name" and model == "?":
            model = value.strip()
    kind = "amx" if "amx_bf16" in flags else "avx512bf16" if "avx512_bf16" in flags else "avx2"
    return kind, model


def machine_busy_s() -> float:
    """CPU seconds every core has been busy since boot (/proc/stat: all but idle and iowait)."""
    v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s(root: int) -> float:
    """CPU seconds used so far by `root` (this benchmark's driver) and every process below it (torchrun starts its
    ranks in new sessions, so the tree is followed, not a process group)."""
    parent, cpu = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        parent[int(d)] = int(fields[1])
        cpu[int(d)] = int(fields[11]) + int(fields[12])  # utime + stime
    total = 0
    for pid, ticks in cpu.items():
        p = pid
        while p > 1 and p != root:
            p = parent.get(p, 0)
        total += ticks if p == root else 0
    return total / os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------------------------- worker (one rank)


class Timers:
    """Per-step sums of wrapped functions' wall times: name -> {global_step: seconds}."""

    def __init__(self):
        self.by_step: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        self.step = -1

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.by_step[name][self.step] += time.perf_counter() - t0

        return timed


def one_run(monitored: bool, steps: int, out_dir: str, timers: Timers) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from phantomclip.integrations.trl import PrecisionMonitor
    from phantomclip.models.load import load_model
    from phantomclip.models.prompts import bundled_prompts

    class Clock(TrainerCallback):
        def __init__(self):
            self.times: dict[int, float] = {}
            self.others: dict[int, float] = {}  # CPU seconds other processes used during the step
            self.root = int(os.environ.get("BENCH_ROOT_PID", os.getpid()))

        def on_step_begin(self, args, state, control, **kw):
            timers.step = state.global_step  # the step _compute_loss sees (global_step before the increment)
            self.busy0, self.own0 = machine_busy_s(), own_cpu_s(self.root)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times[timers.step] = time.perf_counter() - self.t0
            busy, own = machine_busy_s() - self.busy0, own_cpu_s(self.root) - self.own0
            self.others[timers.step] = max(busy - own, 0.0)

    t_load = time.perf_counter()
    torch.manual_seed(0)
    lm = load_model("smollm2-135m", progress=lambda *a, **k: None)
    t_load = time.perf_counter() - t_load
    clock = Clock()
    callbacks = [clock]
    monitor = None
    if monitored:
        monitor = PrecisionMonitor(engine_dtype="bfloat16", interval=1)
        monitor._measure = timers.wrap("measure", monitor._measure)  # the instance attribute the hook calls
        callbacks.append(monitor)
    prompt = [{"role": "user", "content": bundled_prompts()[0]}]
    ds = Dataset.from_dict({"prompt": [prompt] * 4 * (steps + 1)})
    cfg = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=GROUP, num_generations=GROUP,
                     max_completion_length=MAX_LEN, report_to=[], use_cpu=True, save_strategy="no", bf16=False,
                     logging_steps=1, max_steps=steps + 1, learning_rate=1e-6, seed=0, shuffle_dataset=False,
                     generation_kwargs={"min_new_tokens": MAX_LEN})  # every completion MAX_LEN tokens: equal work
    reward = lambda completions, completion_ids, **kw: [float(sum(c) % 7) for c in completion_ids]  # noqa: E731
    trainer = GRPOTrainer(model=lm.model, args=cfg, reward_funcs=reward, train_dataset=ds,
                          processing_class=lm.tokenizer, callbacks=callbacks)
    trainer.train()
    logs = trainer.state.log_history
    run = {
        "monitored": monitored, "load_s": t_load, "step_s": clock.times, "others_cpu_s": clock.others,
        "trl_step_time": [h["step_time"] for h in logs if "step_time" in h],
        "mean_length": [h["completions/mean_length"] for h in logs if "completions/mean_length" in h],
        "min_length": [h["completions/min_length"] for h in logs if "completions/min_length" in h],
        "model_fp32_bytes": sum(p.numel() * p.element_size() for p in lm.model.parameters()),
    }
    if monitor is not None:
        shadow = monitor._shadow.model
        run["shadow_bytes"] = (sum(p.numel() * p.element_size() for p in shadow.parameters())
                               + sum(b.numel() * b.element_size() for b in shadow.buffers()))
        run["shadow_dtypes"] = sorted({str(p.dtype) for p in shadow.parameters()})
        run["precision_rows"] = sum("precision/beta_abs_mean" in h for h in logs)
        run["beta_abs_mean"] = [h["precision/beta_abs_mean"] for h in logs if "precision/beta_abs_mean" in h]
    del trainer, monitor, lm, callbacks
    gc.collect()
    return run


def isolated_stats_ms(calls: int = 30) -> list[float]:
    """precision_stats on one rank's batch ([8, MAX_LEN]) after a barrier: its own cost with no rank skew."""
    import torch
    import torch.distributed as dist

    from phantomclip.integrations.ranks import precision_stats

    g = torch.Generator().manual_seed(0)
    logp = -3 * torch.rand(GROUP, MAX_LEN, generator=g)
    shadow = logp + 0.05 * torch.randn(GROUP, MAX_LEN, generator=g)
    mask = torch.ones(GROUP, MAX_LEN, dtype=torch.bool)
    adv = torch.randn(GROUP, 1, generator=g)
    out = []
    for _ in range(calls):
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        precision_stats(logp, shadow, mask, adv, 0.2, 0.28)
        out.append(1000 * (time.perf_counter() - t0))
    return out


def worker(args) -> None:
    import torch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    threads = 2 if world == 1 else 1
    torch.set_num_threads(threads)

    import phantomclip.integrations.ranks as ranks
    import phantomclip.integrations.trl as pc_trl

    timers = Timers()
    pc_trl.precision_stats = timers.wrap("precision_stats", pc_trl.precision_stats)  # looked up at call time
    ranks._all_reduce_sum = timers.wrap("all_reduce", ranks._all_reduce_sum)
    ranks._all_gather = timers.wrap("all_gather", ranks._all_gather)
    pc_trl._Shadow.sync = timers.wrap("shadow_sync", pc_trl._Shadow.sync)

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for monitored in (False, True):
                timers.by_step.clear()
                t0 = time.perf_counter()
                run = one_run(monitored, args.steps, f"{tmp}/{r}{int(monitored)}", timers)
                run["wall_s"] = time.perf_counter() - t0
                run["load1"] = os.getloadavg()[0]  # this run's own processes count ~1 per busy core
                run["timers"] = {k: dict(v) for k, v in timers.by_step.items()}
                runs.append(run)
                if rank == 0:
                    steps = [f"{t:.2f}" for _, t in sorted(run["step_s"].items())]
                    others = [f"{t:.1f}" for _, t in sorted(run["others_cpu_s"].items())]
                    print(f"[{world} proc] {'monitored' if monitored else 'plain'} run {r}: steps {steps} s, "
                          f"other processes' CPU during each {others} s, "
                          f"wall {run['wall_s']:.0f} s, 1-min load average at its end {run['load1']:.1f}", flush=True)
    result = {"world": world, "rank": rank, "threads": threads, "runs": runs, "isolated_stats_ms": isolated_stats_ms()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"w{world}-rank{rank}.json").write_text(json.dumps(result))


# ----------------------------------------------------------------------------------------------- driver


def med(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


QUIET = 0.05
"""a step is quiet when other processes used under this share of its wall time in CPU seconds."""


def summarise(ranks: list[dict]) -> dict:
    """Medians over timed steps (warm-up step 0 dropped), pooled over repeats, over every timed step and over the
    quiet ones (QUIET); rank 0's step times (every rank's step ends at the same gradient all-reduce), the monitor's
    parts as the max over ranks per step."""
    r0 = ranks[0]
    steps, lengths = [], []  # one dict per timed step
    for i, run in enumerate(r0["runs"]):
        lengths += run["mean_length"][1:]
        per_rank = [rk["runs"][i]["timers"] for rk in ranks]
        for s, t in run["step_s"].items():
            if int(s) == 0:
                continue
            part = lambda name: max(tm.get(name, {}).get(s, 0.0) for tm in per_rank)  # noqa: E731
            steps.append({"monitored": run["monitored"], "t": t, "others": run["others_cpu_s"][s],
                          "measure": part("measure"), "stats": part("precision_stats"),
                          "coll": part("all_reduce") + part("all_gather"), "sync": part("shadow_sync")})

    def figures(chosen: list[dict]) -> dict:
        plain = [x["t"] for x in chosen if not x["monitored"]]
        mon = [x for x in chosen if x["monitored"]]
        p, m = med(plain), med([x["t"] for x in mon])
        pick = lambda key: med([x[key] for x in mon])  # noqa: E731
        return {"n_plain": len(plain), "n_monitored": len(mon), "plain": p, "monitored": m, "overhead": (m - p) / p,
                "measure": pick("measure"), "measure_share": pick("measure") / p, "stats_ms": 1000 * pick("stats"),
                "coll_ms": 1000 * pick("coll"), "coll_share": pick("coll") / p, "sync": pick("sync")}

    last = [run for run in r0["runs"] if run["monitored"]][-1]
    return {
        "world": r0["world"], "threads": r0["threads"], "all": figures(steps),
        "quiet": figures([x for x in steps if x["others"] < QUIET * x["t"]]),
        "steps": steps, "iso_stats_ms": max(med(rk["isolated_stats_ms"]) for rk in ranks),
        "shadow_mib": last["shadow_bytes"] / 2**20, "shadow_dtypes": last["shadow_dtypes"],
        "model_mib": last["model_fp32_bytes"] / 2**20, "params": last["model_fp32_bytes"] / 4,
        "mean_length": (min(lengths), max(lengths)) if lengths else None, "beta_abs_mean": last["beta_abs_mean"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run (one more, the warm-up, is run first)")
    ap.add_argument("--repeats", type=int, default=2, help="plain/monitored pairs per process count")
    ap.add_argument("--procs", default="1,2")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    kind, model = cpu_kind()
    print(f"CPU kind {kind} ({model}), {os.cpu_count()} CPUs; threads: 2 with 1 process, 1 per process with 2; "
          f"1-min load average before the start {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for n in [int(x) for x in args.procs.split(",")]:
            tail = [str(HERE), "--worker", "--out", out, "--steps", str(args.steps), "--repeats", str(args.repeats)]
            if n == 1:
                cmd = [sys.executable, *tail]
            else:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), *tail]
            t0 = time.perf_counter()
            env = {**os.environ, "OMP_NUM_THREADS": "2" if n == 1 else "1", "BENCH_ROOT_PID": str(os.getpid())}
            subprocess.run(cmd, check=True, env=env)
            print(f"[{n} proc] done in {time.perf_counter() - t0:.0f} s", flush=True)
            rows.append(summarise([json.loads(Path(out, f"w{n}-rank{r}.json").read_text()) for r in range(n)]))
    for which in ("quiet", "all"):
        print(f"\n{which} timed steps" + (f" (other processes' CPU < {QUIET:.0%} of the step)" if which == "quiet"
                                          else ""))
        print("| processes | plain step s | monitored step s | overhead % | measure s (% of plain) | collectives ms "
              "(% of plain) | shadow MiB | model fp32 MiB | steps plain / monitored |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for s in rows:
            f = s[which]
            print(f"| {s['world']} | {f['plain']:.2f} | {f['monitored']:.2f} | {100 * f['overhead']:+.1f} | "
                  f"{f['measure']:.2f} ({100 * f['measure_share']:.1f}%) | {f['coll_ms']:.2f} "
                  f"({100 * f['coll_share']:.3f}%) | {s['shadow_mib']:.0f} | {s['model_mib']:.0f} | "
                  f"{f['n_plain']} / {f['n_monitored']} |")
    print()
    for s in rows:
        f = s["quiet"]
        print(f"{s['world']} proc ({s['threads']} thread(s) each), quiet steps: shadow sync {f['sync']:.2f} s/step; "
              f"precision_stats {f['stats_ms']:.2f} ms/call in the run, {s['iso_stats_ms']:.2f} ms after a barrier; "
              f"completions/mean_length {s['mean_length']} (max {MAX_LEN}); shadow {s['shadow_dtypes']}, "
              f"{s['params'] / 1e6:.1f}M params; beta_abs_mean of the last run "
              f"{[round(b, 4) for b in s['beta_abs_mean']]}")
        for x in s["steps"]:
            kind = "monitored" if x["monitored"] else "plain    "
            print(f"    {kind} {x['t']:6.2f} s, others' CPU {x['others']:5.1f} s, "
                  f"measure {x['measure']:.2f} s, sync {x['sync']:.2f} s, collectives {1000 * x['coll']:.2f} ms")
    print(f"an 8B model's shadow in bf16: 8e9 x 2 bytes = 16 GB ({8e9 * 2 / 2**30:.1f} GiB) per rank")


if __name__ == "__main__":
    main()
