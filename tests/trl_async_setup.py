"""TRL's AsyncGRPOTrainer on the tiny model on CPU, fed by the bf16 LocalEngine (integrations.trl_async_cpu): shared
by tests/test_trl_async.py (one process) and tests/trl_async_ranks_worker.py (each rank of two)."""

from __future__ import annotations

import copy
import os

import torch

MODEL = "tiny-random:30"
PROMPTS = ["hello there", "what is two plus two", "name a colour", "count to three"]
G = 4
"""completions per prompt (one group)."""


def neglen(prompts, completions, completion_ids, **kwargs):
    """minus the completion's length: TRL's reward signature (its worker passes these by name, with the dataset's
    other columns)."""
    return [-float(len(c)) for c in completion_ids]


def spread(prompts, completions, completion_ids, **kwargs):
    """A reward that differs within a group whatever the lengths (the tiny model often fills max_tokens)."""
    return [float(sum(c) % 7) for c in completion_ids]


def model_dir(root: str) -> str:
    """The tiny model saved where TRL's async trainer can load it (it takes a path, not a module)."""
    from phantomclip.models.load import load_model

    path = os.path.join(root, "tiny")
    if not os.path.isfile(os.path.join(path, "config.json")):
        lm = load_model(MODEL)
        lm.model.save_pretrained(path)
        lm.tokenizer.save_pretrained(path)
    return path


def make_trainer(out_dir: str, cls=None, callbacks=(), steps: int = 4, groups_per_fill: int = 2,
                 max_staleness: int = 2, reward=neglen, token_budget: int = 0, **config):
    """A real AsyncGRPOTrainer (or `cls`) whose worker samples with a bf16 LocalEngine copy of the same weights and
    whose weight transfer loads that engine. One group per rank per micro-batch (fixed-count planner, `token_budget`
    0) or as many samples as fit in `token_budget` tokens per row (TRL's token-budget planner); `groups_per_fill`
    groups sampled at once at the engine's current version, so later ones are trained one or more versions late."""
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from phantomclip.engines.local import LocalEngine
    from phantomclip.integrations.trl_async.cpu import LocalRolloutWorker, LocalWeightTransfer, use_cpu_stand_ins
    from phantomclip.models.load import load_model

    use_cpu_stand_ins()
    lm = load_model(MODEL)
    engine = LocalEngine(copy.deepcopy(lm.model), torch.bfloat16)
    worker = LocalRolloutWorker(engine, lm.tokenizer, PROMPTS, reward, num_generations=G, max_tokens=6,
                                groups_per_fill=groups_per_fill)
    args = AsyncGRPOConfig(output_dir=out_dir, per_device_train_batch_size=G, num_generations=G,
                           max_completion_length=6, report_to=[], use_cpu=True, save_strategy="no", bf16=False,
                           logging_steps=1, max_steps=steps, learning_rate=1e-3, token_budget=token_budget,
                           max_staleness=max_staleness, seed=0, **config)
    root = os.path.dirname(out_dir.rstrip("/"))
    trainer = (cls or AsyncGRPOTrainer)(
        model=model_dir(root), args=args, reward_funcs=[], train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=lm.tokenizer, rollout_worker=worker, weight_transfer=LocalWeightTransfer(engine),
        callbacks=list(callbacks))
    return trainer, engine


def batch_with_staleness(trainer):
    """A real collated micro-batch trained one version late: sync (v1), the first batch (the fill samples two
    groups at v1), a weight change, sync (v2), then the second batch: group 1 of version 1 at version 2."""
    trainer.model.train()
    trainer.weight_transfer.init_weight_transfer()
    trainer._sync_weight()
    trainer.rollout_worker.start()
    loader = iter(trainer.get_train_dataloader())
    next(loader)
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for p in trainer.model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))  # a step large enough to move bf16 values
    trainer._sync_weight()
    return trainer._prepare_inputs(next(loader))
