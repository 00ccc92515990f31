"""Ratio "trust-region"'s kept versions under FSDP2 on two processes (torchrun over gloo, CPU): each rank keeps its
own shard of a version, and the live model with that version swapped in scores a row as the unsharded version-1
model does in one process; the current weights come back bit for bit (tests/trl_async_fsdp2_worker.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close_eps, run_ranks

pytest.importorskip("trl")


def test_versions_are_kept_per_shard_and_swapped_exactly(tmp_path):
    ranks = run_ranks("trl_async_fsdp2_worker.py", tmp_path, 2, timeout=600)
    for r in ranks:
        assert r["keep"] == 3  # max_staleness 1 with the fixed-count planner: bound 2, versions 0 .. 2
        # each rank keeps its half of the parameters (fully_shard pads an odd first dimension by a row at most)
        assert r["bytes_per_rank"] / (r["keep"] + 1) <= r["full_bytes"] / 2 * 1.01  # + 1: the stash of the shards
        assert not torch.equal(r["now"], r["before"])  # the step moved the weights
        assert torch.equal(r["after"], r["now"])  # the current weights are back, and FSDP2 gathered them afresh
        assert torch.equal(r["swapped"], r["before"])  # version 1 exactly as the sharded model scored it then
        # against one process's unsharded copy: the same fp32 weights, other all-gathered layouts of the same
        # products; one thread each, so a few roundings of log-probs of size up to |log V| ~ 10 at most
        assert_close_eps(r["swapped"], r["reference"], torch.float32, r["reference"].abs().max(), terms=4,
                         factor=4, name="version 1 swapped in vs unsharded")
