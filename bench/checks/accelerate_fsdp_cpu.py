"""What `accelerate launch --config_file fsdp.yaml` does with a GRPOTrainer on a CPU machine (docs/trl.md).

Writes three accelerate configs (distributed_type FSDP, 2 processes: FSDP2; FSDP1 without sync_module_states; FSDP1
with it), launches this file under each with `accelerate launch`, and prints, from rank 0, what accelerate made of
it: its distributed type, the process count, whether it holds an FSDP plugin, the class that wraps the policy after
`accelerator.prepare_model`, and `integrations.weights.sharding_of` of it (or the error it raised).

    python bench/checks/accelerate_fsdp_cpu.py

Feeds docs/trl.md "FSDP through accelerate on a CPU" (its table).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = {
    "FSDP2": {"fsdp_version": 2, "fsdp_reshard_after_forward": True},
    "FSDP1, sync_module_states false": {"fsdp_version": 1, "fsdp_sharding_strategy": "FULL_SHARD",
                                        "fsdp_sync_module_states": False, "fsdp_cpu_ram_efficient_loading": False},
    "FSDP1, sync_module_states true": {"fsdp_version": 1, "fsdp_sharding_strategy": "FULL_SHARD",
                                       "fsdp_sync_module_states": True},
}


def child() -> None:
    """One rank under accelerate launch: the tests' tiny GRPOTrainer, its model prepared as the Trainer does."""
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from phantomclip.integrations.weights import sharding_of
    from trl_ranks_worker import make_trainer

    try:
        trainer = make_trainer(tempfile.mkdtemp())
        acc = trainer.accelerator
        model = acc.prepare_model(trainer.model)
        result = {"distributed_type": str(acc.distributed_type), "processes": acc.num_processes,
                  "fsdp_plugin": acc.state.__dict__.get("fsdp_plugin") is not None, "wrapper": type(model).__name__,
                  "sharding": sharding_of(model)}
    except Exception as e:  # noqa: BLE001 - the error is the finding
        result = {"error": f"{type(e).__name__}: {e}"}
    if os.environ.get("RANK", "0") == "0":
        print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    import yaml

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fsdp in CONFIGS.items():
            config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "num_machines": 1,
                      "num_processes": 2, "mixed_precision": "no",
                      "fsdp_config": {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                      "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer", **fsdp}}
            path = Path(tmp) / "fsdp.yaml"
            path.write_text(yaml.safe_dump(config))
            proc = subprocess.run(["accelerate", "launch", "--config_file", str(path), __file__, "--child"],
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                                  timeout=600)
            found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            rows[name] = json.loads(found[-1][7:]) if found else {"error": proc.stderr.strip().splitlines()[-1:]}
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    child() if "--child" in sys.argv else main()
