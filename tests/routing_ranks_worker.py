"""One rank of the multi-process route-flip check (tests/test_routing_trl_ranks.py starts two with torchrun over gloo).

Every rank builds the same GRPOTrainer on tiny-moe (trl_ranks_worker.make_trainer), wraps it in DDP with the monitor
attached (trl_ranks_worker.monitored_ddp), takes its half of one seeded global batch (`global_batch`, rows
[rank·B/2, (rank+1)·B/2)) and runs the monitored loss once. It writes to OUT/rank<r>.pt what the PrecisionMonitor
logged (global figures) and the local flips it counted them from (the [layers, B/2·T] tensor `routing.flat_flips`
returned on this rank), which the test compares with one process scoring the same halves (the same helpers, imported
from here).
"""

from __future__ import annotations

import sys

import torch

MODEL = "tiny-moe:0"
B, P, L = 8, 8, 12
"""global batch: rows, prompt length, completion length (B·(P+L)·2 layers = 320 (position, layer) pairs: at tiny-moe's
1-4% bf16 flip rate, several flips on every CPU kind)."""


def global_batch() -> dict:
    """B rows of TRL's loss inputs: uneven completion lengths (1 to L tokens), advantages of both signs, old log-probs
    0.1 nats (sd) around the policy's own (so some ratios clip)."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([12, 9, 1, 7, 12, 3, 5, 12])
    completion_mask = (torch.arange(L)[None, :] < lengths[:, None]).long()  # [B, L]
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, :3] = 0  # a left-padded prompt: its padded positions are not counted
    return {
        "prompt_ids": torch.randint(0, 300, (B, P), generator=g), "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(0, 300, (B, L), generator=g), "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g), "old_noise": 0.1 * torch.randn(B, L, generator=g),
        "num_items_in_batch": completion_mask.sum().float(),
    }


def rows(batch: dict, lo: int, hi: int, trainer) -> dict:
    """Rows [lo, hi) as TRL's `_compute_loss` takes them, old log-probs from `trainer`'s model on exactly these rows."""
    from trl import GRPOTrainer

    part = {k: (v if k == "num_items_in_batch" else v[lo:hi]) for k, v in batch.items()}
    noise = part.pop("old_noise")
    ids = torch.cat([part["prompt_ids"], part["completion_ids"]], 1)  # [b, P + L]
    mask = torch.cat([part["prompt_mask"], part["completion_mask"]], 1)  # [b, P + L]
    with torch.no_grad():
        logp, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, L)
    part["old_per_token_logps"] = logp + noise  # [b, L]
    return part


def make_trainer(out_dir: str, **config):
    """A GRPOTrainer on tiny-moe (its tokenizer is the tiny one trl_ranks_worker uses)."""
    import trl_ranks_worker
    from phantomclip.models.load import load_model

    return trl_ranks_worker.make_trainer(out_dir, model=load_model(MODEL).model, **config)


def recording_flips(store: list):
    """routing.flat_flips, keeping each result in `store` (the flips a monitor counted on this process)."""
    from phantomclip.routing import routes as routing

    original = routing.flat_flips

    def wrapped(a, b, n):
        out = original(a, b, n)
        store.append(out)
        return out

    return original, wrapped


def main(out: str) -> None:
    torch.set_num_threads(1)  # as the one-process reference: the same GEMM blocking, the same routes
    import trl_ranks_worker
    from phantomclip.integrations.trl import PrecisionMonitor
    from phantomclip.routing import routes as routing

    batch = global_batch()
    monitor = PrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)
    trainer = make_trainer(f"{out}/ddp")
    ddp, rank, _, lo, hi = trl_ranks_worker.monitored_ddp(trainer, monitor, B)
    flips: list = []
    original, routing.flat_flips = recording_flips(flips)
    try:
        trainer._compute_loss(ddp, rows(batch, lo, hi, trainer))
    finally:
        routing.flat_flips = original
    torch.save({"stats": dict(monitor.last), "flips": flips}, f"{out}/rank{rank}.pt")
    import torch.distributed as dist  # leave together (see trl_ranks_worker.main)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
