"""The async integration's cost inside TRL's AsyncGRPOTrainer, as one measure: CPU time of the training thread.

    python bench/benchmarks/bench_trl_async_monitor.py
        [--configs monitor@1,monitor@2,fix:trust-region,fix:shadow,fix:decoupled]
        [--rounds 3] [--steps 6] [--max-tokens 32] [--json out.json]
    python bench/benchmarks/bench_trl_async_monitor.py --memory      # bytes per kept version, from shapes (bundled, 8B)

Each run is one fresh process (`--one CONFIG`): the bundled model, fp32 trainer, one thread, TRL 1.16's real async
trainer with the bf16 LocalEngine standing in for the vLLM server (integrations.trl_async_cpu), one group of 8
completions up to `--max-tokens` per step, two sampled per fill (staleness at the loss 0, 1, 1, 2, 1, 2), and one
configuration: the monitor alone at an interval (`monitor@N`), or the fix alone with a ratio (`fix:RATIO`). The
measure of a run:

    cost = hooks' CPU s / TRL's own CPU s

the hooks' thread CPU time (`_Hooks.own_cpu_seconds`: copies at each sync, their forwards, the figures) over the CPU
time TRL's trainer side spends without them: its `training_step` (forward, backward: the hooks' forwards and figures
run inside it and are taken out), its optimizer step and its `_sync_weight` (the hooks' copies run after it) less
the stand-in's own receive (`LocalWeightTransfer.send_weights`: the engine's load, which a real server does in its
own process; its count of changed values, which no real server makes, is off here, `count_changes=False`). Before
2026-12-07 both were in the denominator, the count alone about 2.7 of 35 CPU s. At one thread every product runs on
the timed thread; generation (the stand-in samples in this process, a real server in parallel) is outside both.
Other processes on a shared machine do not inflate CPU time as they do the wall clock (cache and memory-bandwidth
contention remain), so the runs of a round are interleaved (the order reversed every
other round) and the figure is the median over rounds of each configuration's cost.

Feeds bench/RESULTS.md §9 ("`AsyncPrecisionMonitor` overhead inside TRL's `AsyncGRPOTrainer`"), docs/results.md "TRL's
`AsyncGRPOTrainer` on CPU: the async monitor and the fix" and docs/trl.md "The async trainer: monitor and fix" (cost,
memory). bench/experiments/exp_async_ratio.py imports its `cpu_kind`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

CONFIGS = ("monitor@1", "monitor@2", "fix:trust-region", "fix:shadow", "fix:decoupled")


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
    patched before the trainer is built, so TRL's callbacks and the hooks bind the counted method)."""
    original = getattr(cls, name)

    def counted(self, *args, **kwargs):
        c0 = time.thread_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            sink[key or name] += time.thread_time() - c0

    setattr(cls, name, counted)


def build(config: str, steps: int, max_tokens: int, out: str):
    import torch
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from phantomclip.engines.local import LocalEngine
    from phantomclip.integrations.trl_async.cpu import LocalRolloutWorker, LocalWeightTransfer, use_cpu_stand_ins
    from phantomclip.integrations.trl_async.monitor import AsyncPrecisionMonitor, with_async_shadow_ratio
    from phantomclip.models.load import load_model
    from phantomclip.models.prompts import bundled_prompts

    use_cpu_stand_ins()
    lm = load_model("smollm2-135m")
    engine = LocalEngine(copy.deepcopy(lm.model), torch.bfloat16)
    neglen = lambda p, c, ids: [-float(len(i)) for i in ids]  # noqa: E731
    worker = LocalRolloutWorker(engine, lm.tokenizer, bundled_prompts(), neglen, num_generations=8,
                                max_tokens=max_tokens, groups_per_fill=2)
    kind, _, value = config.replace("@", ":").partition(":")
    callbacks = [AsyncPrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2, interval=int(value))] \
        if kind == "monitor" else []
    cls = with_async_shadow_ratio(AsyncGRPOTrainer, ratio=value) if kind == "fix" else AsyncGRPOTrainer
    args = AsyncGRPOConfig(output_dir=out, per_device_train_batch_size=8, num_generations=8,
                           max_completion_length=max_tokens, learning_rate=1e-4, max_steps=steps, logging_steps=1,
                           report_to=[], save_strategy="no", bf16=False, use_cpu=True, token_budget=0, max_staleness=2,
                           seed=0)
    return cls(model=lm.path, args=args, reward_funcs=[], processing_class=lm.tokenizer,
               train_dataset=Dataset.from_dict({"prompt": bundled_prompts()}), rollout_worker=worker,
               weight_transfer=LocalWeightTransfer(engine, count_changes=False), callbacks=callbacks)


def one(config: str, steps: int, max_tokens: int) -> dict:
    """One run of one configuration in this process (the parent starts a fresh one per run)."""
    import tempfile

    import torch
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from phantomclip.integrations.trl_async.cpu import LocalWeightTransfer

    torch.set_num_threads(1)
    cpu = {"training_step": 0.0, "optimizer": 0.0, "sync": 0.0}  # TRL's trainer side, CPU s of this thread
    stand_in = {"receive": 0.0}  # the stand-in server's load, inside _sync_weight: taken out
    cpu_wrap(AsyncGRPOTrainer, "training_step", cpu)
    cpu_wrap(AsyncGRPOTrainer, "_sync_weight", cpu, "sync")
    cpu_wrap(LocalWeightTransfer, "send_weights", stand_in, "receive")
    from transformers import TrainerCallback

    class OptimizerClock(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.c0 = time.thread_time()

        def on_optimizer_step(self, args, state, control, **kwargs):
            cpu["optimizer"] += time.thread_time() - self.c0

    with tempfile.TemporaryDirectory() as out:
        trainer = build(config, steps, max_tokens, out)
        trainer.add_callback(OptimizerClock())
        busy0, own0, t0 = busy_seconds(), own_seconds(), time.perf_counter()
        trainer.train()
        wall, busy, own = time.perf_counter() - t0, busy_seconds() - busy0, own_seconds() - own0
    hooks = trainer._pc_async
    inside = hooks.cpu_by_part["forwards"] + hooks.cpu_by_part["figures"]  # ran within training_step
    trl_own = sum(cpu.values()) - inside - stand_in["receive"]
    stale = [h.get("precision/staleness_share_0") for h in trainer.state.log_history if "loss" in h]
    return {"config": config, "steps": steps, "max_tokens": max_tokens, "cost": hooks.own_cpu_seconds / trl_own,
            "hooks_cpu_s": hooks.own_cpu_seconds, "hooks_cpu_by_part_s": hooks.cpu_by_part, "trl_own_cpu_s": trl_own,
            "trl_cpu_by_part_s": cpu, "stand_in_receive_cpu_s": stand_in["receive"],
            "copies_built_s": sum(getattr(s, "build_seconds", 0.0) for s in hooks.stores.values()),
            "wall_s": wall, "others_cpu_per_wall_s": (busy - own) / wall, "loadavg": os.getloadavg(),
            "staleness_0_by_step": stale}


def memory_table() -> list[dict]:
    """Bytes of one kept version per copy kind, from parameter shapes on the meta device: the bundled SmolLM2-135M
    (its own config) and an 8B Llama (Llama-3.1-8B's published shapes: hidden 4096, 32 layers, MLP 14336, 32/8
    heads, vocabulary 128256, untied head)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    from phantomclip.models.load import load_model

    bundled = AutoConfig.from_pretrained(load_model("smollm2-135m").path)
    llama8b = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)
    rows = []
    for name, config in (("SmolLM2-135M (bundled)", bundled), ("Llama 8B", llama8b)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())  # tied weights once
        rows.append({"model": name, "parameters": params,
                     "shadow bf16 (ratio shadow, monitor), whole per rank": 2 * params,
                     "trainer fp32 (ratio trust-region), across the ranks (/ ranks per rank)": 4 * params,
                     "decoupled": 0})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--memory", action="store_true")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.steps, args.max_tokens)))
        return
    if args.memory:
        print(json.dumps(memory_table(), indent=1))
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    configs, runs = args.configs.split(","), []
    for r in range(args.rounds):
        for config in (configs if r % 2 == 0 else configs[::-1]):
            start = datetime.now(timezone.utc).isoformat(timespec="seconds")
            proc = subprocess.run([sys.executable, __file__, "--one", config, "--steps", str(args.steps),
                                   "--max-tokens", str(args.max_tokens)], capture_output=True, text=True, check=True)
            runs.append({**json.loads(proc.stdout.strip().splitlines()[-1]), "round": r, "start": start})
            print(f"round {r} {config}: cost {100 * runs[-1]['cost']:.1f}% ({runs[-1]['hooks_cpu_s']:.1f} / "
                  f"{runs[-1]['trl_own_cpu_s']:.1f} CPU s), others {runs[-1]['others_cpu_per_wall_s']:.2f} cores",
                  flush=True)
    medians = {c: statistics.median(x["cost"] for x in runs if x["config"] == c) for c in configs}
    result = {"cpu": cpu_kind(), "commit": commit, "median_cost": medians, "runs": runs}
    print(json.dumps(medians, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
