"""AsyncPrecisionMonitor and with_async_shadow_ratio on two processes (torchrun over gloo, CPU): TRL's async trainer
hands each rank one packed row of every micro-batch; the monitor's figures are over both rows, the same on both
ranks, equal to the stats of the two rows' tokens together. The ranks run tests/trl_async_ranks_worker.py."""

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
    return run_ranks("trl_async_ranks_worker.py", out, WORLD, timeout=300, TRL_EXPERIMENTAL_SILENCE="1")


def _same(got: float, want: float, scale: float, tokens: int, name: str) -> None:
    """Means: float64 sums of the same float64 terms in another order, each addition rounding by eps64/2 of a
    running sum at most tokens * scale. Counts and rates of counts: equal."""
    if math.isnan(want):
        assert math.isnan(got), name
    else:
        assert_close_eps(got, want, torch.float64, scale, terms=tokens**2, factor=1.0, name=name)


def test_every_rank_logs_the_figures_of_both_rows(ranks):
    from phantomclip.integrations.trl_async import async_figures, async_precision_stats

    assert ranks[0]["rows"] == ranks[1]["rows"]  # every logged precision figure, on both ranks
    whole = [torch.cat([r["tensors"][i] for r in ranks]) for i in range(6)]
    assert all(r["tensors"][0].numel() > 0 for r in ranks)  # TRL gives each rank a non-empty row
    want = async_figures(async_precision_stats(*whole, eps_low=0.2, eps_high=0.2, max_staleness=2))
    tokens = whole[0].numel()
    scale = (whole[0] - whole[1]).abs().max().item() + (whole[2] - whole[3]).abs().max().item()
    for r, rank in enumerate(ranks):
        for key, value in want.items():
            _same(rank["last"][key], value, scale, tokens, f"rank {r} {key}")
    # the ranks' own rows differ, so a figure from one rank's tokens would have been that rank's alone
    local = [async_figures(async_precision_stats(*r["tensors"], eps_low=0.2, eps_high=0.2, max_staleness=2))
             for r in ranks]  # (computed here without a process group: each rank's tokens alone)
    assert local[0]["beta_abs_mean"] != local[1]["beta_abs_mean"]


def test_staleness_and_the_fix_on_two_ranks(ranks):
    """Two groups a micro-batch (one per rank), four sampled per fill: the loss trains staleness 0, 1, 1; with the
    fix the ratio TRL logs at staleness 0 is exactly 1 on both ranks' tokens."""
    rows = [h for h in ranks[0]["rows"] if "precision/beta_abs_mean" in h]
    assert [[k for k in range(3) if h[f"precision/staleness_share_{k}"] == 1.0] for h in rows] == [[0], [1], [1]]
    first = next(h for h in ranks[0]["rows"] if "ratio" in h)
    assert first["ratio"] == 1.0 and first["precision/alpha_abs_mean"] == 0.0
    assert all(h["precision/beta_abs_mean"] > 0 for h in rows)


def test_uneven_ranks_and_nonfinite_values(ranks):
    """A rank with no token and a NaN on the other neither hang nor skew: the sums are those of the concatenation."""
    from phantomclip.integrations.trl_async import async_precision_stats

    whole = [torch.cat([worker.uneven_inputs(r)[i] for r in range(WORLD)]) for i in range(6)]
    want = async_precision_stats(*whole, eps_low=0.2, eps_high=0.2, max_staleness=2)
    assert want["sums"]["nonfinite"] == 1 and want["sums"]["tokens"] == 4
    for rank in ranks:
        got = rank["uneven"]
        assert got["beta_abs_p99"] == want["beta_abs_p99"]
        for key, value in want["sums"].items():
            _same(got["sums"][key], value, 4.0, 5, key)
