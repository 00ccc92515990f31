"""One rank of the two-process async checks (tests/test_trl_async_ranks.py starts two with torchrun over gloo).

Each rank trains TRL's AsyncGRPOTrainer on the tiny model, the main rank's LocalEngine standing in for the vLLM
server, three times, and writes to OUT/rank<r>.pt what each run logged and saw:
- "fixed": with_async_shadow_ratio (ratio "shadow") and AsyncPrecisionMonitor, the fixed-count planner, six groups
  sampled per fill and two trained per step (one per rank), max_staleness 1, 3 steps: staleness at the loss 0, 1, 2
  (a group dequeued one version late, then trained after the prefetch's sync: max_staleness + 1). Its log history's
  precision rows, the monitor's last figures, the last micro-batch's per-token tensors;
- "budget": ratio "trainer" and the monitor, TRL's token-budget planner (80 tokens a row), max_staleness 1,
  gradient accumulation 1, 6 steps: each step's staleness at the loss (up to max_staleness + 2);
- "decoupled": ratio "decoupled", the fixed-count planner, 3 steps: TRL's logged ratio and clip rate;
plus `async_precision_stats` on uneven inputs (a NaN, a rank without tokens).
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


def _rows(trainer) -> list[dict]:
    return [{k: v for k, v in h.items() if k.startswith("precision/") or k in ("step", "ratio", "loss",
                                                                              "clip_ratio/region_mean")}
            for h in trainer.state.log_history]


def _train(out: str, name: str, ratio: str, monitor: bool, **config) -> dict:
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    import trl_async_setup as setup
    from phantomclip.integrations.trl_async.monitor import AsyncPrecisionMonitor, with_async_shadow_ratio

    callbacks = [AsyncPrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)] if monitor else []
    trainer, _ = setup.make_trainer(f"{out}/{name}", cls=with_async_shadow_ratio(AsyncGRPOTrainer, ratio=ratio),
                                    callbacks=callbacks, **config)
    staleness = []
    loss = trainer._pc_async._loss

    def noting(*args):  # each micro-batch's staleness at the loss, as the hooks computed it
        value = loss(*args)
        staleness.append(sorted(set(trainer._pc_async.last.staleness.tolist())))
        return value

    trainer._pc_async._loss = noting
    trainer.train()
    rec = trainer._pc_async.last
    return {"rows": _rows(trainer), "staleness": staleness, "last": dict(callbacks[0].last) if monitor else None,
            "tensors": [rec.logp, rec.logp_engine, rec.logp_shadow, rec.logp_shadow_old, rec.advantages,
                        rec.staleness] if monitor else None}


def main(out: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from phantomclip.integrations.trl_async.monitor import async_precision_stats

    record = {
        "fixed": _train(out, "fixed", "shadow", True, steps=3, groups_per_fill=6, max_staleness=1),
        "budget": _train(out, "budget", "trainer", True, steps=6, groups_per_fill=6, max_staleness=1,
                         token_budget=80),
        "decoupled": _train(out, "decoupled", "decoupled", False, steps=3, groups_per_fill=4),
        "uneven": async_precision_stats(*uneven_inputs(dist.get_rank()), eps_low=0.2, eps_high=0.2, max_staleness=2),
    }
    torch.save(record, f"{out}/rank{dist.get_rank()}.pt")
    dist.barrier()  # leave together (tests/trl_ranks_worker.py: gloo can abort a rank that exits first)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
