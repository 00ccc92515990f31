"""One rank of the two-process async checks (tests/test_trl_async_ranks.py starts two with torchrun over gloo).

Each rank trains TRL's AsyncGRPOTrainer (with_async_shadow_ratio and AsyncPrecisionMonitor) for 3 steps on the tiny
model, the main rank's LocalEngine standing in for the vLLM server, and writes to OUT/rank<r>.pt: its log history's
precision rows, the monitor's last figures, its last micro-batch's per-token tensors, and `async_precision_stats`
on uneven inputs (a NaN, a rank without tokens).
"""

from __future__ import annotations

import math
import sys

import torch


def uneven_inputs(rank: int) -> list[torch.Tensor]:
    """Per-token tensors of rank 0 (5 tokens, one NaN engine log-prob) or of another rank (none)."""
    if rank != 0:
        return [torch.zeros(0)] * 5 + [torch.zeros(0, dtype=torch.long)]
    g = torch.Generator().manual_seed(2)
    old = -3 * torch.rand(5, generator=g)
    now = old + 0.2 * torch.randn(5, generator=g)
    logp = now + 0.1 * torch.randn(5, generator=g)
    engine = old + 0.1 * torch.randn(5, generator=g)
    engine[1] = math.nan
    return [logp, engine, now, old, torch.tensor([1.0, -1.0, 0.5, 2.0, -0.3]), torch.tensor([0, 1, 1, 2, 0])]


def main(out: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    import trl_async_setup as setup
    from phantomclip.integrations.trl_async import AsyncPrecisionMonitor, async_precision_stats, with_async_shadow_ratio

    monitor = AsyncPrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)
    trainer, _ = setup.make_trainer(f"{out}/train", cls=with_async_shadow_ratio(AsyncGRPOTrainer),
                                    callbacks=[monitor], steps=3, groups_per_fill=4)
    rank = trainer.accelerator.process_index
    trainer.train()
    rec = trainer._pc_async.last
    record = {
        "rows": [{k: v for k, v in h.items() if k.startswith("precision/") or k in ("step", "ratio")}
                 for h in trainer.state.log_history],
        "last": dict(monitor.last),
        "tensors": [rec.logp, rec.logp_engine, rec.logp_shadow, rec.logp_shadow_old, rec.advantages, rec.staleness],
        "uneven": async_precision_stats(*uneven_inputs(rank), eps_low=0.2, eps_high=0.2, max_staleness=2),
    }
    torch.save(record, f"{out}/rank{rank}.pt")
    dist.barrier()  # leave together (tests/trl_ranks_worker.py: gloo can abort a rank that exits first)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
