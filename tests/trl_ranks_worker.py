"""One rank of the multi-process TRL checks (tests/test_trl_ranks.py starts two with torchrun over gloo).

Every rank builds the same tiny trainer, takes its half of one seeded global batch (`global_batch`, rows
[rank·B/2, (rank+1)·B/2)) and writes what it measured to OUT/rank<r>.pt: the monitor's figures and the shadow-ratio
loss and gradients under DDP, the figures under FSDP2 and FSDP1, `precision_stats` on uneven inputs (a NaN, a rank
without rows), and the precision rows of a 3-step `trainer.train()` with interval 2. The test compares the ranks
with each other and with one process on the whole batch (the same helpers, imported from here).
"""

from __future__ import annotations

import math
import os
import sys
from typing import NamedTuple

import torch

MODEL = "tiny-random:30"
B, P, L = 8, 3, 6
"""global batch: rows, prompt length, completion length."""


def make_trainer(out_dir: str, cls=None, callbacks=(), steps: int = 1, model=None, **config):
    """A tiny GRPOTrainer on the tiny model (`model`: another policy with the tiny model's vocabulary)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from phantomclip.models.load import load_model, tiny_tokenizer

    torch.manual_seed(0)
    lm = load_model(MODEL) if model is None else None
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=4, num_generations=4, max_completion_length=L,
                      report_to=[], save_strategy="no", bf16=False, logging_steps=1, max_steps=steps,
                      learning_rate=1e-3, seed=0, data_seed=0, **{"use_cpu": True, **config})
    ds = Dataset.from_dict({"prompt": ["hello there", "what is two plus two"] * 8})
    reward = lambda completions, completion_ids, **kw: [float(sum(c) % 7) for c in completion_ids]  # noqa: E731
    return (cls or GRPOTrainer)(model=lm.model if lm else model, args=args, reward_funcs=reward, train_dataset=ds,
                                processing_class=lm.tokenizer if lm else tiny_tokenizer(), callbacks=list(callbacks))


def global_batch() -> dict:
    """B rows of TRL's loss inputs: uneven completion lengths (1 to L tokens), advantages of both signs, and old
    log-probs placed 0.15 nats (in sd) around the tiny model's own fp32 scores, so that some ratios clip."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([6, 5, 1, 4, 6, 2, 3, 6])
    completion_mask = (torch.arange(L)[None, :] < lengths[:, None]).long()  # [B, L]
    return {
        "prompt_ids": torch.randint(0, 250, (B, P), generator=g), "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(0, 250, (B, L), generator=g), "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g), "old_noise": 0.15 * torch.randn(B, L, generator=g),
        "num_items_in_batch": completion_mask.sum().float(),
    }


def rows(batch: dict, lo: int, hi: int, trainer) -> dict:
    """Rows [lo, hi) of the global batch as TRL's `_compute_loss` takes them (old log-probs from `trainer`'s
    model on exactly these rows, so one process scoring the same chunk gets the same numbers)."""
    part = {k: (v if k == "num_items_in_batch" else v[lo:hi]) for k, v in batch.items()}
    noise = part.pop("old_noise")
    ids = torch.cat([part["prompt_ids"], part["completion_ids"]], 1)
    mask = torch.cat([part["prompt_mask"], part["completion_mask"]], 1)
    from trl import GRPOTrainer

    with torch.no_grad():
        logp, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, L)
    part["old_per_token_logps"] = logp + noise
    return part


class RankDDP(NamedTuple):
    """One rank's DDP model for a monitored `_compute_loss` and its share of the global batch."""

    model: torch.nn.Module
    """the trainer's model as accelerate wraps it for DDP (train mode)"""
    rank: int
    world: int
    lo: int
    """this rank's rows of a b-row global batch are [lo, hi): rank·b/world to (rank+1)·b/world"""
    hi: int


def ddp_for_one_step(trainer) -> torch.nn.Module:
    """`trainer`'s model wrapped in DDP by accelerate, in train mode, for one `_compute_loss` call (one accumulation
    step, as TRL's training_step sets it)."""
    ddp = trainer.accelerator.prepare_model(trainer.model)
    trainer.current_gradient_accumulation_steps = 1
    ddp.train()
    return ddp


def monitored_ddp(trainer, monitor, b: int = B) -> RankDDP:
    """The DDP start of every rank's monitored check (here and in routing_ranks_worker): `monitor` attached to
    `trainer` first (it reads the model before accelerate wraps it), then the DDP model and this rank's rows of a
    `b`-row global batch."""
    rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    monitor.attach(trainer)
    return RankDDP(ddp_for_one_step(trainer), rank, world, rank * b // world, (rank + 1) * b // world)


def uneven_inputs(rank: int, world: int) -> list[tuple]:
    """(logp, logp_shadow, mask, advantages) per rank for `precision_stats` alone: rank 0 holds 3 rows with one NaN
    trainer log-prob and one −inf shadow log-prob, the last rank holds no row at all."""
    g = torch.Generator().manual_seed(2)
    logp = -3 * torch.rand(3, 5, generator=g)
    shadow = logp + 0.2 * torch.randn(3, 5, generator=g)
    logp[0, 1], shadow[2, 4] = float("nan"), -math.inf
    per_rank = [(logp, shadow, torch.ones(3, 5, dtype=torch.bool), torch.tensor([1.0, -1.0, 0.5]))]
    per_rank += [(torch.zeros(0, 5), torch.zeros(0, 5), torch.zeros(0, 5, dtype=torch.bool), torch.zeros(0))
                 for _ in range(world - 1)]
    return per_rank


def shard_fsdp2(model) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def shard_fsdp1(model):
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    policy = ModuleWrapPolicy({type(model.model.layers[0])})  # one FSDP unit per decoder layer, one for the root
    return FullyShardedDataParallel(model, device_id=torch.device("cpu"), auto_wrap_policy=policy)


def main(out: str) -> None:
    torch.set_num_threads(1)  # as the one-process reference: the same GEMM blocking, the same sums
    from trl import GRPOTrainer

    from phantomclip.integrations.trl import PrecisionMonitor, precision_stats, with_shadow_ratio

    record: dict = {}
    batch = global_batch()

    # DDP: the monitor's figures on this rank's half
    monitor = PrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)
    trainer = make_trainer(f"{out}/ddp")
    ddp, rank, world, lo, hi = monitored_ddp(trainer, monitor)
    trainer._compute_loss(ddp, rows(batch, lo, hi, trainer))
    record["ddp_stats"] = dict(monitor.last)

    # DDP: with_shadow_ratio's loss and gradients (DDP averages them in backward)
    shadowed = make_trainer(f"{out}/sr", cls=with_shadow_ratio(GRPOTrainer, engine_dtype="bfloat16"))
    # the DDP wrapper is held until backward: its reducer averages the gradients there; passed as a temporary, it was
    # freed when _compute_loss returned and each rank kept its own half's gradients (seen: this file's test failed)
    ddp = ddp_for_one_step(shadowed)
    loss = shadowed._compute_loss(ddp, rows(batch, lo, hi, shadowed))
    loss.backward()
    record["ddp_loss"] = loss.item()
    record["ddp_grads"] = {n: p.grad.clone() for n, p in shadowed.model.named_parameters() if p.grad is not None}

    # precision_stats alone on uneven ranks (NaN, -inf, a rank with no rows)
    record["uneven_stats"] = precision_stats(*uneven_inputs(rank, world)[rank], 0.2, 0.2)

    # FSDP2 (fully_shard driven directly: accelerate refuses FSDP on CPU) and FSDP1
    for kind, shard in (("fsdp2", shard_fsdp2), ("fsdp1", shard_fsdp1)):
        monitor = PrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)
        trainer = make_trainer(f"{out}/{kind}")
        part = rows(batch, lo, hi, trainer)
        wrapped = shard(trainer.model)
        trainer.model = trainer.model_wrapped = wrapped if wrapped is not None else trainer.model
        monitor.attach(trainer)
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()
        trainer._compute_loss(trainer.model, part)
        record[f"{kind}_stats"] = dict(monitor.last)
        record[f"{kind}_shadow_bytes"] = sum(p.numel() * p.element_size() for p in monitor._shadow.model.parameters())
        # with_shadow_ratio on the same shards: its loss on this rank's half (its gradients are FSDP's to reduce)
        shadowed = make_trainer(f"{out}/{kind}-sr", cls=with_shadow_ratio(GRPOTrainer, engine_dtype="bfloat16"))
        part = rows(batch, lo, hi, shadowed)
        wrapped = shard(shadowed.model)
        shadowed.model = shadowed.model_wrapped = wrapped if wrapped is not None else shadowed.model
        shadowed.current_gradient_accumulation_steps = 1
        shadowed.model.train()
        loss = shadowed._compute_loss(shadowed.model, part)
        loss.backward()
        record[f"{kind}_sr_loss"] = loss.item()

    # a real training loop: interval 2, every rank's log history
    monitor = PrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2, interval=2)
    trainer = make_trainer(f"{out}/train", callbacks=[monitor], steps=3)
    trainer.train()
    record["train_log"] = [{k: v for k, v in h.items() if k.startswith("precision/") or k in ("step", "reward")}
                           for h in trainer.state.log_history]
    torch.save(record, f"{out}/rank{rank}.pt")
    # leave together and tear the process group down before exit: a rank exiting while gloo's threads still run can
    # abort in C++ ("terminate called without an active exception", seen once in 2-process runs here)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
