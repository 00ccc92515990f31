"""A real verl 0.9.1 actor step on the CPU (one process, gloo, FSDP2): verl's TrainingWorker builds its FSDP engine
on a tiny random Llama, recomputes the batch's log-probs (decoupled mode's old_log_probs, `infer_batch`), the
driver's rollout correction adds token-TIS weights from synthetic engine log-probs, and `train_mini_batch` runs
verl's ppo_loss with the given loss_mode, forward, backward and optimizer step.

    python tests/verl_actor_step_worker.py OUT_DIR LOSS_MODE [REPEATS]

writes OUT_DIR/<LOSS_MODE>.pt: the parameters after the step, verl's metrics, the driver's metrics, and the
seconds of each timed step (REPEATS > 1: the first step is excluded as warm-up, each later one starts from the same
weights and batch). The CPU stand-ins are tests/verl_cpu.py's (verl 0.9.1 registers no CPU platform).

    torchrun --nproc_per_node 2 tests/verl_actor_step_worker.py OUT_DIR LOSS_MODE 1 BATCH_FILE

runs the update alone on N data-parallel ranks (FSDP2 over gloo) with the batch a one-process run saved
(BATCH_FILE, its "batch"), each rank holding rows rank, rank + N, ... so that the i-th mini-batch holds the same
sequences as the one-process run's; writes OUT_DIR/rank<r>-<LOSS_MODE>.pt with verl's metrics."""

from __future__ import annotations

import os
import sys
import time
from functools import partial
from pathlib import Path

if "WORLD_SIZE" not in os.environ:  # one process, not under torchrun
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
os.environ["VERL_PLATFORM"] = "cpu"
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import verl_cpu  # noqa: E402, F401  (registers the CPU platform before verl picks one)


def tiny_model_dir(root: Path) -> str:
    from phantomclip.models.load import load_tiny

    path = root / "tiny-llama"
    if not (path / "config.json").exists():
        loaded = load_tiny("tiny-random:0:0.3")
        loaded.model.save_pretrained(path)
        loaded.tokenizer.save_pretrained(path)
    return str(path)


def build_worker(model_dir: str, loss_mode: str, micro: int = 2):
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import (
        FSDPActorConfig,
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
        TrainingWorkerConfig,
    )
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    verl_cpu.register_fsdp_engine_on_cpu()
    engine = FSDPEngineConfig(strategy="fsdp2")  # FSDP1 places modules on an integer accelerator id
    engine.use_dynamic_bsz, engine.micro_batch_size_per_gpu, engine.infer_micro_batch_size_per_gpu = False, micro, micro
    model = HFModelConfig(path=model_dir, override_config={"attn_implementation": "eager"})  # no flash-attn on CPU
    worker = TrainingWorker(TrainingWorkerConfig(model_type="language_model", model_config=model, engine_config=engine,
                                                 optimizer_config=FSDPOptimizerConfig(lr=1e-2),
                                                 checkpoint_config=CheckpointConfig()))
    worker.reset()
    actor = FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=micro, rollout_n=1,
                            clip_ratio_high=0.28, policy_loss={"loss_mode": loss_mode})
    worker.set_loss_fn(partial(ppo_loss, config=actor))
    return worker


def make_batch():
    """4 sequences: prompts of 4 tokens (one left-padded), responses of 6 (one right-padded), as verl's rollout
    returns them."""
    from verl import DataProto

    g = torch.Generator().manual_seed(0)
    B, P, R = 4, 4, 6
    prompts, responses = torch.randint(3, 256, (B, P), generator=g), torch.randint(3, 256, (B, R), generator=g)
    prompt_mask, response_mask = torch.ones(B, P, dtype=torch.long), torch.ones(B, R, dtype=torch.long)
    prompt_mask[0, :2] = 0
    response_mask[1, 4:] = 0
    attention = torch.cat([prompt_mask, response_mask], 1)  # [B, P + R]
    return DataProto.from_dict(tensors={
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention,
        "position_ids": (attention.cumsum(1) - 1).clamp(min=0), "prompts": prompts, "responses": responses,
        "response_mask": response_mask.float(),
        "advantages": torch.tensor([[1.0], [-0.7], [0.4], [-1.2]]).expand(B, R).contiguous()})


def recompute(worker, batch) -> torch.Tensor:
    """The actor's log-probs of the batch, as RayPPOTrainer._compute_old_log_prob gets them (ray_trainer.py)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False, temperature=1.0)
    out = worker.infer_batch(td)
    return no_padding_2_padding(tu.get(out, "log_probs"), td).float()  # [B, R]


def train(worker, batch):
    """One _update_actor as ray_trainer.py builds it: no-padding TensorDict, two mini-batches of 2 sequences (two
    optimizer steps: the second mini-batch's ratio holds the first step's α), one epoch."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                         global_batch_size=2, mini_batch_size=2, epochs=1, seed=1, dataloader_kwargs={"shuffle": False},
                         compute_loss=True, temperature=1.0)
    return tu.get(worker.train_mini_batch(td), "metrics")


def params(worker) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in worker.engine.module.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def ranks_run(out_dir: Path, loss_mode: str, batch_file: Path) -> None:
    """The update alone on this data-parallel rank's rows of a saved batch; verl's metrics to rank<r>-<mode>.pt."""
    from verl import DataProto

    rank, world = dist.get_rank(), dist.get_world_size()
    saved = torch.load(batch_file, weights_only=False)["batch"]
    batch = DataProto.from_dict(tensors={k: v[rank::world].contiguous() for k, v in saved.items()})
    worker = build_worker(str(out_dir / "tiny-llama"), loss_mode, micro=2 // world)  # a mini-batch's share each
    torch.save({"metrics": train(worker, batch)}, out_dir / f"rank{rank}-{loss_mode}.pt")


if __name__ == "__main__":
    out_dir, loss_mode = Path(sys.argv[1]), sys.argv[2]
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    dist.init_process_group("gloo")  # verl asks for "cpu:gloo,cpu:nccl", and NCCL is not built on the CPU
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo import rollout_corr_helper

    import phantomclip.integrations.verl  # noqa: F401  (as VERL_USE_EXTERNAL_MODULES loads it)

    torch.manual_seed(0)
    if len(sys.argv) > 4:
        ranks_run(out_dir, loss_mode, Path(sys.argv[4]))
        dist.destroy_process_group()
        sys.exit(0)
    worker = build_worker(tiny_model_dir(out_dir), loss_mode)
    start_params = params(worker)
    batch = make_batch()
    start = time.perf_counter()
    old = recompute(worker, batch)  # [B, R] decoupled mode's old_log_probs
    recompute_seconds = time.perf_counter() - start
    beta = 0.15 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))  # [B, R] synthetic engine gap
    batch.batch["old_log_probs"], batch.batch["rollout_log_probs"] = old, old - beta
    corr = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)
    batch, driver_metrics = rollout_corr_helper.compute_rollout_correction_and_add_to_batch(batch, corr)
    seconds, metrics = [], None
    for i in range(repeats):
        if i:  # each timed step from the same weights: restore them (and the optimizer's fresh state is not used)
            with torch.no_grad():
                for name, p in worker.engine.module.named_parameters():
                    (p.to_local() if hasattr(p, "to_local") else p).copy_(start_params[name])
        start = time.perf_counter()
        step_metrics = train(worker, batch)
        seconds.append(time.perf_counter() - start)
        metrics = metrics or step_metrics
        if i == 0:
            after = params(worker)
    torch.save({"params": after, "start": start_params, "metrics": metrics, "driver": driver_metrics,
                "seconds": seconds, "recompute_seconds": recompute_seconds, "batch": dict(batch.batch.items())},
               out_dir / f"{loss_mode}.pt")
    dist.destroy_process_group()
