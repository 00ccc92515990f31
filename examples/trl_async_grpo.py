"""Train the bundled SmolLM2-135M with TRL's AsyncGRPOTrainer on CPU, with phantomclip's async monitor and the
ratio fix (reward = −completion length, the reference analysis's sanity task).

    python examples/trl_async_grpo.py [--steps 20] [--max-tokens 64] [--lr 1e-4] [--ratio trust-region|shadow|decoupled]
        [--no-fix] [--interval 1] [--threads 2] [--json rows.json]

TRL's async trainer samples from a vLLM server and syncs weights to it over NCCL; neither exists on a CPU. Here the
server is phantomclip's bf16 LocalEngine in this process (integrations.trl_async_cpu: TRL's rollout-worker and
weight-transfer interfaces, its tree attention on a CPU kernel); everything else is TRL's own: queue, staleness
filter, planner, packing, compute_loss, weight versions. Each fill samples two groups of 8 at the engine's current
weights and each step trains one; as accelerate prefetches the next micro-batch before the step's sync, the
staleness at the loss runs 0, 1, 1, 2, 1, 2, ... and the monitor keys its shadows by each sample's version. The
fix (on unless --no-fix) takes β out of TRL's clip and keeps the clip on the policy's move (`--ratio`, default
trust-region: integrations.trl_async.ratio);
the monitor logs every `--interval` steps (the fix's copies are scored on every step whatever the interval).

Why these defaults: see examples/trl_grpo.py (at a 64-token cap part of each group stops on its own, so the rewards
differ; at lr 1e-4 the length falls within about 10 steps on this model).
"""

import argparse
import copy
import json
import os
import tempfile
import time

import torch
from datasets import Dataset

from phantomclip.engines.local import LocalEngine
from phantomclip.integrations.trl_async import DEFAULT_RATIO, AsyncPrecisionMonitor, with_async_shadow_ratio
from phantomclip.integrations.trl_async.cpu import LocalRolloutWorker, LocalWeightTransfer, use_cpu_stand_ins
from phantomclip.integrations.trl_async.ratio import RATIOS
from phantomclip.models.load import load_model
from phantomclip.models.prompts import bundled_prompts

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402

KEYS = {"length": "sample/trained_tokens_mean", "reward_std": "reward_std", "stale_1": "precision/staleness_share_1",
        "stale_2": "precision/staleness_share_2", "stale_over": "precision/staleness_share_over",
        "beta_abs": "precision/beta_abs_mean", "beta_kernel": "precision/beta_kernel_abs_mean",
        "alpha_abs": "precision/alpha_abs_mean", "clip": "precision/clip_rate",
        "alpha_clip": "precision/alpha_clip_rate", "phantom": "precision/phantom_rate",
        "trl_ratio": "ratio", "trl_clip": "clip_ratio/region_mean", "step_s": "perf/step_s"}
"""what each printed row shows, from TRL's log (precision/*: the monitor's; sample/trained_tokens_mean: TRL's)."""


def neglen(prompts, completions, ids):
    return [-float(len(c)) for c in ids]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=64, help="AsyncGRPOConfig max_completion_length")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--no-fix", action="store_true", help="TRL's own ratio (α + β) in the clip")
    ap.add_argument("--ratio", default=DEFAULT_RATIO, choices=list(RATIOS), help="the fix's ratio")
    ap.add_argument("--interval", type=int, default=1, help="the monitor's: measure every N optimizer steps")
    ap.add_argument("--json", help="write the logged rows here")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (1 on a busy machine: no spinning)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    use_cpu_stand_ins()
    lm = load_model("smollm2-135m")  # fp32 weights, TRL's async trainer loads the same from lm.path
    engine = LocalEngine(copy.deepcopy(lm.model), torch.bfloat16)
    worker = LocalRolloutWorker(engine, lm.tokenizer, bundled_prompts(), neglen, num_generations=8,
                                max_tokens=args.max_tokens, groups_per_fill=2)
    cls = AsyncGRPOTrainer if args.no_fix else with_async_shadow_ratio(AsyncGRPOTrainer, engine_dtype="bfloat16",
                                                                      ratio=args.ratio)
    with tempfile.TemporaryDirectory() as out:
        config = AsyncGRPOConfig(output_dir=out, per_device_train_batch_size=8, num_generations=8,
                                 max_completion_length=args.max_tokens, learning_rate=args.lr, max_steps=args.steps,
                                 logging_steps=1, report_to=[], save_strategy="no", bf16=False, use_cpu=True,
                                 token_budget=0, max_staleness=2, seed=0)
        trainer = cls(model=lm.path, args=config, reward_funcs=[], processing_class=lm.tokenizer,
                      train_dataset=Dataset.from_dict({"prompt": bundled_prompts()}), rollout_worker=worker,
                      weight_transfer=LocalWeightTransfer(engine),
                      callbacks=[AsyncPrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2,
                                                       interval=args.interval)])
        t0 = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - t0
    rows = [{"step": h["step"], **{k: h.get(key) for k, key in KEYS.items()}}
            for h in trainer.state.log_history if "precision/beta_abs_mean" in h]
    for r in rows:
        print(f"step {r['step']:2d}: length {r['length']:5.1f}, reward std {r['reward_std']:5.2f}, staleness "
              f"{r['stale_1'] + 2 * r['stale_2'] + 3 * r['stale_over']:.2g}, mean |β| {r['beta_abs']:.4f} "
              f"(kernel {r['beta_kernel']:.4f}), "
              f"|α| {r['alpha_abs']:.4f}, clip on α+β {100 * r['clip']:.2f}%, on α {100 * r['alpha_clip']:.2f}%, "
              f"phantom {100 * r['phantom']:.2f}%, TRL ratio {r['trl_ratio']:.4f}")
    changed = trainer.weight_transfer.changed_share[1:]  # per sync after the first: bf16 values that moved
    print(f"{args.steps} steps in {seconds:.0f} s ({'TRL ratio' if args.no_fix else args.ratio + ' ratio'} in the "
          "clip); "
          f"share of the engine's bf16 weights changed per sync: {min(changed):.4f} to {max(changed):.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "seconds": seconds, "fix": None if args.no_fix else args.ratio,
                       "steps": args.steps, "changed_share_per_sync": changed,
                       "monitor_and_fix_seconds": trainer._pc_async.own_seconds}, f, indent=1)


if __name__ == "__main__":
    main()
