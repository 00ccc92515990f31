"""Train the bundled SmolLM2-135M with TRL's GRPOTrainer on CPU for a few steps, with phantomclip's precision
monitor on (reward = -completion length, the reference analysis's sanity task).

    python examples/trl_grpo.py [--steps 4] [--shadow-ratio]

The monitor logs precision/beta_mean, precision/beta_abs_mean, precision/beta_abs_p99,
precision/outside_trust_region, precision/phantom_clip_rate and precision/changed_share_at_sync through TRL's
own logging (console here; TensorBoard / W&B / Trackio with report_to). --shadow-ratio also makes the clip
decide on the bf16 shadow ratio.
"""

import argparse
import tempfile

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from phantomclip.integrations.trl import PrecisionMonitor, with_shadow_ratio
from phantomclip.models import load_model
from phantomclip.prompts import bundled_prompts


def neglen(completions, completion_ids, **kwargs):
    return [-float(len(ids)) for ids in completion_ids]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--shadow-ratio", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    lm = load_model("smollm2-135m")  # fp32 weights; TRL's bf16=False keeps the trainer in fp32
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in bundled_prompts()]})
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, per_device_train_batch_size=8, num_generations=8, max_completion_length=32,
                            learning_rate=3e-5, max_steps=args.steps, logging_steps=1, report_to=[], save_strategy="no",
                            bf16=False, use_cpu=True, beta=0.0)
        trainer_cls = with_shadow_ratio(GRPOTrainer, engine_dtype="bfloat16") if args.shadow_ratio else GRPOTrainer
        trainer = trainer_cls(model=lm.model, args=config, reward_funcs=neglen, train_dataset=dataset,
                              processing_class=lm.tokenizer,
                              callbacks=[PrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)])
        trainer.train()
    for row in trainer.state.log_history:
        if "precision/beta_abs_mean" in row:
            print(f"step {row['step']}: mean |β| {row['precision/beta_abs_mean']:.4f}, outside the trust region "
                  f"{100 * row['precision/outside_trust_region']:.2f}%, "
                  f"phantom-clip rate {100 * row['precision/phantom_clip_rate']:.2f}%, "
                  f"completion length {row['completions/mean_length']:.1f}")


if __name__ == "__main__":
    main()
