"""PrecisionMonitor on an MoE policy: the route-flip rate between the trainer's forward and the engine-dtype shadow,
on tiny-moe inside TRL 1.16's GRPOTrainer on CPU."""

import math

import pytest
import torch

trl = pytest.importorskip("trl")

from phantomclip.integrations.trl import PrecisionMonitor  # noqa: E402

KEYS = ("precision/route_flip_rate", "precision/route_any_flip_share")


def _train(tmp_path, model: str, engine_dtype: str, steps: int = 2) -> list[dict]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from phantomclip.models.load import load_model

    torch.manual_seed(0)
    lm = load_model(model)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, report_to=[], use_cpu=True, save_strategy="no", bf16=False,
                      logging_steps=1, max_steps=steps, learning_rate=1e-3, seed=0, data_seed=0)
    ds = Dataset.from_dict({"prompt": ["hello there", "what is two plus two"] * 8})
    reward = lambda completions, completion_ids, **kw: [float(sum(c) % 7) for c in completion_ids]  # noqa: E731
    trainer = GRPOTrainer(model=lm.model, args=args, reward_funcs=reward, train_dataset=ds,
                          processing_class=lm.tokenizer,
                          callbacks=[PrecisionMonitor(engine_dtype=engine_dtype, epsilon=0.2)])
    trainer.train()
    return [h for h in trainer.state.log_history if "precision/beta_abs_mean" in h]


def test_moe_policy_logs_route_flips_against_the_shadow(tmp_path):
    """A bf16 shadow of the fp32 policy chooses other experts somewhere in two steps (tiny-moe flips 1-4% of choices
    in bf16: models.TINY_MOE_ROUTER_STD); an fp32 shadow is the same computation and chooses the same experts, so
    its flip rate is exactly 0."""
    bf16 = _train(tmp_path / "bf16", "tiny-moe:0", "bfloat16")
    assert len(bf16) == 2 and all(k in h for h in bf16 for k in KEYS)
    for h in bf16:
        assert 0 <= h["precision/route_flip_rate"] <= h["precision/route_any_flip_share"] <= 1
    assert max(h["precision/route_flip_rate"] for h in bf16) > 0
    fp32 = _train(tmp_path / "fp32", "tiny-moe:0", "float32", steps=1)
    assert [h["precision/route_flip_rate"] for h in fp32] == [0.0]


def test_dense_policy_has_no_route_keys(tmp_path):
    rows = _train(tmp_path, "tiny-random:30", "bfloat16", steps=1)
    assert rows and not any(k in h for h in rows for k in KEYS)
    assert all(math.isfinite(h["precision/beta_abs_mean"]) for h in rows)
