"""One rank of the DeepSpeed ZeRO-3 checks (tests/test_trl_zero3.py starts two with torchrun over gloo, CPU).

Real DeepSpeed, set up as `accelerate launch` with a DeepSpeed config sets it up, except the backend: on CPU,
accelerate needs `ACCELERATE_USE_DEEPSPEED=true` and a `PartialState(backend="gloo")` made first, then
`GRPOConfig(use_cpu=False, deepspeed=..., accelerator_config={"use_configured_state": True})` (with `use_cpu=True`
accelerate sees one process). Each rank takes its half of tests/trl_ranks_worker.py's seeded global batch and writes
to OUT/rank<r>.pt: the monitor's figures and with_shadow_ratio's loss and full gradients under ZeRO-3 (and the
figures under ZeRO-3 with parameter offload to CPU and under ZeRO-2), the shadow against the same model's
unsharded shadow (plain and LoRA), and the log rows of a 2-step `trainer.train()` whose policy was built inside
`zero.Init`.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from trl_ranks_worker import MODEL, B, global_batch, make_trainer, rows


def zero_config(offload_param: str | None = None, stage: int = 3) -> dict:
    """ZeRO-3 (or `stage`) as a user writes it in `deepspeed_config_file`; batch sizes spelled out (the worker
    prepares the model itself, without the Trainer's 'auto' fill). The Trainer's AdamW is not one of DeepSpeed's."""
    zero: dict = {"stage": stage}
    if offload_param:
        zero["offload_param"] = {"device": offload_param}
    return {"zero_optimization": zero, "train_micro_batch_size_per_gpu": B // 2, "gradient_accumulation_steps": 1,
            "zero_allow_untested_optimizer": True}


def zero3_trainer(out_dir: str, cls=None, callbacks=(), steps: int = 1, offload_param: str | None = None,
                  stage: int = 3, **config):
    """make_trainer under a ZeRO-3 config. The policy is built before the config exists, so its weights are those of
    one process (under an enabled ZeRO-3 config transformers builds it inside zero.Init and initialises it
    otherwise); a previous trainer's config and accelerator state are dropped first (transformers keeps a weak
    reference to the config; accelerate takes a DeepSpeed plugin from its first Accelerator only)."""
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state()  # the process group (PartialState) is kept
    return make_trainer(out_dir, cls=cls, callbacks=callbacks, steps=steps, use_cpu=False,
                        deepspeed=zero_config(offload_param, stage), accelerator_config={"use_configured_state": True},
                        **config)


def shard(trainer):
    """Partition the policy as the Trainer does at the start of train(): accelerate's prepare of the model and the
    Trainer's optimizer gives a DeepSpeedEngine; the Trainer keeps the module as `model`, the engine as
    `model_wrapped`."""
    trainer.create_optimizer()
    engine, trainer.optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
    trainer.model_wrapped = trainer.deepspeed = engine
    trainer.current_gradient_accumulation_steps = 1
    engine.train()
    return engine


def full_grads(module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (averaged over the ranks by ZeRO's reduce-scatter); a collective."""
    from deepspeed.utils import safe_get_full_grad

    grads = {}
    for name, p in module.named_parameters():
        g = safe_get_full_grad(p)
        if g is not None:
            grads[name] = g.clone()
    return grads


def counted_gathers(model) -> tuple[int, int, int, int]:
    """A fresh shadow filled from `model` with DeepSpeed's GatheredParameters counted: (gathers, distinct parameters
    gathered, most parameters in one gather, parameters of the model): each once, one at a time."""
    import deepspeed

    from phantomclip.integrations.weights import build_shadow, sync_shadow

    real, seen = deepspeed.zero.GatheredParameters, []

    def counting(params, *args, **kwargs):
        seen.append([id(p) for p in params])
        return real(params, *args, **kwargs)

    deepspeed.zero.GatheredParameters = counting
    try:
        sync_shadow(build_shadow(model, "bfloat16", "cpu"), model)
    finally:
        deepspeed.zero.GatheredParameters = real
    distinct = {i for ids in seen for i in ids}
    return len(seen), len(distinct), max(len(ids) for ids in seen), len(list(model.parameters()))


def main(out: str) -> None:
    torch.set_num_threads(1)  # as the one-process reference: the same GEMM blocking, the same sums
    import deepspeed

    # DeepSpeed's CPU backend compiles its shared-memory all-reduce on first use (deepspeed 0.19.8 comm/torch.py,
    # TorchBackend.__init__; 87 s of CPU here, once per machine): it serves only inference_all_reduce (tensor
    # parallel inference), not ZeRO's all-gathers and reduce-scatters, which go through torch.distributed (gloo)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    from accelerate import PartialState

    PartialState(backend="gloo")
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from phantomclip.integrations.trl import PrecisionMonitor, with_shadow_ratio
    from phantomclip.integrations.weights import build_shadow, sharding_of, sync_shadow
    from phantomclip.models.load import load_model

    record: dict = {"seconds": {}}
    batch = global_batch()
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        record["seconds"][name], clock = time.perf_counter() - clock, time.perf_counter()

    # the monitor's figures on this rank's half: ZeRO-3, ZeRO-3 with the parameters offloaded to CPU, ZeRO-2
    for name, stage, offload in (("zero3", 3, None), ("zero3_offload", 3, "cpu"), ("zero2", 2, None)):
        monitor = PrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)
        trainer = zero3_trainer(f"{out}/{name}", offload_param=offload, stage=stage)
        rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
        lo, hi = rank * B // world, (rank + 1) * B // world
        unsharded = build_shadow(trainer.model, "bfloat16", "cpu")
        sync_shadow(unsharded, trainer.model)
        engine = shard(trainer)
        part = rows(batch, lo, hi, trainer)  # old log-probs from the partitioned model (its hooks gather)
        record[f"{name}_kind"] = sharding_of(trainer.model)
        record[f"{name}_placeholder_numel"] = sum(p.numel() for p in trainer.model.parameters())
        monitor.attach(trainer)
        trainer._compute_loss(engine, part)
        record[f"{name}_stats"] = dict(monitor.last)
        record[f"{name}_shadow_equal"] = {n: torch.equal(p, unsharded.get_parameter(n))
                                          for n, p in monitor._shadow.model.named_parameters()}
        record[f"{name}_released"] = sum(p.numel() for p in trainer.model.parameters())  # placeholders again
        if stage == 3:
            record[f"{name}_gathers"] = counted_gathers(trainer.model)
        del monitor, trainer, engine
        lap(name)

    # with_shadow_ratio: loss and the whole gradients (ZeRO-3 averages them over the ranks, as DDP does)
    shadowed = zero3_trainer(f"{out}/sr", cls=with_shadow_ratio(GRPOTrainer, engine_dtype="bfloat16"))
    engine = shard(shadowed)
    part = rows(batch, lo, hi, shadowed)
    loss = shadowed._compute_loss(engine, part)
    engine.backward(loss)
    record["zero3_loss"] = loss.item()
    record["zero3_grads"] = full_grads(shadowed.model)
    del shadowed, engine
    lap("shadow_ratio")

    # LoRA under ZeRO-3: the shadow holds W + s·BA gathered layer by layer, equal to the unsharded model's shadow
    from test_trl_peft import _lora

    trainer = zero3_trainer(f"{out}/peft")
    torch.manual_seed(4)  # lora_A's init draws from the global generator, which TRL seeds per rank
    trainer.model = trainer.model_wrapped = _lora(trainer.model)
    unsharded = build_shadow(trainer.model, "bfloat16", "cpu")
    sync_shadow(unsharded, trainer.model)
    monitor = PrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)
    engine = shard(trainer)
    part = rows(batch, lo, hi, trainer)
    monitor.attach(trainer)
    trainer._compute_loss(engine, part)
    record["peft_kind"] = sharding_of(trainer.model)
    record["peft_shadow_equal"] = {n: torch.equal(p, unsharded.get_parameter(n))
                                   for n, p in monitor._shadow.model.named_parameters()}
    del trainer, engine, monitor
    lap("peft")

    # trainer.train(): the policy built inside zero.Init (as GRPOTrainer(model="id") loads it under a ZeRO-3 config),
    # with_shadow_ratio and the monitor, 2 steps; every rank's log rows
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state()
    settings = {"use_cpu": False, "deepspeed": zero_config(), "accelerator_config": {"use_configured_state": True}}
    config = load_model(MODEL).model.config
    enabled = GRPOConfig(output_dir=f"{out}/enabled", report_to=[], bf16=False, **settings)  # ZeRO-3 on from here
    policy = AutoModelForCausalLM.from_config(config)  # inside zero.Init: placeholders from the start
    monitor = PrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)
    trainer = make_trainer(f"{out}/train", cls=with_shadow_ratio(GRPOTrainer, engine_dtype="bfloat16"),
                           callbacks=[monitor], steps=2, model=policy, **settings)
    del enabled
    trainer.train()
    record["train_kind"] = sharding_of(trainer.model)
    record["train_log"] = [{k: v for k, v in h.items() if k.startswith("precision/") or k in ("step", "loss", "kl")}
                           for h in trainer.state.log_history]
    lap("train")
    torch.save(record, f"{out}/rank{rank}.pt")
    deepspeed.comm.barrier()
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
