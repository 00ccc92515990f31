"""One rank of test_integrations_verl_inside.test_counts_over_two_processes: `clip_counts` on this rank's half of the
batch over gloo; writes the reduced figures to <dir>/rank<r>.json."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from phantomclip.integrations.verl import clip_counts

if __name__ == "__main__":
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.load(out / "batch.pt", weights_only=True)
    rows = full["old"].shape[0] // world
    mine = slice(rank * rows, (rank + 1) * rows)
    figures = clip_counts(full["old"][mine], full["new"][mine], full["adv"][mine], full["mask"][mine], 0.2, 0.28)
    (out / f"rank{rank}.json").write_text(json.dumps(figures))
    dist.destroy_process_group()
