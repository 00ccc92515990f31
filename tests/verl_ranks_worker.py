"""One rank of test_integrations_verl_inside's two-process tests, over gloo; writes <dir>/rank<r>.json.

    python -m torch.distributed.run --nproc_per_node 2 tests/verl_ranks_worker.py DIR          `clip_counts` on this
        rank's half of DIR/batch.pt, reduced over both ranks
    python -m torch.distributed.run --nproc_per_node 2 tests/verl_ranks_worker.py DIR groups   (needs verl) verl's
        worker-side `ppo_loss` with loss_mode phantomclip_vanilla on this rank's half, once with dp_group = a group
        of this rank alone and once with dp_group = None (every rank)
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from phantomclip.integrations.verl import clip_counts


def through_ppo_loss(half: dict, group) -> dict:
    from verl.utils.tensordict_utils import assign_non_tensor
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils import losses

    losses.no_padding_2_padding = lambda x, data: x  # the log-probs below are padded already
    config = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
                             clip_ratio_high=0.28, policy_loss={"loss_mode": "phantomclip_vanilla"})
    from tensordict import TensorDict

    data = TensorDict({"response_mask": half["mask"], "old_log_probs": half["old"], "advantages": half["adv"]},
                      batch_size=[half["old"].shape[0]])
    assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    _, metrics = losses.ppo_loss(config, {"log_probs": half["new"].clone()}, data, dp_group=group)
    return {k.removeprefix("phantomclip/actor/"): v.aggregate() for k, v in metrics.items()
            if k.startswith("phantomclip/actor/")}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.load(out / "batch.pt", weights_only=True)
    rows = full["old"].shape[0] // world
    half = {k: v[rank * rows:(rank + 1) * rows] for k, v in full.items()}
    if len(sys.argv) > 2 and sys.argv[2] == "groups":
        alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank makes every group, in one order
        figures = {"alone": through_ppo_loss(half, alone), "every": through_ppo_loss(half, None)}
    else:
        figures = clip_counts(half["old"], half["new"], half["adv"], half["mask"], 0.2, 0.28)
    (out / f"rank{rank}.json").write_text(json.dumps(figures))
    dist.destroy_process_group()
