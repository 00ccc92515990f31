"""The KL that TRL logs with and without with_shadow_ratio, when TRL weights it by the PPO ratio (docs/trl.md).

TRL 1.16's `use_bias_correction_kl` (on by default) logs and trains on k3(ref − logp) · exp(logp − old) per token
(grpo_trainer.py, `_compute_loss`). Under with_shadow_ratio the ratio is the shadow's, which is exactly 1 at a batch's
first iteration (the same shadow scores `old` and the current weights) whatever dropout does, while TRL's own ratio
compares two forwards with different dropout masks. This runs both on the tiny model with LoRA (lora_dropout 0.3),
β_KL 0.04 and num_iterations=2, same seeds, and prints the logged `kl` per step.

    python bench/checks/trl_kl_bias_correction.py [--steps 4] [--dropout 0.3] [--no-bias-correction]

Feeds docs/trl.md "Which KL TRL logs under with_shadow_ratio" (its table).
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch


def run(shadow: bool, steps: int, dropout: float, bias_correction: bool, out: str) -> list[dict]:
    import peft
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from phantomclip.integrations.trl import with_shadow_ratio
    from phantomclip.models.load import load_model

    torch.manual_seed(0)
    lm = load_model("tiny-random:30")
    model = peft.get_peft_model(lm.model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                           target_modules=["q_proj", "v_proj", "down_proj"]))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # PEFT starts B at 0; a trained adapter does not
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                      report_to=[], use_cpu=True, save_strategy="no", bf16=False, logging_steps=1, max_steps=steps,
                      learning_rate=1e-3, seed=0, data_seed=0, beta=0.04, num_iterations=2,
                      use_bias_correction_kl=bias_correction)
    ds = Dataset.from_dict({"prompt": ["hello there", "what is two plus two"] * 8})
    reward = lambda completions, completion_ids, **kw: [float(sum(c) % 7) for c in completion_ids]  # noqa: E731
    cls = with_shadow_ratio(GRPOTrainer, engine_dtype="bfloat16") if shadow else GRPOTrainer
    trainer = cls(model=model, args=args, reward_funcs=reward, train_dataset=ds, processing_class=lm.tokenizer)
    trainer.train()
    return [{"step": h["step"], "kl": h["kl"]} for h in trainer.state.log_history if "kl" in h]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.3)
    parser.add_argument("--no-bias-correction", action="store_true")
    a = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        rows = {name: run(name == "with_shadow_ratio", a.steps, a.dropout, not a.no_bias_correction, f"{tmp}/{name}")
                for name in ("trl", "with_shadow_ratio")}
    print(json.dumps({"dropout": a.dropout, "bias_correction": not a.no_bias_correction, **rows}))


if __name__ == "__main__":
    main()
