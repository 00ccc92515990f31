"""One rank of the FSDP2 check of ratio "trust-region"'s kept versions (tests/test_trl_async_fsdp2.py starts two with
torchrun over gloo): the tiny model sharded with fully_shard (TRL 1.16's async trainer's only sharding), version 1's
shards kept by integrations.trl_async.versions.TrainerVersions, the weights moved by an optimizer step, then the
live model scored with version 1 swapped in and the current weights back. Writes OUT/rank<r>.pt: the log-probs
before the step, with version 1 swapped in, after the swap (current weights), with no swap, and the bytes kept."""

from __future__ import annotations

import copy
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist


def logp(model, kwargs) -> torch.Tensor:
    """[1, T−1] the row's log-probs of its next tokens: the live model's forward, as the fix's forwards call it."""
    ids = kwargs["input_ids"]
    out = model(input_ids=ids).logits.float().log_softmax(-1)  # [1, T, V]
    return out[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from phantomclip.integrations.trl_async.versions import TrainerVersions
    from phantomclip.models.load import load_model

    model = load_model("tiny-random:30").model.float()
    whole = copy.deepcopy(model).eval()  # one process's copy of version 1, never sharded
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.eval()  # no dropout in the tiny model either way; eval keeps the forward deterministic
    args = SimpleNamespace(max_staleness=1, token_budget=0, gradient_accumulation_steps=1, weight_sync_steps=1)
    trainer = SimpleNamespace(model=model, args=args, state=SimpleNamespace(global_step=0))
    kwargs = {"input_ids": torch.arange(3, 19).unsqueeze(0) + 5 * rank}  # each rank its own row
    versions = TrainerVersions(trainer)
    versions.snapshot(1)
    with torch.no_grad():
        before = logp(model, kwargs)
    loss = -logp(model, kwargs).mean()
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    trainer.state.global_step = 1
    versions.snapshot(2)
    with torch.no_grad():
        now = logp(model, kwargs)
        swapped = versions.score(model, kwargs, 1, logp)
        after = logp(model, kwargs)
        reference = logp(whole, kwargs)
    full = sum(p.numel() * p.element_size() for p in whole.parameters())
    torch.save({"before": before, "now": now, "swapped": swapped, "after": after, "reference": reference,
                "bytes_per_rank": versions.bytes_per_rank(), "full_bytes": full, "keep": versions.keep},
               os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
