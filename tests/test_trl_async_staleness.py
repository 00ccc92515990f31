"""How late TRL 1.16's async trainer trains a sample, and the copies the integration keeps for it
(integrations.trl_async_versions): the bound worked by hand from TRL's dequeue, accelerate's prefetch and both
planners, then reached and never passed in TRL's real trainer on one process (two: tests/test_trl_async_ranks.py),
with every token keeping its shadow and every step training."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

pytest.importorskip("trl")

import trl_async_setup as setup  # noqa: E402
from phantomclip.integrations.trl_async.monitor import AsyncPrecisionMonitor, with_async_shadow_ratio  # noqa: E402
from phantomclip.integrations.trl_async.versions import kept_versions, planner_of, staleness_bound  # noqa: E402


def _args(max_staleness=2, token_budget=0, ga=1, sync=1):
    return SimpleNamespace(max_staleness=max_staleness, token_budget=token_budget, gradient_accumulation_steps=ga,
                           weight_sync_steps=sync)


def test_the_bound_worked_by_hand():
    # S + ⌈c / (G·W)⌉, c = 1 (fixed count: a micro-batch is dequeued one fetch before its step, by the prefetch) or
    # 2 (token budget: the sample that closed the micro-batch before was dequeued one more fetch earlier)
    assert staleness_bound(_args()) == 2 + 1
    assert staleness_bound(_args(token_budget=40)) == 2 + 2
    assert planner_of(_args(token_budget=None)) == "token_budget"  # TRL's default: vLLM's max_model_len
    assert staleness_bound(_args(token_budget=None)) == 2 + 2
    assert staleness_bound(_args(token_budget=40, ga=2)) == 2 + 1  # ⌈2/2⌉: both fetches in the previous step
    assert staleness_bound(_args(token_budget=40, sync=2)) == 2 + 1  # ⌈2/2⌉: one sync over two steps
    assert staleness_bound(_args(token_budget=40, ga=2, sync=2)) == 2 + 1  # ⌈2/4⌉
    assert staleness_bound(_args(max_staleness=0, ga=3, sync=2)) == 0 + 1  # ⌈1/6⌉: still one sync, at times
    assert kept_versions(_args(token_budget=40)) == 5  # staleness 0 .. 4


def _run(tmp_path, name: str, ratio: str, steps: int, **config):
    """Train with the fix and the monitor; each micro-batch's staleness at the loss as the hooks computed it."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    monitor = AsyncPrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)
    trainer, _ = setup.make_trainer(str(tmp_path / name), cls=with_async_shadow_ratio(AsyncGRPOTrainer, ratio=ratio),
                                    callbacks=[monitor], steps=steps, **config)
    seen, loss = [], trainer._pc_async._loss

    def noting(*args):
        value = loss(*args)
        seen.append(sorted(set(trainer._pc_async.last.staleness.tolist())))
        return value

    trainer._pc_async._loss = noting
    trainer.train()
    rows = [h for h in trainer.state.log_history if "precision/beta_abs_mean" in h]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, seen, rows, losses


def test_fixed_count_planner_trains_one_version_past_max_staleness(tmp_path):
    """Four groups sampled per fill, one trained per step, max_staleness 2: the fill's last group waits in the queue
    and is dequeued at staleness 2 while step 3's micro-batch is prefetched, then trained after step 3's sync, at
    staleness 3 = the bound. Its shadow is kept: every figure finite, every step trained with the fix on (before
    the bound was kept, this step logged NaN and the fix stopped training)."""
    trainer, seen, rows, losses = _run(tmp_path, "fixed", "shadow", 6, groups_per_fill=4)
    assert seen == [[0], [1], [2], [3], [1], [2]] and staleness_bound(trainer.args) == 3
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert [r["precision/staleness_share_over"] for r in rows] == [0, 0, 0, 1, 0, 0]
    assert all(r["precision/no_shadow_total"] == 0 and math.isfinite(r["precision/alpha_abs_mean"]) for r in rows)
    assert sorted(trainer._pc_async.stores["engine"].versions) == [4, 5, 6, 7]


@pytest.mark.parametrize(("ga", "bound"), [(1, 4), (2, 3)])
def test_token_budget_planner_reaches_its_bound(tmp_path, ga, bound):
    """TRL's token-budget planner, 40 tokens a row (one sample of the tiny model's ~39-45 forwarded tokens, so each
    sample closes the micro-batch before its own), max_staleness 2, ratio "trainer": at gradient accumulation 1 a
    sample is trained up to 2 + 2 versions after its sample's, at 2 up to 2 + 1; reached, never passed, every token
    with its copy in both dtypes, every step trained."""
    trainer, seen, rows, losses = _run(tmp_path, f"budget{ga}", "trainer", 6, groups_per_fill=4, token_budget=40,
                                       gradient_accumulation_steps=ga)
    assert staleness_bound(trainer.args) == bound
    assert max(s for batch in seen for s in batch) == bound
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert all(r["precision/no_shadow_total"] == 0 for r in rows)
    assert any(r["precision/staleness_share_over"] > 0 for r in rows)


def test_versions_are_carried_per_sample():
    """The version reaches the loss per sample, not per group: four samples of one group, two tagged 5 and two 6 (a
    worker that tags each request with the version it was served at), through TRL's own reader, fixed-count planner
    and collator with the integration's reader and collate, come out as [5, 5, 6, 6] in `segment_id` order. TRL
    1.16's own worker tags a whole group with the version at its first request (docs/trl.md)."""
    import queue
    from collections import defaultdict

    import numpy as np
    from trl.experimental.async_grpo import async_grpo_trainer as module
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    from phantomclip.integrations.trl_async.versions import VERSION_KEY, VersionedCollate, VersionReader

    samples = queue.Queue()
    for i, version in enumerate([5, 5, 6, 6]):
        samples.put(RolloutSample(prompt="", completion="", input_ids=np.array([1, 2, 3 + i]),
                                  completion_mask=np.array([0, 1, 1]), old_log_probs=np.zeros(3, dtype=np.float32),
                                  advantage=1.0, model_version=version, group_id=0, metrics={}))
    versions: dict = {}
    reader = module.RolloutQueueDataset(VersionReader(samples, versions), lambda: 6, lambda s: None, 60.0,
                                        defaultdict(list), max_staleness=1)
    rows = next(iter(module.FixedCountBatcher(reader, 1, 4)))
    batch = VersionedCollate(module.DataCollatorForRollout(0, 1), versions, 3)([rows])
    assert batch[VERSION_KEY].tolist() == [[5, 5, 6, 6]] and versions == {}
    assert batch["segment_id"][0].unique().tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("ratio", ["trust-region", "shadow", "decoupled"])
def test_offpolicy_signals_at_every_staleness(tmp_path, ratio):
    """The fix's offpolicy/* figures, logged under every ratio on every step, present and finite at staleness 0 ..
    the bound (3, the fixed-count run above): |α| at the step's one staleness k and NaN (no tokens) at the others;
    |α| = 0 exactly at staleness 0 (the same forward both sides) and under "decoupled" at every staleness (its ratio
    is π_θ/π_prox: by definition), > 0 otherwise; the weight 1 under "shadow" (it has none), a mean near 1 and an
    effective sample size in (0, 1] under the others; every token with its copy."""
    trainer, seen, _, losses = _run(tmp_path, ratio, ratio, 6, groups_per_fill=4)
    assert seen == [[0], [1], [2], [3], [1], [2]] and len(losses) == 6
    rows = [h for h in trainer.state.log_history if "offpolicy/staleness_mean" in h]
    assert len(rows) == 6
    for row, (k,) in zip(rows, seen, strict=True):
        assert row["offpolicy/staleness_mean"] == k == row["offpolicy/staleness_max"]
        alpha = row[f"offpolicy/alpha_abs_mean_s{k}"]
        assert all(math.isnan(row[f"offpolicy/alpha_abs_mean_s{j}"]) for j in range(4) if j != k)
        assert alpha == 0 if ratio == "decoupled" or k == 0 else alpha > 0
        for key in ("weight_mean", "weight_max", "weight_ess", "capped_share", "clip_rate"):
            assert math.isfinite(row[f"offpolicy/{key}"]), key
        if ratio == "shadow":
            assert (row["offpolicy/weight_mean"], row["offpolicy/weight_max"], row["offpolicy/capped_share"]) == (
                1, 1, 0)
        else:  # ESS = (Σw)² / (n Σw²) <= 1 by Cauchy-Schwarz; fp64 sums of at most ~100 terms near 1
            assert 0 < row["offpolicy/weight_ess"] <= 1 + 1e-12 and 0.5 < row["offpolicy/weight_mean"] < 2
        assert row["offpolicy/no_copy_total"] == 0
