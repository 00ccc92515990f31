"""Step-time overhead of PrecisionMonitor inside TRL's GRPOTrainer on the bundled model (CPU, fp32 trainer):
monitor off, interval 1, interval 10, alternating in one process. One prompt x 8 completions of up to 32 tokens.

    python bench/bench_trl_monitor.py [--steps 4] [--repeats 2]
"""

import argparse
import statistics
import tempfile

import torch

torch.set_num_threads(2)


def run(interval: int | None, steps: int) -> list[float]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl_clock import StepClock

    from phantomclip.integrations.trl import PrecisionMonitor
    from phantomclip.models import load_model
    from phantomclip.prompts import bundled_prompts

    clock = StepClock()
    times = clock.times
    lm = load_model("smollm2-135m")
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": bundled_prompts()[0]}]] * 8 * (steps + 1)})
    callbacks = [clock] + ([PrecisionMonitor(engine_dtype="bfloat16", interval=interval)] if interval else [])
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(output_dir=out, per_device_train_batch_size=8, num_generations=8, max_completion_length=32,
                         learning_rate=3e-5, bf16=False, use_cpu=True, max_steps=steps + 1, logging_steps=1,
                         report_to=[], save_strategy="no", beta=0.0, shuffle_dataset=False, seed=0,
                         generation_kwargs={"min_new_tokens": 32})  # every completion 32 tokens: equal work per step
        GRPOTrainer(model=lm.model, args=cfg, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                    train_dataset=ds, processing_class=lm.tokenizer, callbacks=callbacks).train()
    return times[1:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    results = {"off": [], "interval 1": [], "interval 10": []}
    for _ in range(args.repeats):
        for name, interval in (("off", None), ("interval 1", 1), ("interval 10", 10)):
            results[name] += run(interval, args.steps)
    base = statistics.median(results["off"])
    print("| monitor | s/step (median) | all steps | overhead vs off |")
    print("|---|---:|---|---:|")
    for name, ts in results.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.2f} | {', '.join(f'{t:.1f}' for t in ts)} | {100 * (med / base - 1):+.0f}% |")


if __name__ == "__main__":
    main()
