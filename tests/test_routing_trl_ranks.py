"""The PrecisionMonitor's route-flip figures on an MoE policy on two processes (torchrun over gloo, CPU, DDP): the same
on both ranks, and equal to one process scoring the same rows in the same chunks.

The ranks run tests/routing_ranks_worker.py; the one-process reference runs here with the worker's own helpers, one
thread as in the workers, on the two halves of the global batch one after the other (the shapes each rank ran), so
every router sees the same inputs and chooses the same experts bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from conftest import run_ranks

pytest.importorskip("trl")

import routing_ranks_worker as worker  # noqa: E402

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks("routing_ranks_worker.py", tmp_path_factory.mktemp("moe-ranks"), WORLD, timeout=180)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Each half scored by one monitored trainer in this process: the flips the monitor counted per half, and the
    halves' masks."""
    from phantomclip.integrations.trl import PrecisionMonitor
    from phantomclip.routing import routes as routing

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    flips: list = []
    original, routing.flat_flips = worker.recording_flips(flips)
    try:
        batch = worker.global_batch()
        monitor = PrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)
        trainer = worker.make_trainer(str(tmp_path_factory.mktemp("moe-one")))
        monitor.attach(trainer)
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()
        halves = [(r * worker.B // WORLD, (r + 1) * worker.B // WORLD) for r in range(WORLD)]
        masks = []
        for lo, hi in halves:
            part = worker.rows(batch, lo, hi, trainer)
            trainer._compute_loss(trainer.model, part)
            masks.append(torch.cat([part["prompt_mask"], part["completion_mask"]], 1))  # [B/2, P + L]
    finally:
        routing.flat_flips = original
        torch.set_num_threads(threads)
    return {"flips": flips, "masks": masks}


def test_route_flips_on_two_ranks_equal_one_process(ranks, one_process):
    """Each rank's flips are the one-process flips of its half, bit for bit; the logged figures are those of both
    halves together (counts summed over the ranks: equal numbers, not merely close), the same on both ranks."""
    from phantomclip.integrations.ranks import route_flip_stats

    ref_flips, masks = one_process["flips"], one_process["masks"]
    assert len(ref_flips) == WORLD and all(f is not None for f in ref_flips)
    for r, rank in enumerate(ranks):
        assert len(rank["flips"]) == 1, r
        assert torch.equal(rank["flips"][0], ref_flips[r]), f"rank {r} routed otherwise than one process on its rows"
    # [layers, B·T] per half, row-major: the halves side by side are the whole batch's flips
    want = route_flip_stats(torch.cat(ref_flips, 1), torch.cat(masks, 0))
    real = torch.cat(masks, 0).bool().reshape(-1)
    flipped = torch.cat(ref_flips, 1)[:, real]  # [layers, N]
    assert flipped.sum() > 0, "no flip to compare: the check would pass on any sum"
    # hand-counted: the rate is flips over (layers x real positions), the share positions flipped in some layer
    assert want["route_flip_rate"] == flipped.sum().item() / flipped.numel()
    assert want["route_any_flip_share"] == flipped.any(0).sum().item() / flipped.shape[1]
    for r, rank in enumerate(ranks):
        got = {k: rank["stats"][k] for k in want}
        assert got == want, (r, got, want)
    # each rank's own rows give another rate, so a figure of rank 0's rows alone would have failed the check above
    local = [route_flip_stats(f, m)["route_flip_rate"] for f, m in zip(ref_flips, masks)]
    assert local[0] != local[1], local
