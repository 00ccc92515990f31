"""AsyncPrecisionMonitor and with_async_shadow_ratio on two processes (torchrun over gloo, CPU): TRL's async trainer
hands each rank one packed row of every micro-batch; the monitor's figures are over both rows, the same on both
ranks, equal to the stats of the two rows' tokens together; both planners train samples as late as
trl_async.versions.staleness_bound says, never later, with every version's copy kept. The ranks run
tests/trl_async_ranks_worker.py."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_close_eps, run_ranks

pytest.importorskip("trl")

import trl_async_ranks_worker as worker  # noqa: E402
import trl_async_setup as setup  # noqa: E402

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("async_ranks")
    setup.model_dir(str(out))  # written once here, read by both ranks
    return run_ranks("trl_async_ranks_worker.py", out, WORLD, timeout=600, TRL_EXPERIMENTAL_SILENCE="1")


def _same(got: float, want: float, scale: float, tokens: int, name: str) -> None:
    """Means: float64 sums of the same float64 terms in another order, each addition rounding by eps64/2 of a
    running sum at most tokens * scale. Counts and rates of counts: equal."""
    if math.isnan(want):
        assert math.isnan(got), name
    else:
        assert_close_eps(got, want, torch.float64, scale, terms=tokens**2, factor=1.0, name=name)


def test_every_rank_logs_the_figures_of_both_rows(ranks):
    from phantomclip.integrations.trl_async.monitor import async_figures, async_precision_stats

    runs = [r["fixed"] for r in ranks]
    assert runs[0]["rows"] == runs[1]["rows"]  # every logged precision figure, on both ranks
    whole = [torch.cat([r["tensors"][i] for r in runs]) for i in range(6)]
    assert all(r["tensors"][0].numel() > 0 for r in runs)  # TRL gives each rank a non-empty row
    want = async_figures(async_precision_stats(*whole, eps_low=0.2, eps_high=0.2, max_staleness=1))
    tokens = whole[0].numel()
    scale = (whole[0] - whole[1]).abs().max().item() + (whole[2] - whole[3]).abs().max().item()
    for r, run in enumerate(runs):
        for key, value in want.items():
            _same(run["last"][key], value, scale, tokens, f"rank {r} {key}")
    # the ranks' own rows differ, so a figure from one rank's tokens would have been that rank's alone
    local = [async_figures(async_precision_stats(*r["tensors"], eps_low=0.2, eps_high=0.2, max_staleness=1))
             for r in runs]  # (computed here without a process group: each rank's tokens alone)
    assert local[0]["beta_abs_mean"] != local[1]["beta_abs_mean"]


def test_staleness_and_the_fix_on_two_ranks(ranks):
    """Fixed-count planner, two groups a micro-batch (one per rank), six sampled per fill, max_staleness 1: the
    loss trains staleness 0, 1, 2 on both ranks (step 3's groups were dequeued one version late, then the prefetch's
    sync came: max_staleness + 1, the bound), every token with its shadow, the fix training on; at staleness 0 the
    ratio TRL logs is exactly 1 on both ranks' tokens."""
    from phantomclip.integrations.trl_async.monitor import staleness_bound

    assert [r["fixed"]["staleness"] for r in ranks] == [[[0], [1], [2]]] * WORLD
    rows = [h for h in ranks[0]["fixed"]["rows"] if "precision/beta_abs_mean" in h]
    shares = [[h[f"precision/staleness_share_{k}"] for k in (0, 1)] + [h["precision/staleness_share_over"]]
              for h in rows]
    assert shares == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]  # the last step's tokens: all over
    assert all(h["precision/no_shadow_total"] == 0 and h["precision/nonfinite_total"] == 0 for h in rows)
    assert all(math.isfinite(h["precision/alpha_abs_mean"]) for h in rows)
    first = next(h for h in ranks[0]["fixed"]["rows"] if "ratio" in h)
    assert first["ratio"] == 1.0 and first["precision/alpha_abs_mean"] == 0.0
    assert all(h["precision/beta_abs_mean"] > 0 for h in rows)
    args = type("Args", (), dict(max_staleness=1, token_budget=0, gradient_accumulation_steps=1,
                                 weight_sync_steps=1))
    assert staleness_bound(args) == 2


def test_token_budget_planner_on_two_ranks(ranks):
    """TRL's token-budget planner (80 tokens a row, two rows a micro-batch), max_staleness 1, ratio "trainer": a
    sample that closed one micro-batch is dequeued during the fetch before its own, so it can train two syncs after
    its dequeue: staleness up to max_staleness + 2 = 3 (reached on rank 0), never more; every token had its copy
    (no_shadow 0), all 6 steps trained, and at staleness 0 the ratio in the trainer's precision is exactly 1
    (the same weights, code and kernels on both sides)."""
    seen = [s for r in ranks for batch in r["budget"]["staleness"] for s in batch]
    assert max(seen) == 3
    rows = [h for h in ranks[0]["budget"]["rows"] if "precision/beta_abs_mean" in h]
    assert len(rows) == 6 and all(h["precision/no_shadow_total"] == 0 for h in rows)
    assert any(h["precision/staleness_share_over"] > 0 for h in rows)
    losses = [h for h in ranks[0]["budget"]["rows"] if "loss" in h]
    assert len(losses) == 6 and losses[0]["ratio"] == 1.0
    assert ranks[0]["budget"]["rows"] == ranks[1]["budget"]["rows"]


def test_decoupled_ratio_on_two_ranks(ranks):
    """ratio "decoupled": π_prox is the live model's no-grad forward at the current weights, so the ratio TRL clips,
    π_θ / π_prox, is exactly 1 on every step on both ranks (one optimizer step per sample) and no clip fires."""
    for r in ranks:
        rows = [h for h in r["decoupled"]["rows"] if "ratio" in h]
        assert [(h["ratio"], h["clip_ratio/region_mean"]) for h in rows] == [(1.0, 0.0)] * 3


def test_uneven_ranks_and_nonfinite_values(ranks):
    """A rank with no token and a NaN on the other neither hang nor skew: the sums are those of the concatenation."""
    from phantomclip.integrations.trl_async.monitor import async_precision_stats

    whole = [torch.cat([worker.uneven_inputs(r)[i] for r in range(WORLD)]) for i in range(6)]
    want = async_precision_stats(*whole, eps_low=0.2, eps_high=0.2, max_staleness=2)
    assert want["sums"]["nonfinite"] == 1 and want["sums"]["tokens"] == 4
    for rank in ranks:
        got = rank["uneven"]
        assert got["beta_abs_p99"] == want["beta_abs_p99"]
        for key, value in want["sums"].items():
            _same(got["sums"][key], value, 4.0, 5, key)
