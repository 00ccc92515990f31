"""How the async integration attaches to TRL's AsyncGRPOTrainer, and every misuse refused where it can be known,
in one line: a monitor given to a GRPOTrainer or to two trainers, a TRL whose trainer lives elsewhere or whose
reader, planner, collator or sample differ from trl 1.16's (a probe sample run through them at attach); and a
monitor attached after training began, which measures on from the copies it can still take."""

from __future__ import annotations

import dataclasses
import math
import sys
import types

import pytest
import torch

pytest.importorskip("trl")

import trl_async_setup as setup  # noqa: E402
from phantomclip.integrations.trl_async import checks  # noqa: E402
from phantomclip.integrations.trl_async.monitor import AsyncPrecisionMonitor, IntegrationError  # noqa: E402


@pytest.fixture
def probe_again():
    """The pipeline probe runs once per process: forget that it passed, before and after a test that breaks it."""
    checks.check_pipeline.cache_clear()
    yield
    checks.check_pipeline.cache_clear()


def test_a_monitor_given_to_a_grpo_trainer_is_refused_while_it_is_built(tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from phantomclip.models.load import load_model

    lm = load_model("tiny-random:30")
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, report_to=[], use_cpu=True, save_strategy="no", bf16=False)
    with pytest.raises(IntegrationError, match=r"not GRPOTrainer \(GRPOTrainer: PrecisionMonitor\)") as e:
        GRPOTrainer(model=lm.model, args=args, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                    train_dataset=Dataset.from_dict({"prompt": ["hi"] * 4}), processing_class=lm.tokenizer,
                    callbacks=[AsyncPrecisionMonitor()])
    assert "\n" not in str(e.value)


def test_one_monitor_given_to_two_trainers_is_refused_at_the_second(tmp_path):
    monitor = AsyncPrecisionMonitor()
    first, _ = setup.make_trainer(str(tmp_path / "a"), callbacks=[monitor], steps=1)
    with pytest.raises(IntegrationError, match="already measures another trainer: make a new AsyncPrecisionMonitor"):
        setup.make_trainer(str(tmp_path / "b"), callbacks=[monitor], steps=1)
    assert monitor.trainer is first


def test_attached_after_a_first_train_it_measures_the_second(tmp_path):
    """Trained 2 steps without the monitor (versions 1-3 sent), attached, trained 2 more: the weights have not moved
    since version 3 was sent, so they become its copy at attach; the worker's leftover group of version 2 has none:
    its tokens are named in a warning and counted (no_shadow_total), the step trains, and the next step measures.
    (Before: AttributeError 'NoneType' object has no attribute 'now'.)"""
    trainer, _ = setup.make_trainer(str(tmp_path / "t"), steps=2)
    trainer.train()
    assert trainer.model_version == 3
    monitor = AsyncPrecisionMonitor(epsilon=0.2)
    monitor.attach(trainer)
    assert sorted(trainer._pc_async.stores["engine"].versions) == [3]
    with pytest.warns(UserWarning, match=r"tokens of weight version 2 \(trained at 3\) have no bfloat16 copy"):
        trainer.train()
    rows = [h for h in trainer.state.log_history if "precision/no_shadow_total" in h]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(rows) == 2 and len(losses) == 2 and all(math.isfinite(x) for x in losses)
    first, second = rows
    assert first["precision/no_shadow_total"] > 0 and first["precision/staleness_share_1"] == 1.0
    assert second["precision/no_shadow_total"] == 0 and math.isfinite(second["precision/beta_abs_mean"])


def test_the_trainer_is_found_where_the_installed_trl_keeps_it(monkeypatch):
    """trl >= 1.18 keeps AsyncGRPOTrainer in trl.trainer.async_grpo_trainer (its v1.18.0 release notes), with
    another layout: looked up there first, and refused in one line naming the first difference."""
    assert checks.async_trainer_module().__name__ == "trl.experimental.async_grpo.async_grpo_trainer"  # trl 1.16
    stable = types.ModuleType("trl.trainer.async_grpo_trainer")
    stable.AsyncGRPOTrainer = type("AsyncGRPOTrainer", (), {})
    monkeypatch.setitem(sys.modules, "trl.trainer.async_grpo_trainer", stable)
    assert checks.async_trainer_module() is stable
    with pytest.raises(IntegrationError, match=r"keeps AsyncGRPOTrainer in trl.trainer.async_grpo_trainer, whose "
                                               r"layout differs from trl 1.16's \(trl.trainer.async_grpo_trainer has "
                                               r"no 'StepIntervalCallback'\)"):
        AsyncPrecisionMonitor()


def test_a_collated_batch_without_a_key_the_hooks_read_is_refused_at_attach(tmp_path, monkeypatch, probe_again):
    from trl.experimental.async_grpo import async_grpo_trainer as module

    trainer, _ = setup.make_trainer(str(tmp_path / "k"), steps=1)
    collate = module.DataCollatorForRollout.torch_call
    monkeypatch.setattr(module.DataCollatorForRollout, "torch_call",
                        lambda self, examples: {k: v for k, v in collate(self, examples).items() if k != "segment_id"})
    with pytest.raises(IntegrationError, match="TRL's collated batch has no 'segment_id' as trl 1.16's has"):
        AsyncPrecisionMonitor().attach(trainer)
    assert "_pc_async" not in trainer.__dict__  # nothing replaced


def test_a_reader_or_sample_that_differs_is_refused_at_attach(tmp_path, monkeypatch, probe_again):
    from trl.experimental.async_grpo import async_grpo_trainer as module
    from trl.experimental.async_grpo import async_rollout_worker

    trainer, _ = setup.make_trainer(str(tmp_path / "r"), steps=1)
    read = module.RolloutQueueDataset.__iter__

    def without_group(self):  # a reader that yields samples without the group id the collator and planner read
        for sample in read(self):
            yield {k: v for k, v in sample.items() if k != "group_id"}

    monkeypatch.setattr(module.RolloutQueueDataset, "__iter__", without_group)
    with pytest.raises(IntegrationError, match=r"a probe sample does not pass TRL's reader, planner and collator as "
                                               r"in trl 1.16 \(KeyError: 'group_id'\)"):
        AsyncPrecisionMonitor().attach(trainer)
    monkeypatch.undo()
    fields = [(f.name, f.type) for f in dataclasses.fields(async_rollout_worker.RolloutSample)
              if f.name != "model_version"]
    monkeypatch.setattr(async_rollout_worker, "RolloutSample", dataclasses.make_dataclass("RolloutSample", fields))
    with pytest.raises(IntegrationError, match="RolloutSample has no field 'model_version'"):
        AsyncPrecisionMonitor().attach(trainer)


def test_the_fix_refuses_an_unknown_ratio_and_copies_that_do_not_fit(tmp_path, monkeypatch):
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from phantomclip.integrations.trl_async.monitor import with_async_shadow_ratio

    with pytest.raises(IntegrationError, match="ratio must be one of trust-region, shadow, decoupled .*got 'fp32'"):
        with_async_shadow_ratio(AsyncGRPOTrainer, ratio="fp32")
    monkeypatch.setattr(checks, "available_memory", lambda device: 10_000)
    # fixed-count planner, max_staleness 2: 4 versions kept, this rank's trainable tensors in their dtype, for the
    # default ratio "trust-region" (one process: no stash, the parameters are pointed at a version and back)
    with pytest.raises(IntegrationError, match=r"the async copies need .* GiB \(4 copies of .* GiB in the trainable "
                                               r"parameters' dtype, this rank's shard: staleness bound 3 = "
                                               r"max_staleness 2 \+ prefetch, plus one\)"):
        setup.make_trainer(str(tmp_path / "t"), cls=with_async_shadow_ratio(AsyncGRPOTrainer))
    trainer, _ = setup.make_trainer(str(tmp_path / "d"), cls=with_async_shadow_ratio(AsyncGRPOTrainer,
                                                                                   ratio="decoupled"))
    assert trainer._pc_async.fix == "decoupled" and trainer._pc_async.wanted == set()  # no copies to keep


def test_dropout_is_refused_at_attach_and_at_train(tmp_path):
    """A training-mode forward that drops units makes the fix's no-grad forwards and the loss's differ (ratio no
    longer 1 at staleness 0) and puts dropout noise in the monitor's β: refused in one line when the monitor
    attaches, and when training starts if dropout was added after the fix was built (TRL's async trainer has no
    disable_dropout). Any nn.Dropout with p > 0 counts, LoRA's lora_dropout among them; so does a config rate."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from phantomclip.integrations.trl_async.monitor import with_async_shadow_ratio

    trainer, _ = setup.make_trainer(str(tmp_path / "p"), steps=1)
    trainer.model.model.layers[0].pc_drop = torch.nn.Dropout(0.1)
    with pytest.raises(IntegrationError, match=r"the model has dropout .*lora_dropout=0\.0"):
        AsyncPrecisionMonitor().attach(trainer)
    assert "_pc_async" not in trainer.__dict__  # nothing replaced
    trainer.model.model.layers[0].pc_drop.p = 0.0
    trainer.model.config.attention_dropout = 0.1
    with pytest.raises(IntegrationError, match="the model has dropout"):
        AsyncPrecisionMonitor().attach(trainer)
    fixed, _ = setup.make_trainer(str(tmp_path / "f"), cls=with_async_shadow_ratio(AsyncGRPOTrainer), steps=1)
    fixed.model.config.attention_dropout = 0.1
    with pytest.raises(IntegrationError, match="the model has dropout"):
        fixed.get_train_dataloader()
