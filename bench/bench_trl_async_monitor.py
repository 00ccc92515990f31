"""Overhead of AsyncPrecisionMonitor (interval 1, bf16 shadows, max_staleness 2) per step of TRL's AsyncGRPOTrainer
on the bundled model, CPU, fp32 trainer, one process, the bf16 LocalEngine standing in for the vLLM server
(integrations.trl_async_cpu). The target: the monitor <= 15% of an async step.

    python bench/bench_trl_async_monitor.py [--steps 4] [--max-tokens 32] [--json out.json]

Timed by the monitor's own clock (`_Hooks.monitor_seconds`: the shadow snapshot at each sync, the shadow forwards at
θ_t and at each sample version present, the figures and their reduction) against TRL's own per-step clocks
(`perf/fwd_bwd_s`, `perf/optimizer_s`, `perf/weight_sync_s`, the monitor's loss-side share included in fwd_bwd):
the trainer side of an async step. Generation is left out of the denominator: in the real trainer the vLLM server
samples in parallel, here the stand-in samples in this process. Also printed: the whole wall time, generation
included, and the CPU seconds other processes used meanwhile (/proc/stat minus this process), since this machine
is shared. 2 groups sampled per fill, one trained per step: staleness at the loss 0, 1, 1, 2, 1, 2 (one extra shadow
forward on every step after the first). Per step too: the monitor's seconds in each step (its clock read at each
step's end, after TRL's sync) over that step's trainer side, and the median of those shares (over all steps, and
after the first, whose share carries the initial sync and the first shadow copy's allocation). On a shared machine
run the arms interleaved (A B B A) at the same niceness and compare medians.

The same shares in CPU time of the training thread (`time.thread_time`), which other processes on a shared machine
do not inflate as they do the wall clock (cache and memory-bandwidth contention remain): the monitor's own CPU clock
(`_Hooks.monitor_cpu_seconds`) against the CPU time of TRL's `training_step` (its fwd_bwd span), its optimizer
step and its `_sync_weight` (the monitor's snapshot runs after it, outside). Exact at `--threads 1`, where every
product runs on that thread; at more threads the pool's CPU time is not counted.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def cpu_kind() -> str:
    text = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    kind = "avx512_bf16" if "avx512_bf16" in flags else ("avx2" if "avx2" in flags else "?")
    return f"{os.cpu_count()}-core {model} ({kind}{', amx' if 'amx_bf16' in flags else ''})"


def busy_seconds() -> float:
    """CPU seconds of the whole machine (user + nice + system), from /proc/stat."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return (int(fields[0]) + int(fields[1]) + int(fields[2])) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_wrap(cls, name: str, sink: dict, key: str | None = None) -> None:
    """Count the CPU time of this thread spent in `cls.name` into sink[key or name] (bench only: the class is
    patched before the trainer is built, so TRL's callbacks and the monitor's hooks bind the counted method)."""
    original = getattr(cls, name)

    def counted(self, *args, **kwargs):
        c0 = time.thread_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            sink[key or name] += time.thread_time() - c0

    setattr(cls, name, counted)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json")
    ap.add_argument("--interval", type=int, default=1, help="the monitor's interval")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (1 on a busy machine: no spinning)")
    args = ap.parse_args()
    import tempfile

    import torch
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from phantomclip.engine import LocalEngine
    from phantomclip.integrations.trl_async import AsyncPrecisionMonitor, shadow_memory
    from phantomclip.integrations.trl_async_cpu import LocalRolloutWorker, LocalWeightTransfer, use_cpu_stand_ins
    from phantomclip.models import load_model
    from phantomclip.prompts import bundled_prompts

    torch.set_num_threads(args.threads)
    use_cpu_stand_ins()
    lm = load_model("smollm2-135m")
    engine = LocalEngine(copy.deepcopy(lm.model), torch.bfloat16)
    neglen = lambda p, c, ids: [-float(len(i)) for i in ids]  # noqa: E731
    worker = LocalRolloutWorker(engine, lm.tokenizer, bundled_prompts(), neglen,
                                num_generations=8, max_tokens=args.max_tokens, groups_per_fill=2)
    monitor = AsyncPrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2, interval=args.interval)
    from transformers import TrainerCallback

    cpu = {"training_step": 0.0, "optimizer": 0.0, "sync": 0.0}  # the trainer side's CPU seconds, TRL's parts
    cpu_wrap(AsyncGRPOTrainer, "training_step", cpu)
    cpu_wrap(AsyncGRPOTrainer, "_sync_weight", cpu, "sync")
    per_step: list[tuple[float, float, float]] = []  # (monitor s, monitor CPU s, trainer side CPU s) up to each
    # step's end, that step's weight sync included (this callback is added after TRL's sync callback)

    class StepClock(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.c0 = time.thread_time()

        def on_optimizer_step(self, args, state, control, **kwargs):
            cpu["optimizer"] += time.thread_time() - self.c0

        def on_step_end(self, args, state, control, **kwargs):
            hooks = trainer._pc_async
            per_step.append((hooks.monitor_seconds, hooks.monitor_cpu_seconds, sum(cpu.values())))
    with tempfile.TemporaryDirectory() as out:
        config = AsyncGRPOConfig(output_dir=out, per_device_train_batch_size=8, num_generations=8,
                                 max_completion_length=args.max_tokens, learning_rate=1e-4, max_steps=args.steps,
                                 logging_steps=1, report_to=[], save_strategy="no", bf16=False, use_cpu=True,
                                 token_budget=0, max_staleness=2, seed=0)
        trainer = AsyncGRPOTrainer(model=lm.path, args=config, reward_funcs=[], processing_class=lm.tokenizer,
                                   train_dataset=Dataset.from_dict({"prompt": bundled_prompts()}),
                                   rollout_worker=worker, weight_transfer=LocalWeightTransfer(engine),
                                   callbacks=[monitor])
        trainer.add_callback(StepClock())  # after TRL's own callbacks: its step-end sync comes first
        busy0, own0, t0 = busy_seconds(), own_seconds(), time.perf_counter()
        trainer.train()
        wall, busy, own = time.perf_counter() - t0, busy_seconds() - busy0, own_seconds() - own0
    rows = [h for h in trainer.state.log_history if "perf/fwd_bwd_s" in h]
    trainer_side = sum(h["perf/fwd_bwd_s"] + h.get("perf/optimizer_s", 0) + h.get("perf/weight_sync_s", 0)
                       for h in rows)
    hooks = trainer._pc_async
    sides = [h["perf/fwd_bwd_s"] + h.get("perf/optimizer_s", 0) + h.get("perf/weight_sync_s", 0) for h in rows]
    mon = [b[0] - a[0] for a, b in zip([(0.0, 0.0, 0.0), *per_step], per_step)]  # the monitor's seconds per step
    shares = [m / t for m, t in zip(mon, sides)]
    mon_cpu = [b[1] - a[1] for a, b in zip([(0.0, 0.0, 0.0), *per_step], per_step)]
    side_cpu = [b[2] - a[2] for a, b in zip([(0.0, 0.0, 0.0), *per_step], per_step)]  # the first: initial sync too
    cpu_shares = [m / t for m, t in zip(mon_cpu, side_cpu)]
    kept, per = shadow_memory(trainer, "bfloat16")
    result = {
        "cpu": cpu_kind(), "steps": args.steps, "interval": args.interval, "max_tokens": args.max_tokens,
        "wall_s": wall,
        "trainer_side_s": trainer_side, "monitor_s": hooks.monitor_seconds,
        "monitor_share_of_trainer_side": hooks.monitor_seconds / trainer_side,
        "monitor_share_of_wall": hooks.monitor_seconds / wall,
        "monitor_parts_s": {**hooks.seconds, "of which building copies": hooks.shadows.build_seconds},
        "monitor_share_without_building": (hooks.monitor_seconds - hooks.shadows.build_seconds) / trainer_side,
        "per_step_monitor_s": mon, "per_step_trainer_side_s": sides, "per_step_share": shares,
        "median_step_share": statistics.median(shares),
        "median_step_share_after_first": statistics.median(shares[1:]) if len(shares) > 1 else None,
        "monitor_cpu_s": hooks.monitor_cpu_seconds, "trainer_side_cpu_s": dict(cpu),
        "cpu_share": hooks.monitor_cpu_seconds / sum(cpu.values()), "per_step_cpu_share": cpu_shares,
        "median_step_cpu_share": statistics.median(cpu_shares),
        "loadavg": os.getloadavg(), "phantomclip": __import__("phantomclip").__file__,
        "others_cpu_s_per_wall_s": (busy - own) / wall, "shadow_bytes": per, "shadows_kept": kept,
        "staleness_1_steps": sum(1 for h in trainer.state.log_history if h.get("precision/staleness_share_1") == 1.0),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
