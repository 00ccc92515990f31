"""One GRPO step, ours against TRL's GRPOTrainer, on the bundled model (fp32 trainer, CPU), in the same process.

Workload: one prompt x group of 8, up to 32 completion tokens, reward = -completion length; then a
larger batch, 8 prompts x 8. Both trainers get the same prompts (conversational, the model's chat template),
learning rate 3e-5, one optimizer step per batch, no KL term. TRL generates with Hugging Face `generate`
in fp32 (its CPU default without vLLM); ours samples with its bf16 engine in a background thread
(staleness 1) or on-policy (staleness 0).

Equal lengths: every completion runs to exactly 32 tokens on both sides (TRL: generation_kwargs min_new_tokens;
ours: no stop tokens), so seconds per step compare the same work. Step time: TRL from a callback (on_step_begin
-> on_step_end, generation included); ours is `time/step_s` (the trainer's wall time per step, waiting for the
rollout included). The first step of each run is a warm-up and is left out; medians over the rest. The split's
cost is `time/shadow_old_s` (the producer's forward of the rollout's own weights) over `time/step_s`.

    python bench/benchmarks/bench_trainer.py [--steps 4] [--large-steps 2] [--repeats 2]

Feeds bench/RESULTS.md §4 ("One GRPO step: `phantomclip train` vs TRL's `GRPOTrainer`") and its dated "closed loop at
equal lengths" entries, and docs/results.md "One GRPO step against TRL's `GRPOTrainer`". TRL's step clock is
trl_clock.py, beside it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

torch.set_num_threads(2)
MAX_TOKENS = 32


def trl_steps(prompts: list[str], group: int, steps: int) -> tuple[list[float], list[float]]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from phantomclip.models.load import load_model

    lm = load_model("smollm2-135m")
    from trl_clock import StepClock

    clock = StepClock()
    times = clock.times
    def neglen(completions, completion_ids, **kw):
        return [-float(len(c)) for c in completion_ids]

    n = len(prompts) * group
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts] * (group * (steps + 1))})
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, per_device_train_batch_size=n, num_generations=group, max_completion_length=32,
            learning_rate=3e-5, bf16=False, use_cpu=True, max_steps=steps + 1, logging_steps=1, report_to=[],
            save_strategy="no", temperature=1.0, beta=0.0, loss_type="dapo", shuffle_dataset=False,
            lr_scheduler_type="constant", generation_kwargs={"min_new_tokens": MAX_TOKENS},
        )
        trainer = GRPOTrainer(model=lm.model, args=args, reward_funcs=neglen, train_dataset=ds,
                              processing_class=lm.tokenizer, callbacks=[clock])
        trainer.train()
        lengths = [r["completions/mean_length"] for r in trainer.state.log_history if "completions/mean_length" in r]
    return times[1:], lengths[1:]


def our_rows(prompts: list[str], group: int, steps: int, staleness: int, **engine: str) -> list[dict]:
    """Our trainer's metric rows for `steps` timed steps (a warm-up step first, left out); `engine`: TrainConfig's
    engine and engine_dtype (default: the local bf16 engine)."""
    import phantomclip.models.load
    from phantomclip.training.trainer import TrainConfig, train

    phantomclip.models.load.stop_token_ids = lambda lm: ()  # no stop token: every completion is MAX_TOKENS long

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "prompts.txt"
        path.write_text("\n".join(prompts) + "\n")
        cfg = TrainConfig(steps=steps + 1, prompts_per_step=len(prompts), group_size=group, max_tokens=MAX_TOKENS,
                          staleness=staleness, prompts=str(path), lr=3e-5, **engine)
        return train(cfg).metrics[1:]


def our_steps(
    prompts: list[str], group: int, steps: int, staleness: int
) -> tuple[list[float], list[float], list[float]]:
    rows = our_rows(prompts, group, steps, staleness)
    return ([r["time/step_s"] for r in rows], [r["completion/length_mean"] for r in rows],
            [r["time/shadow_old_s"] / r["time/step_s"] for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--large-steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from phantomclip.models.prompts import bundled_prompts

    pool = bundled_prompts()
    for label, prompts, steps, repeats in (("1 prompt x 8", pool[:1], args.steps, args.repeats),
                                           ("8 prompts x 8", pool[:8], args.large_steps, 1)):
        names = ("TRL GRPOTrainer", "ours, staleness 1", "ours, staleness 0")
        times: dict[str, list[float]] = {n: [] for n in names}
        lengths: dict[str, list[float]] = {n: [] for n in names}
        overhead: list[float] = []
        for _ in range(repeats):  # alternate, so both see the same machine noise
            t, n = trl_steps(prompts, 8, steps)
            times[names[0]] += t
            lengths[names[0]] += n
            for s, name in ((1, names[1]), (0, names[2])):
                t, n, o = our_steps(prompts, 8, steps, s)
                times[name] += t
                lengths[name] += n
                overhead += o if s == 1 else []  # staleness 0 needs no extra forward
        # Lengths are forced to MAX_TOKENS on both sides; tokens/s is kept as a check that they were.
        rate = {n: sum(ln * len(prompts) * 8 for ln in lengths[n]) / sum(times[n]) for n in names}
        trl = statistics.median(times[names[0]])
        print(f"\n{label}, up to 32 tokens, fp32 trainer ({len(times[names[0]])} timed steps each)")
        print("| trainer | s/step (median) | all steps (s) | mean completion length | completion tokens/s "
              "| speed-up vs TRL, s/step | speed-up vs TRL, tokens/s |")
        print("|---|---:|---|---:|---:|---:|---:|")
        for n in names:
            med = statistics.median(times[n])
            print(f"| {n} | {med:.2f} | {', '.join(f'{t:.1f}' for t in times[n])} "
                  f"| {statistics.mean(lengths[n]):.1f} | {rate[n]:.1f} | {trl / med:.2f}x "
                  f"| {rate[n] / rate[names[0]]:.2f}x |")
        print(f"the split's forward (time/shadow_old_s) as a share of our step, staleness 1 (median): "
              f"{100 * statistics.median(overhead):.0f}%")
    from phantomclip.precision.recipes import native_low_precision_cpu

    kind = "AVX-512-BF16/AMX (native bf16)" if native_low_precision_cpu() else "AVX2 only (emulated bf16)"
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, CPU: {kind}")


if __name__ == "__main__":
    main()
